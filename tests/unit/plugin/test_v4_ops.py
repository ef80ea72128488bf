"""The portable ``hc_head`` against the formula, computed independently, and against vLLM's CPU kernel."""

import pytest
import torch
from support.hardware import needs_cpu

from vllm_mtp_plugin.ops import PortableHCHeadOp, hc_head, hc_head_op, register_portable_hc_head
from vllm_mtp_plugin.tools.cpu_features import AVX512_BF16

RMS_EPS, HC_EPS = 1e-6, 1e-6


def reference(x, fn, scale, base, rms_eps=RMS_EPS, hc_eps=HC_EPS):
    """docs/v4.md's formula, one token and one stream at a time, in float64."""
    tokens, hc, hidden = x.shape
    out = torch.empty(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        flat = x[t].double().reshape(-1)
        inv_rms = 1.0 / torch.sqrt((flat * flat).sum() / flat.numel() + rms_eps)
        y = torch.zeros(hidden, dtype=torch.float64)
        for m in range(hc):
            mix = (flat * inv_rms * fn[m].double()).sum()
            pre = torch.sigmoid(mix * scale.double()[0] + base.double()[m]) + hc_eps
            y += pre * x[t, m].double()
        out[t] = y
    return out


def inputs(dtype, tokens=5, hc=4, hidden=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, hc, hidden, generator=g) * 3).to(dtype)
    fn = torch.randn(hc, hc * hidden, generator=g) * 0.05
    scale = torch.tensor([0.7])
    base = torch.randn(hc, generator=g)
    return x, fn, scale, base


@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float32, 1e-5, 1e-5),
                                               (torch.bfloat16, 0.05, 0.01)])
def test_hc_head_matches_the_formula(dtype, atol, rtol):
    x, fn, scale, base = inputs(dtype)
    out = hc_head(x, fn, scale, base, RMS_EPS, HC_EPS)
    assert out.shape == (5, 64) and out.dtype == dtype
    torch.testing.assert_close(out.double(), reference(x, fn, scale, base), atol=atol, rtol=rtol)


def test_hc_head_with_zero_mixer_weights_is_a_sigmoid_of_the_base():
    """fn = 0: every token mixes its streams with sigmoid(base) + eps, whatever its values."""
    x, _, scale, _ = inputs(torch.float32)
    base = torch.tensor([0.0, 2.0, -2.0, 100.0])
    out = hc_head(x, torch.zeros(4, 256), scale, base, RMS_EPS, 0.5)
    weights = torch.sigmoid(base) + 0.5  # 1.0, 1.3808, 0.6192, 1.5
    torch.testing.assert_close(out, (weights[None, :, None] * x).sum(1))
    assert weights.tolist() == pytest.approx([1.0, 1.380797, 0.619203, 1.5], abs=1e-6)


def test_hc_head_keeps_leading_dimensions():
    x, fn, scale, base = inputs(torch.float32, tokens=6)
    out = hc_head(x.view(2, 3, 4, 64), fn, scale, base, RMS_EPS, HC_EPS)
    assert out.shape == (2, 3, 64)  # a flattened (6, 64) would pass the comparison below
    torch.testing.assert_close(out.reshape(6, 64), hc_head(x, fn, scale, base, RMS_EPS, HC_EPS))


@needs_cpu(AVX512_BF16, part="vLLM's CPU hc_head kernel (_C.hc_head_fused_cpu)")
def test_hc_head_agrees_with_vllms_cpu_kernel_in_bf16():
    from vllm.model_executor.kernels.mhc import hc_head_fused_cpu

    x, fn, scale, base = inputs(torch.bfloat16, tokens=7, hidden=256)
    kernel = hc_head_fused_cpu(x, fn, scale, base, RMS_EPS, HC_EPS)
    ours = hc_head(x, fn, scale, base, RMS_EPS, HC_EPS)
    assert kernel.shape == ours.shape == (7, 256)
    torch.testing.assert_close(ours.float(), kernel.float(), atol=0.05, rtol=0.01)


def test_portable_op_native_path_is_hc_head_and_cpu_keeps_vllms_dispatch():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.custom_op import op_registry_oot

    with set_current_vllm_config(VllmConfig()):
        assert register_portable_hc_head() is False  # in-tree platform: registry untouched
        assert "HCHeadOp" not in op_registry_oot
        op = hc_head_op()
        assert type(op).__name__ == "HCHeadOp" and op._forward_method == op.forward_cpu
        x, fn, scale, base = inputs(torch.float32)
        portable = PortableHCHeadOp()
        torch.testing.assert_close(portable.forward_native(x, fn, scale, base, RMS_EPS, HC_EPS),
                                   hc_head(x, fn, scale, base, RMS_EPS, HC_EPS))
        torch.testing.assert_close(portable.forward_oot(x, fn, scale, base, RMS_EPS, HC_EPS),
                                   hc_head(x, fn, scale, base, RMS_EPS, HC_EPS))
