"""DeepSeek-V3 / R1, Hugging Face layout: MTP layer j is ``model.layers.{num_hidden_layers + j}.*``."""

from __future__ import annotations

import regex as re

from .rules import Rule, WeightMap, expert_rules

# The MTP layer's own tensors besides its decoder block.
V3_OWN_TENSORS = ("enorm", "hnorm", "eh_proj", "shared_head.norm")


def v3_weight_map(expert_params: dict[str, str]) -> WeightMap:
    own = "|".join(re.escape(t) for t in V3_OWN_TENSORS)
    return WeightMap(
        name="deepseek_v3 (Hugging Face)",
        layer_index=r"model\.layers\.(?P<idx>\d+)\.",
        layer_offset=0,
        drop=(r"rotary_emb\.inv_freq$",),
        # The draft reads the target's embedding and head; the checkpoint's copies are not loaded.
        shared=(r"^model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.",),
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
    )
