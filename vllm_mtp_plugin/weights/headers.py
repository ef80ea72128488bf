"""What a checkpoint directory holds, from its safetensors headers only (no tensor data is read).

One reader (``read_checkpoint``) for the loader's error messages, ``vllm-mtp inspect`` and the
start-up check (``preflight``), so that all three see a checkpoint the same way. The start-up check
opens only the shards its index names for MTP-layer tensors; looking up one
tensor (``file_holding``) asks the shard index first: DeepSeek-V3 has 163 shards, often on network
storage, and every worker of every rank may ask; a header is read only where no index answers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


class UnreadableHeader(ValueError):
    """A safetensors file whose header cannot be read; the message names the file and why."""


def read_header(path: str | Path) -> dict[str, dict]:
    """``name -> {"shape", "dtype"}`` of one safetensors file (8-byte length, then JSON)."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:  # e.g. a Hugging Face cache link whose blob was never downloaded
        raise UnreadableHeader(f"{path}: cannot be read ({exc.strerror or exc}).") from exc
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


def read_checkpoint(model_dir: Path, wanted: Callable[[str], bool] | None = None,
                    ) -> tuple[dict[str, dict], list[str]]:
    """Every tensor's header entry, and the problems of the files themselves (absent shards named
    by the index, unreadable or truncated headers).

    With ``wanted`` and a shard index, only the shards the index says hold a wanted tensor are
    opened (the start-up check reads the MTP layer's shards of DeepSeek-V3's 163, not all of them);
    the entries returned are then those shards' tensors.
    """
    problems, tensors = [], {}
    index = model_dir / "model.safetensors.index.json"
    files = sorted(model_dir.glob("*.safetensors"))
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            named = set(weight_map.values())
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            problems.append(f"{index}: not a readable shard index ({exc}); re-download it.")
            weight_map, named = {}, set()
        for shard in sorted(named - {f.name for f in files}):
            problems.append(f"{index} names shard {shard}, which is not in {model_dir}: the "
                            "download is incomplete; fetch the missing shard(s) again.")
        if wanted is not None and weight_map:
            holding = {shard for name, shard in weight_map.items() if wanted(name)}
            files = [path for path in files if path.name in holding]
    for path in files:
        try:
            header = read_header(path)
        except UnreadableHeader as exc:
            problems.append(f"{exc} Re-download or re-export this file.")
            continue
        for name, info in header.items():
            tensors[name] = {**info, "file": path.name}
    return tensors, problems


def shard_index(model_dir: Path) -> dict[str, str] | None:
    """The index's ``weight_map`` (tensor name -> shard file), ``None`` without a readable one."""
    index = model_dir / "model.safetensors.index.json"
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return weight_map if isinstance(weight_map, dict) else None


def file_holding(model_dir: str | Path, name: str) -> str | None:
    """The file of ``model_dir`` that holds tensor ``name``, ``None`` if none does.

    The shard index answers when there is one (no header is opened); otherwise (a single-file
    checkpoint) the headers are read, one file at a time, until one holds ``name``.
    """
    model_dir = Path(model_dir)
    weight_map = shard_index(model_dir)
    if weight_map is not None:
        return weight_map.get(name)
    for path in sorted(model_dir.glob("*.safetensors")):
        try:
            if name in read_header(path):
                return path.name
        except UnreadableHeader:
            continue
    return None


def checkpoint_files(model_dir: str | Path | None) -> str:
    """What to name when a tensor is absent from the whole checkpoint: its shard index, its single
    safetensors file, or the directory."""
    if not model_dir or not Path(model_dir).is_dir():
        return str(model_dir or "the checkpoint")
    index = Path(model_dir) / "model.safetensors.index.json"
    files = sorted(Path(model_dir).glob("*.safetensors"))
    return str(index if index.exists() else files[0] if len(files) == 1 else model_dir)


def tensor_file(model_dir: str | None, name: str) -> str:
    """Which file of ``model_dir`` holds ``name`` (for error messages)."""
    if not model_dir or not Path(model_dir).is_dir():
        return str(model_dir or "the checkpoint")
    found = file_holding(model_dir, name)
    return str(Path(model_dir) / found) if found else str(model_dir)
