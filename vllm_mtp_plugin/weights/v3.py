"""DeepSeek-V3 / R1, Hugging Face layout: MTP layer j is ``model.layers.{num_hidden_layers + j}.*``."""

from __future__ import annotations

import regex as re

from .layers import V3_LAYER
from .rules import Rule, WeightMap, expert_rules


def v3_weight_map(expert_params: dict[str, str], head_copies: bool = False) -> WeightMap:
    """``head_copies``: load each layer's ``shared_head.head`` (for hosts that compare it with the
    target's head before sharing, ``platform.host_compares_head_copies``); otherwise not read."""
    copies = ("shared_head.head",) if head_copies else ()
    own = "|".join(re.escape(t) for t in V3_LAYER.own_modules() + copies)
    shared = "|".join(re.escape(t) for t in V3_LAYER.shared_modules() if t not in copies)
    return WeightMap(
        name=V3_LAYER.naming,
        layer_index=r"model\.layers\.(?P<idx>\d+)\.",
        layer_offset=0,
        drop=(r"rotary_emb\.inv_freq$",),
        # The draft reads the target's embedding and head; the checkpoint's copies are not loaded.
        shared=(rf"^model\.layers\.\d+\.({shared})\.",),
        to_checkpoint=((r"\.mtp_block\.", "."),),
        prefix_rules=(
            Rule(rf"^model\.layers\.(\d+)\.(?=({own})\.)", r"model.layers.\1."),
            Rule(r"^model\.layers\.(\d+)\.", r"model.layers.\1.mtp_block."),
        ),
        rules=(
            *expert_rules(*V3_LAYER.expert_projections, expert_params),
            # Stacked dense projections (shared experts and dense MLPs included).
            Rule(r"\.gate_proj\.", ".gate_up_proj.", 0),
            Rule(r"\.up_proj\.", ".gate_up_proj.", 1),
            # q_a and kv_a are fused when the attention has a q LoRA (`optional`: else kept apart).
            Rule(r"\.q_a_proj\.", ".fused_qkv_a_proj.", 0, optional=True),
            Rule(r"\.kv_a_proj_with_mqa\.", ".fused_qkv_a_proj.", 1, optional=True),
        ),
        fallbacks=fused_shared_expert_rules(expert_params),
    )


def fused_shared_expert_rules(expert_params: dict[str, str]) -> tuple[Rule, ...]:
    """``mlp.shared_experts.*`` when vLLM built no shared-expert MLP: the expert slots after the
    routed ones of the fused-MoE tensors (ROCm AITER fused shared experts, ``weights.experts``),
    where vLLM's own ``DeepSeekMTP`` loads them."""
    return tuple(
        Rule(rf"\.mlp\.shared_experts\.{proj}\.", f".mlp.{expert_params[proj]}", shard,
             fused_shared=True)
        for proj, shard in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))
    )
