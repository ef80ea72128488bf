"""Tiny checkpoints shared by pytest-xdist's workers for the whole run.

vLLM's compile cache keys on the model path (``ModelConfig.compute_hash`` hashes ``model``), so a
checkpoint built once at one path lets an engine in either worker load what the other worker's
engine of the same configuration compiled (``tests/run.sh`` shares one ``VLLM_CACHE_ROOT``).
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

# Written last by ``tools/tiny/v3.build_checkpoint``: its presence means the build finished.
COMPLETE_MARKER = "tiny_meta.json"


def run_root(tmp_path_factory) -> Path:
    """The session's temporary root: shared by the xdist workers (each has its own ``popen-gwN``
    below it), or pytest's own base directory without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_once(path: Path, build: Callable[[Path], Path]) -> Path:
    """``build(path)`` unless a finished build is there; one worker builds, the other waits on the
    lock. Built under a temporary name and renamed, so no worker sees half a checkpoint."""
    if (path / COMPLETE_MARKER).exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / COMPLETE_MARKER).exists():
            partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
            shutil.rmtree(partial, ignore_errors=True)
            build(partial)
            os.replace(partial, path)
    return path
