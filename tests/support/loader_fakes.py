"""What the V3 loader's tests load into without vLLM building a model: parameters and vLLM's
fused-MoE layer stood for by recorders, and a small V3 MTP checkpoint (``tests/unit/weights/
test_weight_map.py``; ``tests/unit/plugin/test_probes.py`` too)."""

import torch

from vllm_mtp_plugin.weights.loader import load_mtp_weights
from vllm_mtp_plugin.weights.v3 import v3_weight_map

# vLLM 0.32 names; the engine tests check the live names through platform.fused_moe_expert_params.
EXPERT_PARAMS = {"gate_proj": "experts.routed_experts.w13_", "up_proj": "experts.routed_experts.w13_",
                 "down_proj": "experts.routed_experts.w2_"}


class RecordingParam:
    """Stands for a vLLM parameter: a shape and a weight_loader that records its calls."""

    def __init__(self, *shape):
        self.shape = shape
        self.calls = []

    def weight_loader(self, param, tensor, *args, **kwargs):
        if not args and not kwargs and tuple(tensor.shape) != self.shape:
            raise AssertionError(f"size mismatch {tuple(tensor.shape)} vs {self.shape}")
        self.calls.append((tuple(tensor.shape), args, kwargs))


def small_checkpoint(hidden=8, experts=2):
    L = "model.layers.4"
    t = {f"{L}.enorm.weight": (hidden,), f"{L}.hnorm.weight": (hidden,),
         f"{L}.eh_proj.weight": (hidden, 2 * hidden), f"{L}.shared_head.norm.weight": (hidden,),
         f"{L}.shared_head.head.weight": (32, hidden), f"{L}.embed_tokens.weight": (32, hidden),
         f"{L}.mlp.shared_experts.gate_proj.weight": (4, hidden),
         f"{L}.mlp.shared_experts.up_proj.weight": (4, hidden),
         "model.layers.0.mlp.gate.weight": (2, hidden), "lm_head.weight": (32, hidden)}
    for e in range(experts):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            t[f"{L}.mlp.experts.{e}.{proj}.weight"] = (4, hidden)
    return {k: torch.zeros(v) for k, v in t.items()}


def small_params(hidden=8):
    L = "model.layers.4"
    return {f"{L}.enorm.weight": RecordingParam(hidden), f"{L}.hnorm.weight": RecordingParam(hidden),
            f"{L}.eh_proj.weight": RecordingParam(hidden, 2 * hidden),
            f"{L}.shared_head.norm.weight": RecordingParam(hidden),
            f"{L}.mtp_block.mlp.shared_experts.gate_up_proj.weight": RecordingParam(8, hidden),
            f"{L}.mtp_block.mlp.experts.routed_experts.w13_weight": RecordingParam(2, 8, hidden),
            f"{L}.mtp_block.mlp.experts.routed_experts.w2_weight": RecordingParam(2, hidden, 4)}


def load(weights, params, num_experts=2):
    return load_mtp_weights(v3_weight_map(EXPERT_PARAMS), weights.items(), params,
                            mtp_layers=[4], num_experts=num_experts, model_dir="/ckpt")


class MoELayer:
    """Stands for vLLM's fused-MoE layer: the expert map of EP rank ``rank`` of ``size`` (made by
    vLLM's own ``determine_expert_map``) and ``fused_shared`` shared experts in the slots after the
    routed ones. Its ``weight_loader`` records what it is asked to load."""

    def __init__(self, experts, size=1, rank=0, fused_shared=0):
        from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

        _, self.expert_map, _ = determine_expert_map(size, rank, experts)
        self.num_fused_shared_experts = fused_shared
        self.calls = []

    def _map_global_expert_id_to_local_expert_id(self, expert_id):
        return expert_id if self.expert_map is None else int(self.expert_map[expert_id])

    def weight_loader(self, param, tensor, weight_name, shard_id, expert_id):
        self.calls.append((weight_name.rsplit(".", 1)[-1], expert_id, shard_id, tensor.clone()))


class ExpertsParam:
    def __init__(self, layer, *shape):
        self.shape, self.weight_loader = shape, layer.weight_loader


def moe_params(layer, shared_mlp=True, hidden=8):
    params = small_params(hidden)
    routed = "model.layers.4.mtp_block.mlp.experts.routed_experts."
    params[routed + "w13_weight"] = ExpertsParam(layer, 2, 8, hidden)
    params[routed + "w2_weight"] = ExpertsParam(layer, 2, hidden, 4)
    if not shared_mlp:
        del params["model.layers.4.mtp_block.mlp.shared_experts.gate_up_proj.weight"]
    return params
