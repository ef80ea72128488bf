"""``expand_kernel_on_cpu`` (``patches/cpu_expand_kernel.py``) on its own: it fills every dtype as
vLLM's Triton kernel does (in the engine: ``tests/engine/plugin/test_sampling.py``)."""

import pytest

from vllm_mtp_plugin.patches.expand_kernel_on_cpu import cpu_expand_kernel


def test_cpu_expand_kernel_fills_every_dtype_like_vllms_triton_kernel():
    import torch

    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    for dtype in (torch.float32, torch.int32, torch.int64):
        output = torch.full((6,), -7, dtype=dtype)
        cpu_expand_kernel(output, torch.tensor([3, -1, 5], dtype=dtype), cu, -1, 1)
        assert output.tolist() == [3, 3, 1, 1, 1, 5], dtype
    temperatures = torch.empty(4, dtype=torch.float32)
    cpu_expand_kernel(temperatures, torch.tensor([0.7, 1.3]), torch.tensor([1, 4]), -1, 1)
    assert temperatures.tolist() == pytest.approx([0.7, 1.3, 1.3, 1.3])
