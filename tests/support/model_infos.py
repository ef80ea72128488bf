"""What vLLM learns about the suite's model classes, learned once per run, before any engine starts.

vLLM inspects an architecture's class in a subprocess (``python -m
vllm.model_executor.models.registry``: a vLLM import, plugins loaded, the model module imported;
10-25 s on 2 busy cores) the first time a ``VLLM_CACHE_ROOT`` meets it, and keeps the answer in
``<root>/modelinfos`` (``registry.py``, ``_LazyRegisteredModel.inspect_model_cls``), checked against
the module's hash whenever it is read. Both pytest workers used to inspect the same classes at
once at the start of a run, three to nine inspections in all. Run as a script, this file inspects
them all in one process, through vLLM's own ``inspect_model_cls`` (so the files are vLLM's, with
its hashes): the plugin's V3 drafter as vLLM does it (its subprocess, which loads the plugin, what
every user's first start runs), the others in this process, which has imported vLLM already.
An engine then reads the files as on any later start of the same model. A class this fails on is
left to the engine, which inspects it as before.

``start(root)`` runs it in the background, holding a lock on ``<root>/modelinfos.lock`` for its
lifetime; ``wait(root)`` returns once it has ended.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

# The architectures the suite's engines serve: targets and drafters, V3 and V4.
ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepSeekMTPModel", "DeepseekV4ForCausalLM",
                 "DeepSeekV4MTPModel")
# Inspected as vLLM does it on a first start, in its subprocess: the plugin's V3 drafter.
THROUGH_VLLMS_SUBPROCESS = "vllm_mtp_plugin.models.v3"


def _lock_path(root: Path) -> Path:
    return Path(root) / "modelinfos.lock"


def start(root: Path, log: Path) -> None:
    """Inspect in a background process that holds the lock until it ends (taken here first, so a
    ``wait`` right after this returns cannot miss it)."""
    Path(root).mkdir(parents=True, exist_ok=True)
    lock = open(_lock_path(root), "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    with open(log, "w") as out:
        subprocess.Popen([sys.executable, __file__], stdout=out, stderr=subprocess.STDOUT,
                         pass_fds=(lock.fileno(),), env={**os.environ, "VLLM_CACHE_ROOT": str(root)})
    lock.close()  # the child's copy keeps the lock


def wait(root: Path) -> None:
    path = _lock_path(root)
    if path.exists():
        with open(path) as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)


def _inspect_all() -> None:
    import time

    from vllm import ModelRegistry
    from vllm.model_executor.models import registry
    from vllm.plugins import load_general_plugins

    entries = [ModelRegistry.models[arch] for arch in ARCHITECTURES]  # vLLM's own classes
    load_general_plugins()
    entries += [ModelRegistry.models[arch] for arch in ARCHITECTURES]  # the plugin's
    in_subprocess = registry._run_in_subprocess
    seen = set()
    for entry in entries:
        name = (getattr(entry, "module_name", None), getattr(entry, "class_name", None))
        if name in seen or not hasattr(entry, "inspect_model_cls"):
            continue
        seen.add(name)
        registry._run_in_subprocess = (in_subprocess if name[0] == THROUGH_VLLMS_SUBPROCESS
                                       else lambda fn: fn())
        began = time.monotonic()
        try:
            entry.inspect_model_cls()
            print(f"{name[0]}.{name[1]}: {time.monotonic() - began:.1f} s", flush=True)
        except Exception as error:  # the engine will inspect it itself
            print(f"{name[0]}.{name[1]}: not inspected: {error!r}", flush=True)
    registry._run_in_subprocess = in_subprocess


if __name__ == "__main__":
    _inspect_all()
