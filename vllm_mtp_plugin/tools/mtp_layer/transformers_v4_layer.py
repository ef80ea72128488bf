"""DeepSeek-V4's MTP layer outside vLLM: transformers' DeepSeek-V4 modules, read from DeepSeek's
names. The reference forward that training a V4 layer and ``doctor`` for V4 build on.

transformers (5.19) runs a V4 target (hyper-connections, V4 attention, MoE) and drops ``mtp.*``
on load; it has no V4 MTP layer (its ``MtpLayer`` is V3's: ``eh_proj`` over concatenated inputs,
one stream, no ``hc_head``). The layer here computes what the plugin serves (``models/v4.py``):

    x = h_proj(hnorm(h)) + e_proj(enorm(e))   # per hc_mult stream; e zeroed at position 0
    x = block(x)                              # transformers' DeepseekV4DecoderLayer
    logits = head(norm(hc_head(x)))           # the target's head

``h`` is the target's residual before its ``hc_head`` (vLLM's ``get_mtp_target_hidden_states``,
``(T, hc_mult * H)`` flattened): the input of transformers' ``model.hc_head``, read by a forward
pre-hook (``output_hidden_states`` replaces its last entry with ``norm(hc_head(x))``).

Names: a block tensor ``mtp.{j}.<name>`` is renamed by transformers' own V4 rules as
``layers.{n + j}.<name>`` would be (``conversion_mapping.py``, ``"deepseek_v4"``), experts fused as
transformers keeps them; the layer's own tensors by ``OWN_TENSORS`` (transformers' rules would
read ``norm`` as an attention norm and leave ``hc_head_*`` unmatched). Copies of the embedding and
head some exports store (``emb.tok_emb``, ``head``) are the target's and are skipped.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from pathlib import Path

import torch
from torch import nn

# Checkpoint name below ``mtp.{j}.`` -> the layer's module name, for the layer's own tensors.
OWN_TENSORS = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
               "e_proj.weight": "e_proj.weight", "h_proj.weight": "h_proj.weight",
               "norm.weight": "norm.weight", "hc_head_fn": "hc_head.hc_fn",
               "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}
TARGET_COPIES = ("emb.tok_emb.weight", "head.weight")
EXPERT = re.compile(r"ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
# Mixers DeepSeek keeps in float32 (the checkpoint stores them so; vLLM mixes in float32).
FLOAT32_MODULES = ("block.attn_hc", "block.ffn_hc", "hc_head")


def transformers_config(model_dir: str | Path):
    """transformers' own ``DeepseekV4Config`` of the checkpoint, named directly: once vLLM is
    imported, ``AutoConfig`` maps ``deepseek_v4`` to vLLM's config class, which transformers'
    modeling does not take."""
    from transformers.models.deepseek_v4 import DeepseekV4Config

    return DeepseekV4Config.from_pretrained(str(model_dir))


def block_config(model_dir: str | Path, layer_index: int):
    """transformers' ``DeepseekV4Config`` of the checkpoint, extended to cover the MTP block at
    ``layer_index`` (n + j): ``config_for_block`` on its config.json."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    return config_for_block(raw, layer_index, f"{model_dir}/config.json")


def config_for_block(raw: dict, layer_index: int, source: str = "config"):
    """transformers' ``DeepseekV4Config`` of ``raw`` (a config.json's fields) covering the MTP
    block at ``layer_index``: transformers cuts ``compress_ratios`` to the target's layers, the
    block reads its attention kind and MoE kind at its own index. The MTP block is never
    hash-routed (as vLLM builds it)."""
    from transformers.models.deepseek_v4 import DeepseekV4Config

    ratios = raw.get("compress_ratios")
    if ratios is not None and len(ratios) <= layer_index:
        raise ValueError(f"{source}: compress_ratios has {len(ratios)} entries, "
                         f"none for the MTP block at layer {layer_index}")
    # the layer types are derived from the legacy fields as the config is built (a keyword
    # override of num_hidden_layers comes after that)
    extended = DeepseekV4Config.from_dict({**raw, "num_hidden_layers": layer_index + 1})
    block = DeepseekV4Config.from_dict(raw)
    block.layer_types = list(extended.layer_types)
    block.mlp_layer_types = list(extended.mlp_layer_types)[:layer_index] + ["moe"]
    return block


