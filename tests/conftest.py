"""Shared fixtures: tiny DeepSeek-V3 checkpoints built once per test session, and engine settings."""

import logging
import os
from pathlib import Path

import pytest

# Small, fast engines (docs/testing.md).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from vllm_mtp_plugin.tools.tiny.v3 import build_checkpoint  # noqa: E402
from vllm_mtp_plugin.tools.tiny.tokenizer import bundled_prompt_texts  # noqa: E402
from support.shared_build import build_once, run_root  # noqa: E402


SUITE_ENVIRONMENT = dict(os.environ)


@pytest.fixture(autouse=True)
def _environment_as_the_suite_started():
    """After each test os.environ is what the suite started with. vLLM writes to it while it
    builds a config in this process (test or module fixture), e.g. ``VLLM_USE_BREAKABLE_CUDAGRAPH=1``
    for some model shapes, which turns compilation off in every engine started later from this
    process's environment (seen: a compiled Model Runner V2 engine ran with mode NONE)."""
    yield
    for name in set(os.environ) - set(SUITE_ENVIRONMENT) - {"PYTEST_CURRENT_TEST"}:
        del os.environ[name]
    for name, value in SUITE_ENVIRONMENT.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


@pytest.fixture
def plugin_log(caplog, monkeypatch):
    """caplog on the plugin's logger, which vLLM's logging setup may cut off from the root
    logger caplog listens on (``propagate``/``disabled``)."""
    logger = logging.getLogger("vllm.vllm_mtp_plugin")
    monkeypatch.setattr(logger, "propagate", False)
    monkeypatch.setattr(logger, "disabled", False)
    caplog.set_level(logging.DEBUG, logger=logger.name)
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Builds each tiny checkpoint on first use: ``checkpoints("noisy", acceptance=0.6)``; one
    path per checkpoint for every worker of the run (``support/shared_build.py``: compiled engines
    of the same configuration share vLLM's compile cache)."""
    root = run_root(tmp_path_factory) / "checkpoints"
    built: dict[tuple, Path] = {}

    def get(mode: str = "oracle", **kwargs) -> Path:
        key = (mode, *sorted(kwargs.items()))
        if key not in built:
            name = "-".join(f"{k}{v}" for k, v in key[1:])
            path = root / "-".join(filter(None, (mode, name)))
            built[key] = build_once(path, lambda out: build_checkpoint(out, "tiny", mode, **kwargs))
        return built[key]

    return get


@pytest.fixture(scope="session")
def prompts():
    """A few bundled prompts of different lengths (one is a single word)."""
    texts = bundled_prompt_texts()
    return [texts[0], texts[5], texts[40], "Hello"]
