"""Which expert slots of a fused-MoE parameter this rank must fill, asked of vLLM's own MoE layer.

Two deployments make that differ from "routed experts 0 .. n_routed-1":

* Expert parallelism: a rank holds only its own experts. With ``--enable-ep-weight-filter`` vLLM's
  weight iterator does not even read the others' weights (``model_loader/ep_weight_filter.py``), so
  a complete load brings this rank's experts only.
* ROCm AITER fused shared experts (``VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=1``): vLLM builds no
  ``shared_experts`` MLP; the shared experts become experts ``n_routed + j`` of the fused tensors,
  on every rank (``fused_moe/expert_map_manager.py``).

The fused-MoE parameters carry their layer's ``weight_loader`` (a bound method), so the layer is
reached from the parameter alone; a parameter without one (older or other MoE layers) is taken to
hold every routed expert and no shared one.
"""

from __future__ import annotations


def moe_layer(param):
    """The fused-MoE layer whose ``weight_loader`` ``param`` carries, or ``None``."""
    return getattr(getattr(param, "weight_loader", None), "__self__", None)


def fused_shared_experts(param) -> int:
    """How many shared experts vLLM fused into ``param``'s expert slots (0: kept apart).

    vLLM 0.32 keeps the count on the layer's ``expert_map_manager``; earlier releases on the layer.
    """
    layer = moe_layer(param)
    holder = getattr(layer, "expert_map_manager", layer)
    return int(getattr(holder, "num_fused_shared_experts", 0) or 0)


def local_experts(param, num_routed: int) -> set[int]:
    """Global ids of the experts this rank holds in ``param``: its routed experts (all of them
    without expert parallelism) and the fused shared experts ``num_routed + j``.

    Asked of the same mapping the layer's ``weight_loader`` uses to place (or drop) an expert.
    """
    to_local = getattr(moe_layer(param), "_map_global_expert_id_to_local_expert_id", None)
    routed = (range(num_routed) if to_local is None
              else [e for e in range(num_routed) if int(to_local(e)) != -1])
    return set(routed) | {num_routed + j for j in range(fused_shared_experts(param))}
