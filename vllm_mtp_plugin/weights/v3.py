"""DeepSeek-V3 / R1, Hugging Face layout: MTP layer j is ``model.layers.{num_hidden_layers + j}.*``."""

from __future__ import annotations

import regex as re

from .rules import Rule, WeightMap, expert_rules

# The MTP layer's own tensors besides its decoder block.
V3_OWN_TENSORS = ("enorm", "hnorm", "eh_proj", "shared_head.norm")
# Only in rotation-quantised checkpoints (a top-level ``rot.weight``, loaded into the first MTP
# layer by ``models/v3.py``): mapped when present, never required.
V3_OPTIONAL_OWN_TENSORS = ("rot",)


def v3_weight_map(expert_params: dict[str, str], head_copies: bool = False) -> WeightMap:
    """``head_copies``: load each layer's ``shared_head.head`` (for hosts that compare it with the
    target's head before sharing, ``platform.host_compares_head_copies``); otherwise not read."""
    own_tensors = (V3_OWN_TENSORS + V3_OPTIONAL_OWN_TENSORS
                   + (("shared_head.head",) if head_copies else ()))
    own = "|".join(re.escape(t) for t in own_tensors)
    shared = "embed_tokens" if head_copies else "embed_tokens|shared_head\\.head"
    return WeightMap(
        name="deepseek_v3 (Hugging Face)",
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
            *expert_rules("gate_proj", "up_proj", "down_proj", expert_params),
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
