"""What an MTP layer of each DeepSeek checkpoint format contains: one description per variant.

The loader's rule tables (``v3.py``, ``v4.py``), the start-up check (``preflight.py``) and
``vllm-mtp inspect`` all read these descriptions, so that what the loader maps, what start-up
requires and what inspect reports cannot drift apart. Names are relative to the layer's prefix
(``model.layers.{num_hidden_layers + j}.`` for V3/V3.2, ``mtp.{j}.`` for V4); ``{e}`` stands for
a routed expert's index. Sources: the released tensor lists (``tests/data/*_names.txt``) and
vLLM's ``deepseek_v2.py`` (V3.2's ``Indexer``), ``deepseek_mtp.py`` and ``deepseek_v4``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import regex as re

# What quantized exports store instead of a linear's ``weight``: GPTQ/AWQ ``qweight``,
# compressed-tensors' packed formats ``weight_packed`` (vLLM's loaders take either).
QUANTIZED_WEIGHT_NAMES = ("qweight", "weight_packed")
# Tensors only a DSpark drafter has (DeepSeek-V4-Flash-0731 stores one under ``mtp.``).
DSPARK_MARKERS = ("main_proj", "main_norm", "markov_head", "confidence_head")


def _always(config: dict) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class TensorDescription:
    """One tensor of an MTP layer.

    ``own``: the MTP layer's own (fusion, head norm, ...), not its decoder block's.
    ``optional``: loaded when present, never required (e.g. a router bias some exports lack).
    ``quantizable``: a linear built with the quantization config, so its ``weight`` may be stored
    quantized (FP8 with scales, ``qweight``, ``weight_packed``).
    ``shared``: a copy of the target's embedding or head; the drafter shares the target's instead.
    ``when``: the configs whose layer has this tensor (q LoRA, MoE, shared experts).
    ``shape``: the shape config.json implies, checked before the engine starts.
    """

    name: str
    own: bool = False
    optional: bool = False
    quantizable: bool = False
    shared: bool = False
    when: Callable[[dict], bool] = _always
    shape: Callable[[dict], tuple[int, ...]] | None = None

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.name

    @property
    def module(self) -> str:
        """The name without its ``.weight`` leaf (what the rule tables match on)."""
        return self.name.removesuffix(".weight")


@dataclasses.dataclass(frozen=True)
class LayerDescription:
    """A checkpoint format's MTP layer, independent of any one config.

    ``prefix_format``: a layer's prefix, ``{}`` being the index the checkpoint writes;
    ``layer_pattern`` the same as a regex (``re.match``) whose group ``idx`` is that index.
    ``first_index``: the index of MTP layer 0 for a config.
    ``expert_projections``: a routed expert's gate, up and down projections, as named here.
    """

    model_type: str
    naming: str
    prefix_format: str
    layer_pattern: str
    first_index: Callable[[dict], int]
    expert_projections: tuple[str, str, str]
    tensors: tuple[TensorDescription, ...]

    def own_modules(self) -> tuple[str, ...]:
        """The MTP layer's own tensors that are loaded (optional ones included)."""
        return tuple(t.module for t in self.tensors if t.own and not t.shared)

    def shared_modules(self) -> tuple[str, ...]:
        return tuple(t.module for t in self.tensors if t.shared)

    def layout(self, config: dict) -> Layout:
        return Layout(self, config)


