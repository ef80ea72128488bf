"""Edited copies of a checkpoint directory, for tests that need a checkpoint a little different
from the ones ``conftest.py`` builds (a field of config.json changed, a tensor added, dropped or
replaced, its stored bytes or the files themselves damaged).

The source directory is never touched: the session's checkpoints are shared by every test.

Tensor edits take the shard's ``{name: tensor}`` dict and either change it in place or return the
new dict, so the same edit (``drop``) serves torch tensors and raw entries alike. Raw entries,
``(safetensors dtype name, shape, bytes)``, are for what torch cannot load or would change: a dtype
no loader knows, bytes kept exactly.
"""

import json
import shutil
from collections.abc import Callable
from pathlib import Path

RawTensors = dict[str, tuple[str, list[int], bytes]]
TensorEdit = Callable[[dict], dict | None]


def edited_copy(source: Path, dest: Path, *, tensors: TensorEdit | None = None,
                raw_tensors: TensorEdit | None = None, files: Callable[[Path], None] | None = None,
                **config_changes) -> Path:
    """``source`` copied to ``dest``; ``config_changes`` set in its config.json; ``tensors`` edits
    the dict of its ``model.safetensors`` (written back with safetensors), ``raw_tensors`` its raw
    entries (written back byte for byte, ``write_raw``); ``files(dest)`` runs last, for edits of
    the files themselves. Returns ``dest``."""
    source, dest = Path(source), Path(dest)
    shutil.copytree(source, dest, dirs_exist_ok=True)
    if config_changes:
        config = json.loads((dest / "config.json").read_text())
        config.update(config_changes)
        (dest / "config.json").write_text(json.dumps(config))
    shard = dest / "model.safetensors"
    if tensors is not None:
        from safetensors.torch import load_file, save_file

        save_file(_edited(tensors, load_file(str(shard))), str(shard), metadata={"format": "pt"})
    if raw_tensors is not None:
        write_raw(shard, _edited(raw_tensors, read_raw(shard)))
    if files is not None:
        files(dest)
    return dest


def _edited(edit: TensorEdit, tensors: dict) -> dict:
    returned = edit(tensors)
    return tensors if returned is None else returned


def drop(*needles: str) -> TensorEdit:
    """An edit that removes every tensor whose name contains one of ``needles``."""
    return lambda t: {k: v for k, v in t.items() if not any(n in k for n in needles)}


def noise(prefix: str, scale: float, seed: int = 0) -> TensorEdit:
    """An edit that adds Gaussian noise, ``scale`` times each tensor's spread, to the matrices
    under ``prefix`` (an MTP layer's own and block tensors; its embedding and head copies are
    left alone)."""
    import torch

    def add_noise(tensors):
        generator = torch.Generator().manual_seed(seed)
        for name, t in tensors.items():
            if name.startswith(prefix) and t.dim() == 2 and "embed" not in name \
                    and "shared_head.head" not in name:
                spread = torch.randn(t.shape, generator=generator) * t.float().std() * scale
                tensors[name] = (t.float() + spread).to(t.dtype)

    return add_noise


def read_raw(path: Path) -> RawTensors:
    """A safetensors file's tensors as stored: ``{name: (dtype name, shape, bytes)}``."""
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    return {name: (info["dtype"], info["shape"], data[info["data_offsets"][0]:info["data_offsets"][1]])
            for name, info in header.items() if name != "__metadata__"}


def write_raw(path: Path, tensors: RawTensors) -> None:
    """``tensors`` written as a safetensors file, in the dict's order, whatever their dtype names
    (no metadata)."""
    header, offset = {}, 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    Path(path).write_bytes(len(encoded).to_bytes(8, "little") + encoded
                           + b"".join(data for _, _, data in tensors.values()))


def same_target(one: Path, two: Path) -> bool:
    """Whether two tiny checkpoints hold the same target weights (their MTP layers may differ in
    number and content): a k = 0 run of one is then the baseline of the other."""
    import json
    import re

    from safetensors.torch import load_file
    import torch

    def target(path: Path) -> dict:
        layers = json.loads((Path(path) / "config.json").read_text())["num_hidden_layers"]
        tensors = load_file(str(Path(path) / "model.safetensors"))
        return {name: t for name, t in tensors.items()
                if not (m := re.match(r"model\.layers\.(\d+)\.", name)) or int(m[1]) < layers}

    a, b = target(one), target(two)
    return set(a) == set(b) and all(torch.equal(a[name], b[name]) for name in a)
