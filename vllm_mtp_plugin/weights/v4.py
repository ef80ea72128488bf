"""DeepSeek-V4 checkpoint names -> the V4 drafter's parameters, as ``weights.rules.Rule`` data.

V4 checkpoints use DeepSeek's own naming: MTP layer ``j`` is ``mtp.{j}.*`` (layer
``num_hidden_layers + j`` here), its block is ``attn.*``/``ffn.*``/``hc_attn_*``/``hc_ffn_*`` as in
the main layers, and FP8 scales are ``.scale``. The rules reproduce what vLLM's own V4 loader
(``models/deepseek_v4/nvidia/mtp.py``) does with string replaces, as a table:

* ``norm`` -> ``shared_head.norm``; ``enorm``/``hnorm``/``e_proj``/``h_proj``/``hc_head_*`` stay on
  the layer; everything else moves under ``mtp_block``.
* ``.scale`` -> ``weight_scale_inv``, except routed experts with ``expert_dtype == "fp4"``
  (``weight_scale``, MXFP4). UE8M0 (``float8_e8m0fnu``) and packed-FP4 (``int8``) expert tensors are
  viewed as the ``uint8`` vLLM stores them in, so their bytes arrive unchanged (a numeric copy
  would turn 2^-7 into 0).
* ``w1``/``w3`` -> ``gate_up_proj`` shards, ``attn.wq_a``/``attn.wkv`` -> ``attn.fused_wqa_wkv``
  shards, routed experts into vLLM's fused-MoE tensors, ``shared_experts.w2`` -> ``down_proj``,
  ``ffn.gate.bias`` -> ``e_score_correction_bias``, ``attn_sink`` narrowed to this tensor-parallel
  rank's heads.
* ``mtp.{j}.emb.tok_emb`` / ``mtp.{j}.head`` copies and the top-level ``embed``/``head`` belong to
  the target, whose embedding and head the drafter shares: never loaded.

A DSpark drafter stored under ``mtp.`` (DeepSeek-V4-Flash-0731) has blocks but no ``enorm``/``hnorm``;
``dspark_hint`` turns the resulting incomplete load into "use the dspark method". Which tensors an
MTP layer has is ``layers.V4_LAYER``.
"""

import regex as re
import torch

from .layers import DSPARK_MARKERS, V4_LAYER
from .loader import dspark_drafter
from .rules import Rule, WeightMap, expert_rules


def raw_bytes(tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """View a 1-byte tensor (UE8M0 scale, packed FP4) as the parameter's byte dtype, if needed."""
    if tensor.dtype != param.dtype and tensor.element_size() == 1 == param.element_size():
        return tensor.view(param.dtype)
    return tensor


def attn_sink_for_rank(num_heads: int):
    """``attn_sink`` holds one value per head; this rank keeps its heads, the padding stays -inf.

    Exactly once: a parameter whose own ``weight_loader`` narrows per rank (vLLM 0.33's
    ``make_attention_sink``) gets the full tensor; narrowing it here too would hand ranks >= 1
    padding instead of their heads.
    """

    def narrow(tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        from ..platform import narrows_per_rank

        if narrows_per_rank(param):
            return tensor
        local = num_heads // get_tensor_model_parallel_world_size()
        start = local * get_tensor_model_parallel_rank()
        if tensor.shape != (num_heads,):
            return tensor  # wrong shape: the loader's shape check names it
        out = torch.full_like(param, float("-inf"))
        out[:local] = tensor[start:start + local]
        return out

    return narrow


def v4_weight_map(expert_params: dict[str, str], expert_dtype: str, num_hidden_layers: int,
                  num_heads: int) -> WeightMap:
    """The ``mtp.{j}.*`` layout of DeepSeek-V4 checkpoints (V4-Flash, V4-Flash-Base)."""
    own = "|".join(re.escape(t) for t in V4_LAYER.own_modules())
    shared = "|".join(re.escape(t) for t in V4_LAYER.shared_modules())
    expert_scale = ".weight_scale" if expert_dtype == "fp4" else ".weight_scale_inv"
    return WeightMap(
        name=V4_LAYER.naming,
        layer_index=r"^mtp\.(?P<idx>\d+)\.",
        layer_offset=num_hidden_layers,
        shared=(rf"^mtp\.\d+\.({shared})\.",),
        # DSpark-only tensors: skipped, so that the load reaches ``dspark_hint``.
        drop=tuple(rf"^mtp\.\d+\.{marker}\b" for marker in DSPARK_MARKERS),
        to_checkpoint=(
            (r"^model\.layers\.(\d+)\.",
             lambda m: f"mtp.{int(m.group(1)) - num_hidden_layers}."),
            (r"\.mtp_block\.", "."),
            (r"\.shared_head\.norm\.", ".norm."),
            (r"\.weight_scale(_inv)?$", ".scale"),
        ),
        prefix_rules=(  # the first match decides: ``norm`` is the layer's shared_head.norm
            Rule(r"^mtp\.\d+\.norm\.", "model.layers.{layer}.shared_head.norm."),
            Rule(rf"^mtp\.\d+\.(?=({own})\b)", "model.layers.{layer}."),
            Rule(r"^mtp\.\d+\.", "model.layers.{layer}.mtp_block."),
        ),
        renames=(
            Rule(r"(\.experts\.\d+\.w[123])\.scale$", rf"\1{expert_scale}", transform=raw_bytes),
            Rule(r"(\.experts\.\d+\.w[123])\.weight$", r"\1.weight", transform=raw_bytes),
            Rule(r"\.scale$", ".weight_scale_inv"),
            Rule(r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
            Rule(r"\.ffn\.gate\.bias$", ".ffn.gate.e_score_correction_bias"),
        ),
        rules=(
            *expert_rules(*V4_LAYER.expert_projections, expert_params),
            Rule(r"\.w1\.", ".gate_up_proj.", 0),
            Rule(r"\.w3\.", ".gate_up_proj.", 1),
            Rule(r"\.attn\.wq_a\.", ".attn.fused_wqa_wkv.", 0),
            Rule(r"\.attn\.wkv\.", ".attn.fused_wqa_wkv.", 1),
            Rule(r"\.attn\.attn_sink$", ".attn.attn_sink", transform=attn_sink_for_rank(num_heads)),
        ),
    )


def dspark_hint(num_hidden_layers: int):
    """A ``checkpoint_hint`` that recognises a DSpark drafter stored where the MTP layer should be."""

    def hint(layer: int, report) -> str | None:
        if any(f"model.layers.{layer}.{norm}.weight" in report.loaded for norm in ("enorm", "hnorm")):
            return None
        markers = {m for name in report.shared_skipped for m in DSPARK_MARKERS if f".{m}" in name}
        return dspark_drafter(f"mtp.{layer - num_hidden_layers}.",
                              report.tensors_per_layer.get(layer, 0), markers)

    return hint
