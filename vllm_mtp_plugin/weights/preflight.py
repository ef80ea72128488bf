"""Before the engine starts: does the checkpoint's MTP part agree with its config.json?

Runs where vLLM builds the speculative config (the front-end process, before any engine process or
weight load), from ``config.json``, the shard index and the safetensors headers only. Without it,
a checkpoint whose MTP layers were dropped, shifted or cut short is found after the target has
loaded (minutes to hours for DeepSeek), and some of those problems are not even the drafter's to
catch (MTP tensors under another layer index make the *target's* loader die with a bare
``KeyError``). Every problem found is reported at once, each naming the file or tensor and the fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import regex as re

from .headers import read_checkpoint

# The dtypes of the safetensors format that torch and vLLM's loader can represent.
LOADABLE_DTYPES = frozenset({"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64", "F16",
                             "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4"})
DSPARK_MARKERS = ("main_proj", "main_norm", "markov_head", "confidence_head")
# What quantized exports store instead of a linear's ``weight``: GPTQ/AWQ ``qweight``,
# compressed-tensors' packed formats ``weight_packed`` (vLLM's loaders take either).
QUANTIZED_WEIGHT_NAMES = ("qweight", "weight_packed")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a checkpoint format keeps MTP layer ``j`` and what that layer must contain."""

    name: str
    prefix: Callable[[int], str]  # j -> checkpoint prefix of MTP layer j
    layer_of: Callable[[str], int | None]  # tensor name -> j (None: not an MTP-layer tensor)
    own: tuple[str, ...]  # the MTP-specific tensors (suffixes)
    block: tuple[str, ...]  # decoder-block tensors every MTP layer has (suffixes)
    expert: str  # suffix pattern of routed-expert tensors, with {e}
    expert_parts: tuple[str, ...]
    shapes: dict[str, tuple[int, ...]]  # own-tensor suffix -> expected shape


