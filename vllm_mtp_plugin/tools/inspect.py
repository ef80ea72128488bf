"""``vllm-mtp inspect DIR``: what a checkpoint offers an MTP drafter, read from file headers only.

Before a multi-hundred-gigabyte load, a user wants to know: does this checkpoint still have its MTP
layers (quantizers drop them), in which format, in which dtypes, and which tensors the drafter will
take from the target instead. This reads ``config.json`` and the safetensors headers (no tensor
data) and applies the same weight map the loader uses.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from ..weights.headers import read_checkpoint
from ..weights.rules import WeightMap
from ..weights.v3 import V3_OWN_TENSORS, v3_weight_map

# Tensors each variant needs besides its decoder block, as checkpoint names of MTP layer {layer}.
REQUIRED_OWN = {"deepseek_v3": tuple(f"model.layers.{{layer}}.{t}.weight" for t in V3_OWN_TENSORS)}


def weight_map_for(config: dict) -> WeightMap:
    from ..platform import fused_moe_expert_params

    model_type = config.get("model_type")
    if model_type == "deepseek_v3":
        return v3_weight_map(fused_moe_expert_params())
    raise SystemExit(f"model_type {model_type!r}: vllm-mtp inspect knows deepseek_v3 checkpoints")


def inspect(model_dir: str | Path) -> dict:
    """The report as a dict (also what ``--json`` prints)."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    weight_map = weight_map_for(config)
    first = config["num_hidden_layers"]
    declared = int(config.get("num_nextn_predict_layers") or 0)
    tensors, file_problems = read_checkpoint(model_dir)
    layers = {}
    for layer in range(first, first + max(declared, 1)):
        names = [n for n in tensors if weight_map.mtp_layer(n) == layer]
        targets = {n: weight_map.resolve(n, lambda p: "fused_qkv_a_proj" in p) for n in names}
        required = [t.format(layer=layer) for t in REQUIRED_OWN.get(config["model_type"], ())]
        missing = [t for t in required if t not in tensors] if names else []
        shared = [n for n, t in targets.items() if t is None]
        layers[layer] = {
            "tensors": len(names),
            "bytes": sum(_nbytes(tensors[n]) for n in names),
            "dtypes": dict(Counter(tensors[n]["dtype"] for n in names)),
            "experts": len({t.expert_id for t in targets.values() if t and t.expert_id is not None}),
            "shared_with_target": shared,
            "shared_bytes": sum(_nbytes(tensors[n]) for n in shared),
            "missing": missing,
        }
    problems = list(file_problems)
    if declared == 0:
        problems.append("config.json declares no MTP layer (num_nextn_predict_layers is 0 or "
                        "missing)")
    for layer, info in layers.items():
        if declared and info["tensors"] == 0:
            problems.append(f"MTP layer {layer} has no tensors: the checkpoint may have been "
                            "quantized or exported without its MTP layers")
        elif info["missing"]:
            problems.append(f"MTP layer {layer} lacks {', '.join(info['missing'])}")
    return {"model": str(model_dir), "format": weight_map.name, "model_type": config["model_type"],
            "num_hidden_layers": first, "num_nextn_predict_layers": declared,
            "layers": layers, "problems": problems}


def _nbytes(info: dict) -> int:
    size = {"F64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2}.get(info["dtype"], 1)
    count = 1
    for d in info["shape"]:
        count *= d
    return count * size


def format_report(report: dict) -> str:
    lines = [f"{report['model']}: {report['format']}, {report['num_hidden_layers']} main layers, "
             f"num_nextn_predict_layers={report['num_nextn_predict_layers']}"]
    for layer, info in report["layers"].items():
        dtypes = ", ".join(f"{k}×{v}" for k, v in sorted(info["dtypes"].items()))
        lines.append(f"  MTP layer {layer}: {info['tensors']} tensors, {info['bytes'] / 2**20:.1f} MiB"
                     f" ({dtypes}), {info['experts']} routed experts")
        if info["shared_with_target"]:
            lines.append(f"    taken from the target instead (not loaded, "
                         f"{info['shared_bytes'] / 2**20:.1f} MiB saved): "
                         + ", ".join(info["shared_with_target"]))
    lines += [f"  PROBLEM: {p}" for p in report["problems"]] or ["  OK: usable as an MTP drafter"]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-mtp inspect", description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = inspect(args.model_dir)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 1 if report["problems"] else 0