class Layout:
    """A ``LayerDescription`` under one config.json: where MTP layer ``j`` is and what it must hold."""

    def __init__(self, description: LayerDescription, config: dict):
        self.description, self.config = description, config
        self.name = description.naming
        self.first = description.first_index(config)
        self.tensors = tuple(t for t in description.tensors if t.when(config))
        self.num_experts = int(config.get("n_routed_experts") or 0)
        self._patterns = [(t, re.compile(_pattern(t))) for t in self.tensors]

    def prefix(self, j: int) -> str:
        return self.description.prefix_format.format(self.first + j)

    def layer_of(self, name: str) -> int | None:
        """MTP layer ``j`` of a tensor name (negative: a main layer), ``None``: not a layer's."""
        m = re.match(self.description.layer_pattern, name)
        return None if m is None else int(m.group("idx")) - self.first

    def own(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors if t.own and not t.shared)

    def required(self, j: int) -> list[tuple[str, TensorDescription]]:
        """Every tensor MTP layer ``j`` must hold (routed experts expanded): full name, description."""
        names = []
        for t in self.tensors:
            if t.optional or t.shared:
                continue
            experts = range(self.num_experts) if t.per_expert else (None,)
            names += [(self.prefix(j) + t.name.format(e=e), t) for e in experts]
        return names

    def shapes(self, j: int) -> dict[str, tuple[int, ...]]:
        return {self.prefix(j) + t.name: t.shape(self.config) for t in self.tensors if t.shape}

    def entry_of(self, j: int, name: str) -> tuple[TensorDescription, int | None, bool] | None:
        """``(tensor, expert or None, stored quantized)`` for a tensor name of MTP layer ``j``, or
        ``None`` when this description has no such tensor."""
        relative = name.removeprefix(self.prefix(j))
        for t, pattern in self._patterns:
            m = pattern.fullmatch(relative)
            if m is not None:
                expert = int(m.group("e")) if t.per_expert else None
                return t, expert, bool(m.group("leaf")) if t.quantizable else False
        return None


def _pattern(t: TensorDescription) -> str:
    escaped = re.escape(t.name).replace(re.escape("{e}"), r"(?P<e>\d+)")
    if not t.quantizable:
        return escaped
    # The weight itself, or any tensor of its quantized form (scales, qweight, zeros, ...).
    return re.escape(t.module).replace(re.escape("{e}"), r"(?P<e>\d+)") + \
        r"\.(?:weight|(?P<leaf>[A-Za-z_]+))"


def stored(names: set[str], name: str, quantizable: bool = True) -> bool:
    """Whether ``names`` hold tensor ``name``, or, for a quantizable ``.weight``, its quantized
    form (``qweight``, ``weight_packed``)."""
    module = name.removesuffix(".weight")
    return name in names or (quantizable and module != name and any(
        f"{module}.{alias}" in names for alias in QUANTIZED_WEIGHT_NAMES))


# --------------------------------------------------------------------------------- the variants

def _hidden(config: dict) -> tuple[int]:
    return (config["hidden_size"],)


def _q_lora(config: dict) -> bool:
    return bool(config.get("q_lora_rank"))


def _moe(config: dict) -> bool:
    return bool(config.get("n_routed_experts"))


def _shared_experts(config: dict) -> bool:
    return _moe(config) and bool(config.get("n_shared_experts"))


def _linear(name: str, **kwargs) -> TensorDescription:
    return TensorDescription(name, quantizable=True, **kwargs)


def _mlp(prefix: str, gate: str, up: str, down: str, when) -> tuple[TensorDescription, ...]:
    return tuple(_linear(f"{prefix}.{p}.weight", when=when) for p in (gate, up, down))


V3_LAYER = LayerDescription(
    model_type="deepseek_v3",
    naming="deepseek_v3 (Hugging Face)",
    prefix_format="model.layers.{}.",
    layer_pattern=r"model\.layers\.(?P<idx>\d+)\.",
    first_index=lambda config: config["num_hidden_layers"],
    expert_projections=("gate_proj", "up_proj", "down_proj"),
    tensors=(
        TensorDescription("enorm.weight", own=True, shape=_hidden),
        TensorDescription("hnorm.weight", own=True, shape=_hidden),
        # Built without the quantization config: DeepSeek ships eh_proj unquantized.
        TensorDescription("eh_proj.weight", own=True,
                   shape=lambda c: (c["hidden_size"], 2 * c["hidden_size"])),
        TensorDescription("shared_head.norm.weight", own=True, shape=_hidden),
        # Rotation-quantised exports (Ascend modelslim): a top-level ``rot.weight`` the drafter
        # loads into its first MTP layer under this name (``models/v3.py``).
        TensorDescription("rot.weight", own=True, optional=True),
        TensorDescription("embed_tokens.weight", own=True, optional=True, shared=True),
        TensorDescription("shared_head.head.weight", own=True, optional=True, shared=True),
        TensorDescription("input_layernorm.weight"),
        TensorDescription("post_attention_layernorm.weight"),
        _linear("self_attn.q_a_proj.weight", when=_q_lora),
        TensorDescription("self_attn.q_a_layernorm.weight", when=_q_lora),
        _linear("self_attn.q_b_proj.weight", when=_q_lora),
        _linear("self_attn.q_proj.weight", when=lambda c: not _q_lora(c)),
        _linear("self_attn.kv_a_proj_with_mqa.weight"),
        TensorDescription("self_attn.kv_a_layernorm.weight"),
        _linear("self_attn.kv_b_proj.weight"),
        _linear("self_attn.o_proj.weight"),
        TensorDescription("mlp.gate.weight", when=_moe),
        TensorDescription("mlp.gate.e_score_correction_bias", optional=True, when=_moe),
        *_mlp("mlp.experts.{e}", "gate_proj", "up_proj", "down_proj", _moe),
        *_mlp("mlp.shared_experts", "gate_proj", "up_proj", "down_proj", _shared_experts),
        *_mlp("mlp", "gate_proj", "up_proj", "down_proj", lambda c: not _moe(c)),
    ),
)

# DeepSeek-V3.2 (DSA): V3's layer plus the attention's lightning indexer, as vLLM's
# ``deepseek_v2.Indexer`` loads it (``wk`` and ``weights_proj`` fused into ``wk_weights_proj``;
# ``weights_proj`` is built without the quantization config). vLLM's own class drafts for it.
V32_LAYER = dataclasses.replace(
    V3_LAYER,
    model_type="deepseek_v32",
    naming="deepseek_v32 (Hugging Face)",
    tensors=V3_LAYER.tensors + (
        _linear("self_attn.indexer.wq_b.weight"),
        _linear("self_attn.indexer.wk.weight"),
        TensorDescription("self_attn.indexer.k_norm.weight"),
        TensorDescription("self_attn.indexer.k_norm.bias"),
        TensorDescription("self_attn.indexer.weights_proj.weight"),
    ),
)

V4_LAYER = LayerDescription(
    model_type="deepseek_v4",
    naming="deepseek_v4 (DeepSeek naming)",
    prefix_format="mtp.{}.",
    layer_pattern=r"mtp\.(?P<idx>\d+)\.",
    first_index=lambda config: 0,
    expert_projections=("w1", "w3", "w2"),
    tensors=(
        TensorDescription("enorm.weight", own=True, shape=_hidden),
        TensorDescription("hnorm.weight", own=True, shape=_hidden),
        _linear("e_proj.weight", own=True),
        _linear("h_proj.weight", own=True),
        TensorDescription("norm.weight", own=True, shape=_hidden),
        TensorDescription("hc_head_fn", own=True),
        TensorDescription("hc_head_base", own=True),
        TensorDescription("hc_head_scale", own=True),
        TensorDescription("emb.tok_emb.weight", own=True, optional=True, shared=True),
        TensorDescription("head.weight", own=True, optional=True, shared=True),
        TensorDescription("attn_norm.weight"),
        TensorDescription("ffn_norm.weight"),
        _linear("attn.wq_a.weight"),
        TensorDescription("attn.q_norm.weight"),
        _linear("attn.wq_b.weight"),
        _linear("attn.wkv.weight"),
        TensorDescription("attn.kv_norm.weight"),
        _linear("attn.wo_a.weight"),
        _linear("attn.wo_b.weight"),
        TensorDescription("attn.attn_sink"),
        TensorDescription("ffn.gate.weight"),
        # Absent where the block routes by hash (``tid2eid``); DeepSeek-V4-Flash's MTP block has it.
        TensorDescription("ffn.gate.bias", optional=True),
        *_mlp("ffn.experts.{e}", "w1", "w3", "w2", _always),
        *_mlp("ffn.shared_experts", "w1", "w3", "w2", lambda c: bool(c.get("n_shared_experts"))),
        *(TensorDescription(f"hc_{sub}_{part}") for sub in ("attn", "ffn")
          for part in ("fn", "base", "scale")),
    ),
)

LAYER_DESCRIPTIONS = {description.model_type: description for description in (V3_LAYER, V32_LAYER, V4_LAYER)}
