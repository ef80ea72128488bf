"""What a checkpoint directory holds, from its safetensors headers only (no tensor data is read).

One reader for the loader's error messages, ``vllm-mtp inspect`` and the start-up checks, so that
all three see a checkpoint the same way.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_headers(model_dir: str | Path) -> dict[str, dict]:
    """``name -> {"shape", "dtype", "file"}`` for every tensor of every ``*.safetensors`` file."""
    tensors = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, info in header.items():
            if name != "__metadata__":
                tensors[name] = {"shape": info["shape"], "dtype": info["dtype"], "file": path.name}
    return tensors


def tensor_file(model_dir: str | None, name: str) -> str:
    """Which file of ``model_dir`` holds ``name`` (for error messages)."""
    if not model_dir or not Path(model_dir).is_dir():
        return str(model_dir or "the checkpoint")
    index = Path(model_dir) / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        if name in weight_map:
            return str(Path(model_dir) / weight_map[name])
    info = read_headers(model_dir).get(name)
    return str(Path(model_dir) / info["file"]) if info else str(model_dir)
