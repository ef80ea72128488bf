"""Tensors and parameters that quantized exports add to an MTP layer, treated as vLLM treats them.

A tensor whose (renamed) name is no parameter of the drafter may still be an expected extra:

* KV-cache scales: ``k_scale``/``v_scale``/``q_scale``, ModelOpt's ``self_attn.k_proj.k_scale``, the
  deprecated ``kv_scale``. vLLM's ``maybe_remap_kv_scale_name`` renames them (to
  ``self_attn.mla_attn.mla_attn.k_scale`` for MLA), as vLLM's own ``DeepSeekMTP`` does; a scale the
  drafter has no parameter for (the KV cache is not quantized) is skipped with vLLM's warning.
* vllm-ascend's modelslim cache scales (``fa_q``/``fa_k``/``fa_v`` scale and offset, the C8
  ``kv_cache_scale``/``kv_cache_offset``, the indexer's ``q_rot``/``k_rot``): renamed as its
  quantization config's ``get_cache_scale_mapper`` does, when vllm-ascend created the parameter.
* GPTQ's ``.bias`` of layers built without bias: skipped, as vLLM's DeepSeek loaders do ("Skip
  loading extra bias for GPTQ models").

And a parameter the drafter has may legitimately get no tensor: the KV-cache quantization
parameters (``BaseKVCacheMethod``, which ModelOpt FP8/NVFP4, fp8, compressed-tensors and Quark use
for MLA attention) keep their defaults when a checkpoint has none, empty placeholders hold no
data, and ``input_scale_ub`` comes from the quantization config. vLLM's own completeness check
(``DefaultModelLoader.track_weights_loading``) exempts exactly these.
"""

from __future__ import annotations

import math

# vllm-ascend (quantization/modelslim_config.py, get_cache_scale_mapper): checkpoint suffix ->
# parameter suffix, applied when the parameter exists (the feature is on in the quant config).
ASCEND_CACHE_SCALES = (
    (".k_proj.kv_cache_scale", ".attn.k_cache_scale"),
    (".k_proj.kv_cache_offset", ".attn.k_cache_offset"),
    (".v_proj.kv_cache_scale", ".attn.v_cache_scale"),
    (".v_proj.kv_cache_offset", ".attn.v_cache_offset"),
    *((f".fa_{qkv}.{kind}", f".mla_attn.mla_attn.fa_{qkv}.{kind}")
      for qkv in "qkv" for kind in ("scale", "offset")),
    (".indexer.q_rot", ".mla_attn.mla_attn.indexer.q_rot"),
    (".indexer.k_rot", ".mla_attn.mla_attn.indexer.k_rot"),
)

# Created by vLLM's KV-cache quantization methods on attention layers.
KV_CACHE_QUANT_PARAMS = frozenset({"q_scale", "k_scale", "v_scale", "prob_scale",
                                   "q_zero_point", "k_zero_point", "v_zero_point"})
# Built from the quantization config, never stored (vLLM's default_loader._CONFIG_BUILT_PARAMS).
CONFIG_BUILT_PARAMS = frozenset({"input_scale_ub"})


def quantization_extra(name: str, params) -> str | None:
    """The parameter that ``name`` (a tensor name after the layout's renames, not a parameter of
    the drafter) loads into, or ``None`` when the tensor is to be skipped. A name that is no
    quantization extra comes back unchanged."""
    from vllm.model_executor.model_loader.weight_utils import maybe_remap_kv_scale_name

    for suffix, replacement in ASCEND_CACHE_SCALES:
        if name.endswith(suffix) and (renamed := name.removesuffix(suffix) + replacement) in params:
            return renamed
    if name.endswith(".bias"):
        return None
    return maybe_remap_kv_scale_name(name, params)


def needs_no_tensor(name: str, param) -> bool:
    """A parameter vLLM does not require a checkpoint to provide (see the module docstring)."""
    leaf = name.rsplit(".", 1)[-1]
    return (leaf in KV_CACHE_QUANT_PARAMS or leaf in CONFIG_BUILT_PARAMS
            or math.prod(tuple(param.shape)) == 0)
