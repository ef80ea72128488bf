"""What a checkpoint directory holds, from its safetensors headers only (no tensor data is read).

One reader (``read_checkpoint``) for the loader's error messages, ``vllm-mtp inspect`` and the
start-up check (``preflight``), so that all three see a checkpoint the same way.
"""

from __future__ import annotations

import json
from pathlib import Path


class UnreadableHeader(ValueError):
    """A safetensors file whose header cannot be read; the message names the file and why."""


def read_header(path: str | Path) -> dict[str, dict]:
    """``name -> {"shape", "dtype"}`` of one safetensors file (8-byte length, then JSON)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise UnreadableHeader(f"{path}: {size} bytes, too short for a safetensors header.")
        length = int.from_bytes(prefix, "little")
        if length > size - 8:
            raise UnreadableHeader(f"{path}: the header says it is {length} bytes long, but the "
                                   f"file has {size} bytes: the file is truncated.")
        try:
            header = json.loads(f.read(length))
            tensors = {name: {"shape": list(info["shape"]), "dtype": str(info["dtype"]),
                              "end": int(info["data_offsets"][1])}
                       for name, info in header.items() if name != "__metadata__"}
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            raise UnreadableHeader(f"{path}: the safetensors header is not valid ({exc}).") from exc
    data_end = 8 + length + max((info.pop("end") for info in tensors.values()), default=0)
    if data_end > size:
        raise UnreadableHeader(f"{path}: the header places tensor data up to byte {data_end}, but "
                               f"the file has {size} bytes: the file is truncated.")
    return tensors


def read_checkpoint(model_dir: Path) -> tuple[dict[str, dict], list[str]]:
    """Every tensor's header entry, and the problems of the files themselves (absent shards named
    by the index, unreadable or truncated headers)."""
    problems, tensors = [], {}
    index = model_dir / "model.safetensors.index.json"
    files = sorted(model_dir.glob("*.safetensors"))
    if index.exists():
        try:
            named = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError) as exc:
            problems.append(f"{index}: not a readable shard index ({exc}); re-download it.")
            named = set()
        for shard in sorted(named - {f.name for f in files}):
            problems.append(f"{index} names shard {shard}, which is not in {model_dir}: the "
                            "download is incomplete; fetch the missing shard(s) again.")
    for path in files:
        try:
            header = read_header(path)
        except UnreadableHeader as exc:
            problems.append(f"{exc} Re-download or re-export this file.")
            continue
        for name, info in header.items():
            tensors[name] = {**info, "file": path.name}
    return tensors, problems


def tensor_file(model_dir: str | None, name: str) -> str:
    """Which file of ``model_dir`` holds ``name`` (for error messages)."""
    if not model_dir or not Path(model_dir).is_dir():
        return str(model_dir or "the checkpoint")
    index = Path(model_dir) / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        if name in weight_map:
            return str(Path(model_dir) / weight_map[name])
    info = read_checkpoint(Path(model_dir))[0].get(name)
    return str(Path(model_dir) / info["file"]) if info else str(model_dir)