class V4MtpLayer(nn.Module):
    """One V4 MTP layer in transformers' modules (``forward``: the block's streams, fed back as the
    next depth's ``h``; ``logits_input``: what the target's head reads)."""

    def __init__(self, config, layer_index: int):
        super().__init__()
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
            DeepseekV4DecoderLayer,
            DeepseekV4HyperHead,
            DeepseekV4RMSNorm,
        )

        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = DeepseekV4RMSNorm(hidden, eps)
        self.hnorm = DeepseekV4RMSNorm(hidden, eps)
        self.e_proj = nn.Linear(hidden, hidden, bias=False)
        self.h_proj = nn.Linear(hidden, hidden, bias=False)
        self.block = DeepseekV4DecoderLayer(config, layer_index)
        self.hc_head = DeepseekV4HyperHead(config)
        self.norm = DeepseekV4RMSNorm(hidden, eps)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, **block_kwargs) -> torch.Tensor:
        """``hidden`` ``[B, T, hc_mult, H]``, ``embeds`` ``[B, T, H]`` -> ``[B, T, hc_mult, H]``."""
        fused = self.h_proj(self.hnorm(hidden)) + self.e_proj(self.enorm(embeds)).unsqueeze(2)
        return self.block(fused, **block_kwargs)

    def logits_input(self, streams: torch.Tensor) -> torch.Tensor:
        return self.norm(self.hc_head(streams))


@functools.cache
def _v4_rules() -> tuple[list, list]:
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    rules = get_checkpoint_conversion_mapping("deepseek_v4")
    return ([r for r in rules if isinstance(r, WeightRenaming)],
            [r for r in rules if isinstance(r, WeightConverter)])


def transformers_name(name: str) -> str:
    """The module name transformers loads DeepSeek's V4 tensor ``name`` into (its own V4 rules,
    ``conversion_mapping.py``; a routed expert's names its fused ``gate_up_proj``/``down_proj``)."""
    from transformers.core_model_loading import rename_source_key

    return rename_source_key(name, *_v4_rules())[0]


def unfused(value: torch.Tensor, name: str, intermediate: int) -> torch.Tensor:
    """The checkpoint tensor ``name`` read from the module tensor ``value`` it loads into: a routed
    expert's ``w1``/``w3``/``w2`` sliced from transformers' fused ``[E, 2I, H]`` / ``[E, H, I]``
    (gate before up, as ``transformers_layer.fused_experts`` stacks them); others as they are."""
    match = EXPERT.search(name)
    if match is None:
        return value
    fused = value[int(match.group(1))]
    return {"w1": fused[:intermediate], "w3": fused[intermediate:], "w2": fused}[match.group(2)]


def block_module_name(name: str, layer_index: int) -> str:
    """``V4MtpLayer``'s name for a block tensor (``name`` below ``mtp.{j}.``), renamed as
    ``layers.{layer_index}.<name>`` would be."""
    renamed = transformers_name(f"layers.{layer_index}.{name}")
    # "model.layers.{i}.<module name>" (or without "model."): the part below the layer
    return "block." + renamed.split(f"layers.{layer_index}.", 1)[1]


def to_module_state(tensors: dict[str, torch.Tensor], layer_index: int, num_experts: int
                    ) -> dict[str, torch.Tensor]:
    """Tensors of one MTP layer (names below ``mtp.{j}.``) -> ``V4MtpLayer`` state."""
    from .transformers_layer import fused_experts, sort_layer_tensors

    state, experts, block = sort_layer_tensors(tensors, TARGET_COPIES, OWN_TENSORS, EXPERT)
    for name, tensor in block.items():
        state[block_module_name(name, layer_index)] = tensor
    state["block.mlp.experts.gate_up_proj"], state["block.mlp.experts.down_proj"] = \
        fused_experts(experts, num_experts, ("w1", "w3", "w2"), "ffn.experts.{}.{}.weight")
    return state


def load_reference(model_dir: str | Path, depth: int = 0, dtype: torch.dtype = torch.float32):
    """The target (transformers) and its MTP layer ``mtp.{depth}`` from a bf16/fp32 V4
    checkpoint, in ``dtype`` with the mixers in float32, in eval mode. FP8/FP4 checkpoints are
    not read here."""
    target = load_target(model_dir, dtype)
    return target, load_layer(model_dir, target.config, depth, dtype)


def load_target(model_dir: str | Path, dtype: torch.dtype = torch.float32, blocks: bool = True):
    """transformers' V4 target of ``model_dir`` in ``dtype`` (mixers float32), eval mode.
    ``blocks=False``: only what reads its states (embedding, ``hc_head``, norm, head, rotary
    embedding), built without blocks and read tensor by tensor, for training from recorded
    states; this also reads FP8/FP4 releases, whose embedding and head are unquantized."""
    from transformers.models.deepseek_v4 import DeepseekV4ForCausalLM

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    if not blocks:
        return _target_ends(model_dir, config, dtype)
    if config.get("quantization_config"):
        raise ValueError(f"{model_dir}: a quantized V4 checkpoint; the reference reads bf16 or "
                         "fp32 weights (build the tiny one with quantization=None)")
    # transformers keeps norms in float32 on load, which its bf16 forward does not take on a
    # CPU: load in float32, cast after
    target = DeepseekV4ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                   config=transformers_config(model_dir))
    return _finished(target, dtype)


