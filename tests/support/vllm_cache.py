"""A private ``VLLM_CACHE_ROOT`` for a test whose engines must see no other engine's compilation,
seeded with what vLLM learned about the model classes under the run's own root.

vLLM inspects an architecture's class in a subprocess the first time a cache root meets it
(``model_executor/models/registry.py``: ``_run_in_subprocess``, ~7.6 s each here, two per DeepSeek
engine with MTP) and keeps the answer in ``<root>/modelinfos``, checked against the module's hash
when read. Copying those files changes nothing an engine compiles or loads.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def private_cache_root(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    shared = Path(os.environ.get("VLLM_CACHE_ROOT") or path) / "modelinfos"
    if shared.is_dir() and shared != path / "modelinfos":
        shutil.copytree(shared, path / "modelinfos", dirs_exist_ok=True)
    return path