def v3_layout(config: dict) -> Layout:
    first, hidden = config["num_hidden_layers"], config["hidden_size"]
    attention = (("self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight",
                  "self_attn.q_b_proj.weight") if config.get("q_lora_rank")
                 else ("self_attn.q_proj.weight",))
    mlp = (("mlp.gate.weight",) if config.get("n_routed_experts")
           else ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"))

    def layer_of(name: str) -> int | None:  # negative for the main layers
        m = re.match(r"model\.layers\.(\d+)\.", name)
        return None if m is None else int(m.group(1)) - first

    return Layout(
        name="deepseek_v3 (model.layers.{num_hidden_layers + j}.*)",
        prefix=lambda j: f"model.layers.{first + j}.",
        layer_of=layer_of,
        own=("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"),
        block=("input_layernorm.weight", "post_attention_layernorm.weight", *attention,
               "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight",
               "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight", *mlp),
        expert="mlp.experts.{e}.{part}.weight",
        expert_parts=("gate_proj", "up_proj", "down_proj"),
        shapes={"enorm.weight": (hidden,), "hnorm.weight": (hidden,),
                "eh_proj.weight": (hidden, 2 * hidden), "shared_head.norm.weight": (hidden,)},
    )


def v4_layout(config: dict) -> Layout:
    hidden = config["hidden_size"]

    def layer_of(name: str) -> int | None:
        m = re.match(r"mtp\.(\d+)\.", name)
        return None if m is None else int(m.group(1))

    return Layout(
        name="deepseek_v4 (mtp.{j}.*)",
        prefix=lambda j: f"mtp.{j}.",
        layer_of=layer_of,
        own=("enorm.weight", "hnorm.weight", "e_proj.weight", "h_proj.weight", "norm.weight",
             "hc_head_fn", "hc_head_base", "hc_head_scale"),
        block=("attn_norm.weight", "ffn_norm.weight", "attn.wq_a.weight", "attn.wq_b.weight",
               "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight", "attn.attn_sink",
               "ffn.gate.weight", "hc_attn_fn", "hc_ffn_fn"),
        expert="ffn.experts.{e}.{part}.weight",
        expert_parts=("w1", "w2", "w3"),
        shapes={"enorm.weight": (hidden,), "hnorm.weight": (hidden,), "norm.weight": (hidden,)},
    )


# DeepSeek-V3.2 keeps V3's layout (plus indexer tensors, not required here).
LAYOUTS = {"deepseek_v3": v3_layout, "deepseek_v32": v3_layout, "deepseek_v4": v4_layout}


def mtp_problems(model_dir: str | Path, config: dict) -> list[str]:
    """Everything about ``model_dir``'s MTP part that disagrees with ``config``; empty when fine."""
    model_dir = Path(model_dir)
    tensors, problems = read_checkpoint(model_dir)
    return problems + tensor_problems(tensors, config, model_dir, files_broken=bool(problems))


def tensor_problems(tensors: dict[str, dict], config: dict, model_dir: Path,
                    files_broken: bool = False) -> list[str]:
    """The MTP-layer problems of a checkpoint given its tensors' header entries."""
    layout = LAYOUTS[config["model_type"]](config)
    declared = int(config.get("num_nextn_predict_layers") or 0)
    problems: list[str] = []
    by_layer: dict[int, set[str]] = {}
    for name in tensors:
        j = layout.layer_of(name)
        if j is not None:
            by_layer.setdefault(j, set()).add(name)
    if files_broken and not by_layer:
        return problems  # the files themselves are broken; nothing to say about layers
    drafting = {j for j, names in by_layer.items()
                if any(name.removeprefix(layout.prefix(j)) in layout.own for name in names)}
    for j in range(declared):
        names = by_layer.get(j, set())
        if not names:
            problems.append(_missing(layout, j, model_dir, config,
                                     sorted(drafting - set(range(declared)))))
        elif _looks_like_dspark(layout, j, names):
            problems.append(_dspark(layout, j, model_dir, names))
        else:
            problems += _incomplete(layout, j, names, tensors, config, model_dir)
    surplus = sorted(j for j in drafting if j >= declared)
    if surplus and all(by_layer.get(j) for j in range(declared)):
        where = ", ".join(layout.prefix(j) + "*" for j in surplus)
        problems.append(
            f"{model_dir}: the checkpoint has MTP layer(s) {where} beyond the "
            f"{declared} that config.json declares (num_nextn_predict_layers): set "
            f"num_nextn_predict_layers to {max(surplus) + 1} in config.json, or remove them.")
    return problems


def _missing(layout: Layout, j: int, model_dir: Path, config: dict, elsewhere: list[int]) -> str:
    wanted = layout.prefix(j) + "*"
    if elsewhere:
        found = ", ".join(layout.prefix(k) + "*" for k in elsewhere)
        return (f"{model_dir}: config.json puts MTP layer {j} at {wanted} (num_hidden_layers="
                f"{config['num_hidden_layers']}, num_nextn_predict_layers="
                f"{config.get('num_nextn_predict_layers')}), but the MTP tensors "
                f"(enorm/hnorm/...) are at {found}: the layer indices are shifted. Fix "
                "num_hidden_layers / num_nextn_predict_layers in config.json to match the "
                "tensors, or rename the tensors.")
    return (f"{model_dir} has no tensors for MTP layer {j} ({wanted}, {layout.name}), although "
            "config.json declares it (num_nextn_predict_layers). The checkpoint may have been "
            "quantized or exported without its MTP layers: use a checkpoint that keeps them, or "
            "serve without --speculative-config.")


def _looks_like_dspark(layout: Layout, j: int, names: set[str]) -> bool:
    prefix = layout.prefix(j)
    if any(name.removeprefix(prefix).split(".")[0] in DSPARK_MARKERS for name in names):
        return True
    return layout.prefix(0).startswith("mtp.") and not {prefix + "enorm.weight",
                                                        prefix + "hnorm.weight"} & names


def _dspark(layout: Layout, j: int, model_dir: Path, names: set[str]) -> str:
    return (f"{model_dir}: {layout.prefix(j)}* has {len(names)} tensors but no enorm/hnorm: it is "
            "a DSpark drafter stored under 'mtp.' (as in DeepSeek-V4-Flash-0731), not an MTP "
            "layer. Serve it with --speculative-config '{\"method\": \"dspark\", ...}' instead of "
            "\"mtp\".")


def _incomplete(layout, j, names, tensors, config, model_dir) -> list[str]:
    prefix = layout.prefix(j)
    problems = []
    stored = _stored(names)
    missing = [prefix + s for s in (*layout.own, *layout.block) if not stored(prefix + s)]
    experts = int(config.get("n_routed_experts") or 0)
    if experts:
        missing += [prefix + layout.expert.format(e=e, part=part)
                    for e in range(experts) for part in layout.expert_parts
                    if not stored(prefix + layout.expert.format(e=e, part=part))]
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        problems.append(f"{model_dir}: MTP layer {j} ({prefix}*) is incomplete: {len(missing)} "
                        f"tensor(s) missing: {shown}. Re-export the checkpoint with every tensor "
                        "of its MTP layers, or serve without --speculative-config.")
    for suffix, shape in layout.shapes.items():
        info = tensors.get(prefix + suffix)
        if info is not None and tuple(info["shape"]) != shape:
            problems.append(
                f"{model_dir / info['file']}: tensor '{prefix + suffix}' has shape "
                f"{list(info['shape'])}, but config.json (hidden_size {config['hidden_size']}) "
                f"needs {list(shape)}: the tensor and config.json disagree; re-export the MTP "
                "layer or fix config.json.")
    for name in sorted(names):
        dtype = tensors[name]["dtype"]
        if dtype not in LOADABLE_DTYPES:
            problems.append(
                f"{model_dir / tensors[name]['file']}: tensor '{name}' is stored as {dtype}, "
                f"which neither safetensors nor vLLM can load (known: "
                f"{', '.join(sorted(LOADABLE_DTYPES))}); re-export the MTP layer in a "
                "supported dtype.")
            break
    return problems


def _stored(names: set[str]) -> Callable[[str], bool]:
    """Whether the checkpoint holds tensor ``name``, or, for a ``.weight``, its quantized form."""

    def stored(name: str) -> bool:
        module = name.removesuffix(".weight")
        return name in names or (module != name and any(
            f"{module}.{alias}" in names for alias in QUANTIZED_WEIGHT_NAMES))

    return stored


def check_before_engine_start(hf_config) -> None:
    """Raise ``CheckpointError`` listing every problem of a local checkpoint's MTP part.

    ``hf_config`` is the target's config as vLLM hands it to ``hf_config_override`` (it carries the
    checkpoint path as ``name_or_path``). Checkpoints not on a local disk (hub ids before download)
    are left to the loader's own checks.
    """
    from .rules import CheckpointError

    config = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    model_dir = Path(str(getattr(hf_config, "name_or_path", "") or ""))
    if config.get("model_type") not in LAYOUTS or not (model_dir / "config.json").is_file():
        return
    problems = mtp_problems(model_dir, config)
    if problems:
        raise CheckpointError(
            f"vllm-mtp-plugin checked {model_dir} before starting the engine and found "
            f"{len(problems)} problem(s) with its MTP layers:\n"
            + "\n".join(f"  - {problem}" for problem in problems))