def _finished(target, dtype: torch.dtype):
    target.to(dtype)
    target.eval()
    for module in target.modules():
        if type(module).__name__ in ("DeepseekV4HyperConnection", "DeepseekV4HyperHead"):
            module.float()
    return target


def _target_ends(model_dir: Path, config: dict, dtype: torch.dtype):
    """The target with no blocks, its ends read from the checkpoint's own tensors."""
    from safetensors import safe_open
    from transformers.models.deepseek_v4 import DeepseekV4Config, DeepseekV4ForCausalLM

    raw = {k: v for k, v in config.items() if k != "quantization_config"}
    ends = DeepseekV4Config.from_dict(raw)
    ends.num_hidden_layers = 0
    target = DeepseekV4ForCausalLM(ends)
    wanted = {name for name, _ in target.named_parameters()}
    state = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                if name.startswith(("layers.", "mtp.")):
                    continue
                module = transformers_name(name)
                module = module if module in wanted else f"model.{module}"
                if module not in wanted:
                    continue
                tensor = f.get_tensor(name)
                if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                    raise ValueError(f"{file}: {name} is stored as {tensor.dtype}; the target's "
                                     "embedding, head and hc_head are read unquantized")
                state[module] = tensor.float()
    missing = sorted(wanted - set(state))
    if missing:
        raise ValueError(f"{model_dir}: the target's {', '.join(missing)} not found in its "
                         "*.safetensors (a DeepSeek-V4 checkpoint stores embed, head, norm and "
                         "hc_head_*)")
    target.load_state_dict(state, strict=False)
    target.config.num_hidden_layers = int(config["num_hidden_layers"])
    return _finished(target, dtype)


def _read_unquantized(f, name: str) -> torch.Tensor:
    """``name`` in float32: an FP8 weight times its block ``.scale``, a packed FP4 expert (int8)
    decoded with its 1x32 ``.scale`` (DeepSeek-V4-Flash), anything else as stored."""
    from ..checkpoint.quantize import dequantize_fp4, dequantize_fp8_blocks

    tensor = f.get_tensor(name)
    scale_name = name.removesuffix(".weight") + ".scale"
    if tensor.dtype == torch.float8_e4m3fn:
        return dequantize_fp8_blocks(tensor, f.get_tensor(scale_name))
    if tensor.dtype == torch.int8 and EXPERT.search(name):
        return dequantize_fp4(tensor, f.get_tensor(scale_name))
    return tensor.float()


def load_layer(model_dir: str | Path, target_config, depth: int = 0,
               dtype: torch.dtype = torch.float32) -> "V4MtpLayer":
    """``mtp.{depth}`` of ``model_dir`` as a ``V4MtpLayer`` (``target_config``: the target's
    transformers config), in ``dtype`` with the mixers in float32, eval mode."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    layer_index = target_config.num_hidden_layers + depth
    prefix = f"mtp.{depth}."
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                if name.startswith(prefix) and not name.endswith(".scale"):
                    tensors[name[len(prefix):]] = _read_unquantized(f, name)
    if not tensors:
        raise ValueError(f"{model_dir}: no {prefix}* tensors (a checkpoint without MTP layer "
                         f"{depth})")
    block = block_config(model_dir, layer_index)
    for kind in ("_attn_implementation", "_experts_implementation"):  # as the target's blocks
        setattr(block, kind, getattr(target_config, kind, None))
    layer = V4MtpLayer(block, layer_index)
    state = to_module_state(tensors, layer_index, target_config.n_routed_experts)
    missing, unexpected = layer.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise KeyError(f"{model_dir}: {prefix}* does not match the V4 MTP layer: missing "
                       f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    layer.to(dtype)
    layer.eval()
    for name in FLOAT32_MODULES:
        layer.get_submodule(name).float()
    return layer


@contextlib.contextmanager
def residual_before_hc_head(target):
    """Collects the target's residual before its ``hc_head`` (``[B, T, hc_mult, H]``) while
    inside: ``caught["hidden"]`` after a forward."""
    caught: dict[str, torch.Tensor] = {}
    handle = target.model.hc_head.register_forward_pre_hook(
        lambda module, args: caught.__setitem__("hidden", args[0]))
    try:
        yield caught
    finally:
        handle.remove()


def layer_streams(target, layer: V4MtpLayer, hidden: torch.Tensor, next_tokens: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """The layer's output streams ``[B, T, hc_mult, H]`` for one sequence per row: at each position
    it reads the target's ``hidden`` ``[B, T, hc_mult, H]`` there and ``next_tokens`` (the token
    after it; its embedding zeroed at position 0, as vLLM serves it)."""
    from transformers.masking_utils import create_sliding_window_causal_mask

    embeds = target.model.embed_tokens(next_tokens)
    embeds = torch.where(positions.unsqueeze(-1) == 0, 0, embeds)
    rotary = {kind: target.model.rotary_emb(embeds, position_ids=positions, layer_type=kind)
              for kind in ("main", "compress")}
    mask = create_sliding_window_causal_mask(config=target.config, inputs_embeds=embeds,
                                             attention_mask=None, past_key_values=None,
                                             position_ids=positions)
    return layer(hidden.to(embeds.dtype), embeds, position_embeddings=rotary,
                 position_ids=positions, attention_mask=mask, past_key_values=None)


def streams_logits(target, layer: V4MtpLayer, streams: torch.Tensor) -> torch.Tensor:
    """The target's head on ``layer``'s ``hc_head`` and norm of ``streams`` ``[..., hc_mult, H]``."""
    return target.lm_head(layer.logits_input(streams).to(target.lm_head.weight.dtype))


def target_logits(target, states: torch.Tensor) -> torch.Tensor:
    """The target's logits (float32) from its states ``[..., hc_mult, H]`` (the residual before
    its ``hc_head``): head(norm(hc_head(x))), what its own forward computes from them."""
    model = target.model
    return target.lm_head(model.norm(model.hc_head(states)).to(target.lm_head.weight.dtype)).float()


def layer_logits(target, layer: V4MtpLayer, hidden: torch.Tensor, token_ids: torch.Tensor
                 ) -> torch.Tensor:
    """The layer's logits at positions 0..T-2 of ``token_ids`` ``[B, T]``: at position i it reads
    the target's ``hidden[:, i]`` and token i+1 and predicts token i+2."""
    batch, length = token_ids.shape
    positions = torch.arange(length - 1).unsqueeze(0).expand(batch, -1)
    streams = layer_streams(target, layer, hidden[:, :-1], token_ids[:, 1:], positions)
    return streams_logits(target, layer, streams)


def greedy_first_position(target, layer: V4MtpLayer, token_ids: torch.Tensor
                          ) -> tuple[int, int]:
    """(accepted, drafted) on ``token_ids`` with the target's own greedy continuation as the
    verifier: the layer's draft at position i >= 1 against the target's argmax at position i+1
    (position 0 is left out: its embedding is zeroed)."""
    with torch.no_grad(), residual_before_hc_head(target) as caught:
        target_logits = target(token_ids, use_cache=False).logits
    with torch.no_grad():
        drafts = layer_logits(target, layer, caught["hidden"], token_ids).argmax(-1)
    greedy = target_logits.argmax(-1)
    accepted = (drafts[:, 1:] == greedy[:, 2:])
    return int(accepted.sum()), accepted.numel()


def layer_tensors(layer, config: dict) -> dict[str, tuple[torch.Tensor, str]]:
    """``{mtp.0.name: (float32 tensor, kind)}``: every tensor the V4 description requires of
    layer 0 (and the router bias), read from ``layer``'s modules through transformers' V4
    renaming; kinds as ``checkpoint/quantize.encode_v4`` stores them."""
    from ...weights.layers import LAYER_DESCRIPTIONS
    from ..checkpoint.quantize import EXPERT, LINEAR, PLAIN

    layout = LAYER_DESCRIPTIONS["deepseek_v4"].layout(config)
    state = layer.state_dict()
    n, inter = int(config["num_hidden_layers"]), int(config["moe_intermediate_size"])
    prefix = layout.prefix(0)
    wanted = layout.required(0)
    if "block.mlp.gate.e_score_correction_bias" in state:
        wanted.append((prefix + "ffn.gate.bias", None))
    out = {}
    for name, description in wanted:
        below = name.removeprefix(prefix)
        module = OWN_TENSORS.get(below) or block_module_name(below, n)
        value = unfused(state[module], below, inter)
        kind = PLAIN if description is None or not description.quantizable else (
            EXPERT if description.per_expert else LINEAR)
        out[name] = (value.detach().float(), kind)
    return out
