"""Which expert slots of a fused-MoE parameter this rank must fill, asked of vLLM's own MoE layer.

Two deployments make that differ from "routed experts 0 .. n_routed-1":

* Expert parallelism: a rank holds only its own experts. With ``--enable-ep-weight-filter`` vLLM's
  weight iterator does not even read the others' weights (``model_loader/ep_weight_filter.py``), so
  a complete load brings this rank's experts only.
* ROCm AITER fused shared experts (``VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=1``): vLLM builds no
  ``shared_experts`` MLP; the shared experts become experts ``n_routed + j`` of the fused tensors,
  on every rank (``fused_moe/expert_map_manager.py``).

The fused-MoE parameters carry their layer's ``weight_loader`` (a bound method), so the layer is
reached from the parameter alone. Where what is read here is not found (vLLM renamed it, or another
MoE layer holds the parameter), nothing is assumed: vLLM's own ``weight_loader`` keeps the experts
this rank holds and drops the others, as without the plugin, and the loader refuses only experts
the checkpoint has in part. One warning per process names what was not found.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

logger = logging.getLogger("vllm.vllm_mtp_plugin")

# What vLLM's fused-MoE layer (vLLM 0.32: ``RoutedExperts``) is asked.
EXPERT_MAP = "_map_global_expert_id_to_local_expert_id"
FUSED_SHARED_COUNT = "num_fused_shared_experts"
_warned: set[str] = set()


def moe_layer(param):
    """The fused-MoE layer whose ``weight_loader`` ``param`` carries, or ``None``."""
    return getattr(getattr(param, "weight_loader", None), "__self__", None)


def _not_found(what: str, param, consequence: str) -> None:
    if what in _warned:
        return
    _warned.add(what)
    layer = moe_layer(param)
    holder = "no MoE layer" if layer is None else type(layer).__name__
    logger.warning("vllm-mtp-plugin: %s not found (the fused-MoE parameter's weight_loader belongs "
                   "to %s); %s", what, holder, consequence)


def fused_shared_experts(param) -> int:
    """How many shared experts vLLM fused into ``param``'s expert slots (0: kept apart).

    vLLM 0.32 keeps the count on the layer's ``expert_map_manager``; earlier releases on the layer.
    Where neither has it, 0 with a warning: shared experts stored for fused slots cannot be placed.
    """
    layer = moe_layer(param)
    holder = getattr(layer, "expert_map_manager", layer)
    count = getattr(holder, FUSED_SHARED_COUNT, None)
    if count is None:
        _not_found(f"{FUSED_SHARED_COUNT} (on the MoE layer or its expert_map_manager)", param,
                   "shared experts are taken to be kept apart from the routed ones; a checkpoint "
                   "whose shared experts vLLM fused into expert slots cannot be loaded.")
        return 0
    return int(count or 0)


def local_experts(param, num_routed: int, seen: Iterable[int] = ()) -> set[int]:
    """Global ids of the experts this rank holds in ``param``: its routed experts (all of them
    without expert parallelism) and the fused shared experts ``num_routed + j``.

    Asked of the same mapping the layer's ``weight_loader`` uses to place (or drop) an expert.
    Where that mapping is not found, the routed experts in ``seen`` (those the checkpoint brought):
    vLLM's ``weight_loader`` decided which of them this rank keeps, and an expert absent from the
    checkpoint cannot be told apart from another rank's.
    """
    to_local = getattr(moe_layer(param), EXPERT_MAP, None)
    if to_local is None:
        _not_found(EXPERT_MAP, param,
                   "which experts this rank holds is left to vLLM's weight_loader, and a load is "
                   "refused only for experts the checkpoint has in part (an expert missing as a "
                   "whole is not detected).")
        routed = [e for e in seen if e is not None and e < num_routed]
    else:
        routed = [e for e in range(num_routed) if int(to_local(e)) != -1]
    return set(routed) | {num_routed + j for j in range(fused_shared_experts(param))}
