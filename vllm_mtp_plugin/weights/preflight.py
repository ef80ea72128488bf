"""Before the engine starts: does the checkpoint's MTP part agree with its config.json?

Runs where vLLM builds the speculative config (the front-end process, before any engine process or
weight load), from ``config.json``, the shard index and the safetensors headers only. Without it,
a checkpoint whose MTP layers were dropped, shifted or cut short is found after the target has
loaded (minutes to hours for DeepSeek), and some of those problems are not even the drafter's to
catch (MTP tensors under another layer index make the *target's* loader die with a bare
``KeyError``). Every problem found is reported at once, each naming the file or tensor and the fix.
"""

from __future__ import annotations

from pathlib import Path

from .headers import checkpoint_files, read_checkpoint
from .layers import DSPARK_MARKERS, LAYER_DESCRIPTIONS, V4_LAYER, Layout, stored
from .loader import CheckpointError, dspark_drafter, no_mtp_tensors

# The dtypes of the safetensors format that torch and vLLM's loader can represent.
LOADABLE_DTYPES = frozenset({"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64", "F16",
                             "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4"})


def layout_for(config: dict) -> Layout | None:
    """What config.json's MTP layers must contain (``layers.py``), ``None`` for other models."""
    description = LAYER_DESCRIPTIONS.get(config.get("model_type"))
    return None if description is None else description.layout(config)


def mtp_problems(model_dir: str | Path, config: dict) -> list[str]:
    """Everything about ``model_dir``'s MTP part that disagrees with ``config``; empty when fine."""
    model_dir = Path(model_dir)
    layout = layout_for(config)
    tensors, problems = read_checkpoint(
        model_dir, wanted=None if layout is None else _mtp_tensor_test(layout))
    return problems + tensor_problems(tensors, config, model_dir, files_broken=bool(problems))


def _mtp_tensor_test(layout: Layout):
    """Which names the start-up check needs headers for: every tensor at an index past the main
    layers, and MTP-only names (``enorm``, ``eh_proj``, ...) at a main layer's index (an MTP layer
    shifted down). Other shards stay unopened."""
    own = set(layout.own())

    def wanted(name: str) -> bool:
        j = layout.layer_of(name)
        return j is not None and (j >= 0 or name.removeprefix(layout.prefix(j)) in own)

    return wanted


def tensor_problems(tensors: dict[str, dict], config: dict, model_dir: Path,
                    files_broken: bool = False) -> list[str]:
    """The MTP-layer problems of a checkpoint given its tensors' header entries."""
    layout = layout_for(config)
    declared = int(config.get("num_nextn_predict_layers") or 0)
    problems: list[str] = []
    by_layer: dict[int, set[str]] = {}
    for name in tensors:
        j = layout.layer_of(name)
        if j is not None:
            by_layer.setdefault(j, set()).add(name)
    if files_broken and not by_layer:
        return problems  # the files themselves are broken; nothing to say about layers
    own = set(layout.own())
    drafting = {j for j, names in by_layer.items()
                if any(name.removeprefix(layout.prefix(j)) in own for name in names)}
    for j in range(declared):
        names = by_layer.get(j, set())
        if not names:
            problems.append(_missing(layout, j, model_dir, config,
                                     sorted(drafting - set(range(declared)))))
        elif _looks_like_dspark(layout, j, names):
            markers = {name.removeprefix(layout.prefix(j)).split(".")[0] for name in names}
            problems.append(f"{model_dir}: " + dspark_drafter(
                layout.prefix(j), len(names), sorted(markers & set(DSPARK_MARKERS))))
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


def drafter_kind(tensors: dict[str, dict], config: dict) -> str:
    """What the checkpoint stores where its MTP layers belong: ``"mtp"`` (DeepSeek MTP layers,
    complete or not), ``"dspark"`` (another drafter format under the MTP prefix) or ``"none"``
    (no drafter: none declared, or the declared layers hold no tensor anywhere)."""
    layout = layout_for(config)
    if layout is None:
        return "none"
    declared = int(config.get("num_nextn_predict_layers") or 0)
    by_layer: dict[int, set[str]] = {}
    for name in tensors:
        j = layout.layer_of(name)
        if j is not None:
            by_layer.setdefault(j, set()).add(name)
    if any(_looks_like_dspark(layout, j, names) for j, names in by_layer.items() if j >= 0):
        return "dspark"
    own = set(layout.own())
    # An MTP layer's own tensors anywhere (also at a shifted index, or undeclared), or tensors
    # where a declared layer belongs: a layer that the start-up check's message can fix.
    drafting = any(name.removeprefix(layout.prefix(j)) in own
                   for j, names in by_layer.items() for name in names)
    return "mtp" if drafting or any(by_layer.get(j) for j in range(declared)) else "none"


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
    return no_mtp_tensors(checkpoint_files(model_dir), j, layout.prefix(j), layout.name)


def _looks_like_dspark(layout: Layout, j: int, names: set[str]) -> bool:
    prefix = layout.prefix(j)
    if any(name.removeprefix(prefix).split(".")[0] in DSPARK_MARKERS for name in names):
        return True
    # V4's only: a V3 layer without its norms is merely incomplete.
    return layout.description is V4_LAYER and not {prefix + "enorm.weight", prefix + "hnorm.weight"} & names


def _incomplete(layout, j, names, tensors, config, model_dir) -> list[str]:
    prefix = layout.prefix(j)
    problems = []
    missing = [name for name, t in layout.required(j) if not stored(names, name, t.quantizable)]
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        problems.append(f"{model_dir}: MTP layer {j} ({prefix}*) is incomplete: {len(missing)} "
                        f"tensor(s) missing: {shown}. Re-export the checkpoint with every tensor "
                        "of its MTP layers, or serve without --speculative-config.")
    for name, shape in layout.shapes(j).items():
        info = tensors.get(name)
        if info is not None and tuple(info["shape"]) != shape:
            problems.append(
                f"{model_dir / info['file']}: tensor '{name}' has shape "
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


def check_before_engine_start(hf_config) -> None:
    """Raise ``CheckpointError`` listing every problem of a local checkpoint's MTP part.

    ``hf_config`` is the target's config as vLLM hands it to ``hf_config_override`` (it carries the
    checkpoint path as ``name_or_path``). Checkpoints not on a local disk (hub ids before download)
    are left to the loader's own checks.
    """
    config = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    model_dir = Path(str(getattr(hf_config, "name_or_path", "") or ""))
    if config.get("model_type") not in LAYER_DESCRIPTIONS or not (model_dir / "config.json").is_file():
        return
    problems = mtp_problems(model_dir, config)
    if problems:
        raise CheckpointError(
            f"vllm-mtp-plugin checked {model_dir} before starting the engine and found "
            f"{len(problems)} problem(s) with its MTP layers:\n"
            + "\n".join(f"  - {problem}" for problem in problems))
