"""Write a checkpoint that is a target's files plus MTP-layer shards of its own.

Shared by ``vllm-mtp graft`` (layers copied from another checkpoint) and ``vllm-mtp train``
(trained layers). The target's files are linked (or copied) untouched; a target shard that also
holds MTP-layer tensors being replaced (a refresh of a checkpoint that keeps its MTP layer in a
shard with other tensors) is rewritten without them, since vLLM reads every tensor of every
indexed shard and would load the old layer as well. The shard index and
``num_nextn_predict_layers`` are updated, and the result must pass the plugin's start-up check.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ...weights.preflight import mtp_problems
from .target import TargetCheckpoint

INDEX = "model.safetensors.index.json"


def link_or_copy(src: Path, dst: Path, copy: bool) -> None:
    if src.is_dir():
        shutil.copytree(src, dst, symlinks=False, copy_function=shutil.copy2 if copy else
                        (lambda s, d: os.symlink(os.path.abspath(s), d)))
    elif copy:
        shutil.copy2(src, dst)
    else:
        os.symlink(src.resolve(), dst)


def is_training_report(item: Path) -> bool:
    """``vllm-mtp train``'s report beside a layer it trained (``OUT/training``): it describes
    that layer, not one trained from it (a refresh of a refreshed layer, as ``--adapt`` does
    each round), so it is not carried over."""
    return item.name == "training" and (item / "training.json").is_file()


def target_weight_map(target: TargetCheckpoint) -> dict[str, str]:
    """Tensor name -> shard file: the target's index as written, else from its headers."""
    index = target.dir / INDEX
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    return {name: info["file"] for name, info in target.tensors.items()}


def _without(src: Path, dst: Path, drop: set[str]) -> list[str]:
    """Rewrite shard ``src`` as ``dst`` without the tensors in ``drop``; returns what it kept."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        kept = [n for n in f.keys() if n not in drop]
        tensors = {n: f.get_tensor(n) for n in kept}
        metadata = f.metadata() or {"format": "pt"}
    if kept:
        save_file(tensors, str(dst), metadata=metadata)
    return kept


class CheckpointWriteError(ValueError):
    """The assembled checkpoint failed the start-up check; the message lists why."""


def assemble(target: TargetCheckpoint, out: Path, layer_map: dict[str, str], mtp_layers: int,
             copy: bool, drop: set[str] = frozenset()) -> dict:
    """Link the target's files into ``out`` (whose layer shards ``layer_map`` names are already
    written there), leave out the tensors in ``drop``, write the index and config.json, and run
    the start-up check. Returns what was done."""
    target_dir = target.dir
    weight_map = target_weight_map(target)
    rewritten = sorted({weight_map[n] for n in drop if n in weight_map})
    for item in sorted(target_dir.iterdir()):
        if item.name in ("config.json", INDEX) or item.name.startswith(".") or \
                is_training_report(item):
            continue
        if item.name in rewritten:
            _without(item, out / item.name, drop)
        else:
            link_or_copy(item, out / item.name, copy)
    weight_map = {n: f for n, f in weight_map.items() if n not in drop}
    weight_map.update(layer_map)
    total = sum((out / f).stat().st_size for f in set(weight_map.values()))
    (out / INDEX).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
        indent=2))
    config = {**target.config, "num_nextn_predict_layers": mtp_layers}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    problems = mtp_problems(out, config)
    if problems:
        raise CheckpointWriteError(f"{out}: the written checkpoint fails the start-up check:\n"
                                   + "\n".join(f"- {p}" for p in problems))
    return {"rewritten": rewritten}
