"""DeepSeek-V4 ``hc_head`` in plain PyTorch, and its place in vLLM's custom-op dispatch.

``hc_head`` collapses the ``hc_mult`` residual streams of a V4 hidden state into one (docs/v4.md):

    xf  = x.flatten(-2) in fp32                                     # (T, hc_mult*H)
    mix = (xf * rsqrt(mean(xf^2) + rms_eps)) @ hc_fn.T              # (T, hc_mult)
    pre = sigmoid(mix * hc_scale + hc_base) + hc_eps
    y   = sum_m pre[:, m] * x[:, m, :]                              # (T, H)

vLLM's ``HCHeadOp`` has kernels for CUDA (tilelang), ROCm, XPU and CPU, and a ``forward_native``
that raises, so on an out-of-tree platform without a kernel of its own the op fails. ``PortableHCHeadOp``
is vLLM's op with this formula as its native/out-of-tree path; ``register_portable_hc_head`` puts it
in vLLM's out-of-tree op registry (``CustomOp.register_oot``) on out-of-tree platforms, so every
``HCHeadOp()`` built afterwards dispatches to it there (the drafter registers it when it is built,
which is after its target). Kernels that exist keep being used: CUDA/ROCm/XPU/CPU dispatch is
untouched, and a platform that registered its own ``HCHeadOp`` replacement first keeps it.
"""

import torch
from vllm.model_executor.custom_op import CustomOp, op_registry_oot
from vllm.model_executor.layers.mhc import HCHeadOp

from .platform import platform_family


def hc_head(
    hidden_states: torch.Tensor,
    hc_fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    rms_norm_eps: float,
    hc_eps: float,
) -> torch.Tensor:
    """``(..., hc_mult, H)`` -> ``(..., H)`` in the input's dtype; the arithmetic is fp32."""
    streams = hidden_states.float()
    flat = streams.flatten(-2)
    normed = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + rms_norm_eps)
    mix = normed @ hc_fn.float().t()
    pre = torch.sigmoid(mix * hc_scale.float() + hc_base.float()) + hc_eps
    return (pre.unsqueeze(-1) * streams).sum(-2).to(hidden_states.dtype)


class PortableHCHeadOp(HCHeadOp):
    """vLLM's ``HCHeadOp`` whose native and out-of-tree paths are the plain-PyTorch ``hc_head``."""

    def forward_native(self, hidden_states, hc_fn, hc_scale, hc_base, rms_norm_eps, hc_eps):
        return hc_head(hidden_states, hc_fn, hc_scale, hc_base, rms_norm_eps, hc_eps)

    def forward_oot(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)


def register_portable_hc_head() -> bool:
    """On an out-of-tree platform, make ``HCHeadOp()`` build ``PortableHCHeadOp``.

    Returns whether ours is the registered one. Idempotent; leaves a platform's own registration.
    """
    if platform_family() != "oot":
        return False
    if HCHeadOp.__name__ not in op_registry_oot:
        CustomOp.register_oot(PortableHCHeadOp, name=HCHeadOp.__name__)
    return op_registry_oot[HCHeadOp.__name__] is PortableHCHeadOp


def hc_head_op() -> HCHeadOp:
    """The ``hc_head`` op for this platform: its kernel, or the portable one out of tree."""
    register_portable_hc_head()
    return HCHeadOp()
