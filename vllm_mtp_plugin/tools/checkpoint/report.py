"""What a checkpoint offers an MTP drafter, read from file headers only: the report ``vllm-mtp
inspect`` prints (``tools/inspect_cli.py``) and ``vllm-mtp doctor`` starts from.

Before a multi-hundred-gigabyte load, a user wants to know: does this checkpoint still have its MTP
layers (quantizers drop them), in which format, in which dtypes, and which tensors the drafter will
take from the target instead. This reads ``config.json`` and the safetensors headers (no tensor
data), sorts each MTP-layer tensor by the description the loader's tables are built from
(``weights/layers.py``: DeepSeek-V3, V3.2, V4) and reports the start-up check's problems, word for
word what ``vllm serve`` would refuse the checkpoint with.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ...weights.layers import LAYER_DESCRIPTIONS, Layout
from ...weights.preflight import tensor_problems
from ..cli_help import HelpFormatter, examples
from .target import TargetCheckpoint, TargetCheckpointError

BYTES_PER_ELEMENT = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2,
                     "F16": 2, "I16": 2, "U16": 2}


def checkpoint_layout(checkpoint: TargetCheckpoint) -> Layout:
    if checkpoint.layout is None:
        raise SystemExit(f"{checkpoint.config_path}: model_type "
                         f"{checkpoint.config.get('model_type')!r}; vllm-mtp inspect knows "
                         f"{', '.join(LAYER_DESCRIPTIONS)} checkpoints")
    return checkpoint.layout


def inspect_checkpoint(model_dir: str | Path) -> dict:
    """The report as a dict (also what ``--json`` prints); layers keyed by absolute index."""
    try:
        checkpoint = TargetCheckpoint(model_dir)
    except TargetCheckpointError as exc:
        raise SystemExit(f"vllm-mtp inspect: {exc}") from None
    model_dir, config = checkpoint.dir, checkpoint.config
    layout = checkpoint_layout(checkpoint)
    first = config["num_hidden_layers"]
    declared = int(config.get("num_nextn_predict_layers") or 0)
    tensors, file_problems = checkpoint.tensors, checkpoint.file_problems
    layers = {first + j: describe_layer(layout, j, tensors) for j in range(max(declared, 1))}
    problems = file_problems + tensor_problems(tensors, config, model_dir,
                                               files_broken=bool(file_problems))
    if declared == 0:
        problems.append(f"{model_dir / 'config.json'} declares no MTP layer "
                        "(num_nextn_predict_layers is 0 or missing)")
    return {"model": str(model_dir), "format": layout.name, "model_type": config["model_type"],
            "num_hidden_layers": first, "num_nextn_predict_layers": declared,
            "layers": layers, "problems": problems}


def describe_layer(layout: Layout, j: int, tensors: dict[str, dict]) -> dict:
    """MTP layer ``j``'s tensors sorted by the description: own, block, routed experts, copies of
    the target's (not loaded), optional ones present, linears stored quantized, and unknown ones."""
    names = sorted(n for n in tensors if layout.layer_of(n) == j)
    kinds, experts, quantized, optional, unknown = Counter(), set(), set(), [], []
    for name in names:
        entry = layout.entry_of(j, name)
        if entry is None:
            unknown.append(name)
            continue
        described, expert, is_quantized = entry
        kinds["shared" if described.shared else "own" if described.own
              else "expert" if described.per_expert else "block"] += 1
        if expert is not None:
            experts.add(expert)
        if is_quantized:
            quantized.add(described.name.format(e=expert))
        if described.optional and not described.shared:
            optional.append(name)
    shared = [n for n in names if (e := layout.entry_of(j, n)) is not None and e[0].shared]
    return {
        "prefix": layout.prefix(j),
        "tensors": len(names),
        "bytes": sum(_nbytes(tensors[n]) for n in names),
        "dtypes": dict(Counter(tensors[n]["dtype"] for n in names)),
        "kinds": dict(kinds),
        "experts": len(experts),
        "quantized": len(quantized),
        "optional": optional,
        "unknown": unknown,
        "shared_with_target": shared,
        "shared_bytes": sum(_nbytes(tensors[n]) for n in shared),
    }


def _nbytes(info: dict) -> int:
    count = 1
    for d in info["shape"]:
        count *= d
    return count * BYTES_PER_ELEMENT.get(info["dtype"], 1)


def format_report(report: dict) -> str:
    lines = [f"{report['model']}: {report['format']}, {report['num_hidden_layers']} main layers, "
             f"num_nextn_predict_layers={report['num_nextn_predict_layers']}"]
    for layer, info in report["layers"].items():
        dtypes = ", ".join(f"{k}×{v}" for k, v in sorted(info["dtypes"].items()))
        kinds = ", ".join(f"{v} {k}" for k, v in sorted(info["kinds"].items()))
        lines.append(f"  MTP layer {layer} ({info['prefix']}*): {info['tensors']} tensors, "
                     f"{info['bytes'] / 2**20:.1f} MiB ({dtypes}), {info['experts']} routed "
                     f"experts, {info['quantized']} linears quantized; {kinds or 'none'}")
        if info["shared_with_target"]:
            lines.append(f"    taken from the target instead (not loaded, "
                         f"{info['shared_bytes'] / 2**20:.1f} MiB saved): "
                         + ", ".join(info["shared_with_target"]))
        if info["unknown"]:
            lines.append("    not in the layer's description (the loader names any it cannot "
                         "place): " + ", ".join(info["unknown"][:8])
                         + (f" and {len(info['unknown']) - 8} more" if len(info["unknown"]) > 8
                            else ""))
    lines += [f"  PROBLEM: {p}" for p in report["problems"]] or ["  OK: usable as an MTP drafter"]
    return "\n".join(lines)
