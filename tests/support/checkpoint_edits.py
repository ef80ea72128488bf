"""Edited copies of a checkpoint directory, for tests that need a checkpoint a little different
from the ones ``conftest.py`` builds (a field of config.json changed, a tensor added or replaced).

The source directory is never touched: the session's checkpoints are shared by every test.
"""

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

TensorEdit = Callable[[dict[str, torch.Tensor]], None]


def edited_copy(source: Path, dest: Path, *, tensors: TensorEdit | None = None,
                **config_changes) -> Path:
    """``source`` copied to ``dest``; ``config_changes`` set in its config.json; ``tensors`` edits
    the dict of its ``model.safetensors`` in place (written back). Returns ``dest``."""
    source, dest = Path(source), Path(dest)
    shutil.copytree(source, dest, dirs_exist_ok=True)
    if config_changes:
        config = json.loads((dest / "config.json").read_text())
        config.update(config_changes)
        (dest / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        from safetensors.torch import load_file, save_file

        loaded = load_file(str(dest / "model.safetensors"))
        tensors(loaded)
        save_file(loaded, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest

