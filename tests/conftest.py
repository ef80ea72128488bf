"""Shared fixtures: tiny DeepSeek-V3 checkpoints built once per test session, and engine settings."""

import logging
import os
from pathlib import Path

import pytest

# Small, fast engines (docs/testing.md).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# One OpenMP thread per engine, as vLLM's default process mode gives its worker on a 2-core machine
# (one core reserved for the engine core): two pytest workers' engines, two threads each, would
# spin-wait for each other's cores (measured: test_engine_v3 437 -> 369 s beside test_bench_e2e).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# `vllm-mtp train` without --work-dir keeps its state below this run's own directory, not the
# user's cache (test_train_e2e.py checks the default itself).
if "VLLM_MTP_WORK_ROOT" not in os.environ:
    import tempfile

    os.environ["VLLM_MTP_WORK_ROOT"] = tempfile.mkdtemp(prefix="vllm-mtp-work-")
# Model Runner V2 on vllm-cpu runs through the repository's interpreter harness (tools/engine/mrv2.py).
os.environ.setdefault("VLLM_MTP_MRV2_HARNESS", str(Path(__file__).parent / "mrv2_harness"))
# Each engine in a process forked from one that has imported vLLM already (support/fork_server.py).
os.environ.setdefault("MTP_OFFLINE_LAUNCHER", str(Path(__file__).parent / "support" / "fork_server.py"))
# Forked engines load the code an earlier engine of the run generated for the same graphs from
# torch's caches (support/torch_caches.py: why torch 2.13 and vLLM need a patch for that).
os.environ.setdefault("MTP_FORK_SERVER_PRELOAD",
                      str(Path(__file__).parent / "support" / "torch_caches.py"))
# Inductor's C++ kernels built once per run, whichever compile key asks (support/cxx/g++); the
# cache lives with this run's vLLM cache (tests/run.sh makes a new one per run).
if "VLLM_CACHE_ROOT" in os.environ:
    os.environ.setdefault("CXX", str(Path(__file__).parent / "support" / "cxx" / "g++"))
    os.environ.setdefault("MTP_TEST_CXX_CACHE", os.path.join(os.environ["VLLM_CACHE_ROOT"], "cxx"))
    os.environ.setdefault("MTP_TEST_TORCH_CACHE", os.path.join(os.environ["VLLM_CACHE_ROOT"], "torch"))
# ... and so do engines in the processes tests start or vLLM spawns (servers, engine cores,
# workers, tensor-parallel ranks): the suite's sitecustomize runs support/torch_caches.py there.
if os.environ.get("MTP_TEST_TORCH_CACHE"):
    _site = str(Path(__file__).parent / "mrv2_harness")
    _path = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if _site not in _path:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [_site, *_path] if p)

from vllm_mtp_plugin.tools.tiny.v3 import build_checkpoint  # noqa: E402
from vllm_mtp_plugin.tools.tiny.tokenizer import bundled_prompt_texts  # noqa: E402
from support.shared_build import build_once, run_root  # noqa: E402
from support import durations, model_infos  # noqa: E402


SUITE_ENVIRONMENT = dict(os.environ)


def pytest_sessionstart(session):
    """vLLM's model-class inspections for the run's cache root, once, in the background while the
    workers start (``support/model_infos.py``); in the controller only, before xdist starts them."""
    root = os.environ.get("VLLM_CACHE_ROOT")
    if root and not os.environ.get("PYTEST_XDIST_WORKER"):
        model_infos.start(Path(root), Path(root) / "modelinfos.log")


@pytest.fixture(scope="session", autouse=True)
def _model_classes_inspected():
    """No engine starts before the inspections above have ended."""
    if os.environ.get("VLLM_CACHE_ROOT"):
        model_infos.wait(Path(os.environ["VLLM_CACHE_ROOT"]))


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


@pytest.fixture(scope="module", autouse=True)
def _worker_class_without_earlier_extensions():
    """vLLM adds an engine's worker extension class to the worker class's bases for the rest of
    the process (``v1/worker/worker_base.py`` ~296-316), and a later engine in the same process
    with another extension class fails its conflict check ("already has an attribute
    start_mtp_recording"). Users run one engine per process; the suite's in-process engines of
    one module after another's take the plugin's extensions out first."""
    import sys

    module = sys.modules.get("vllm.v1.worker.cpu_worker")
    if module is not None:
        from vllm_mtp_plugin.recording import RecordingWorkerExtension

        worker = module.CPUWorker
        kept = tuple(base for base in worker.__bases__
                     if not issubclass(base, RecordingWorkerExtension))
        if kept != worker.__bases__:
            worker.__bases__ = kept
    yield


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


def pytest_collection_modifyitems(config, items):
    """Every test under tests/engine/ carries the engine marker, none under tests/unit/ does; the
    whole suite runs its slowest files first (``support/durations.py``)."""
    misplaced = [item.nodeid for item in items
                 if _part(item) == "unit" and item.get_closest_marker("engine") is not None]
    if misplaced:
        raise pytest.UsageError("tests/unit/ holds tests that start no vLLM; move these to "
                                f"tests/engine/: {misplaced}")
    for item in items:
        if _part(item) == "engine":
            item.add_marker(pytest.mark.engine)
    durations.slowest_first(items, durations.load())


def _part(item) -> str:
    """``unit`` or ``engine``: the directory under tests/ the item's file is in."""
    try:
        return Path(item.path).resolve().relative_to(Path(__file__).parent).parts[0]
    except ValueError:
        return ""


# ---------------------------------------------------------------------------------- the engine marker
# ``pytest tests/unit`` runs what starts no vLLM, in under a minute (docs/testing.md); tests/engine/
# what does, every test there marked ``engine`` (``pytest -m "not engine" tests`` runs the same as
# the path). A test without the marker that starts an engine, a server, vLLM's worker set-up or a
# process running vLLM fails, naming what it started, so the quick run cannot quietly grow slow.
ENGINE_MARKER = ("engine: starts vLLM (an offline engine, a server, vLLM's worker set-up in this "
                 "process, or a process that runs vLLM); `pytest -m 'not engine'` leaves it out")


def pytest_configure(config):
    config.addinivalue_line("markers", ENGINE_MARKER)
    durations.register(config)


class EngineNotMarked(RuntimeError):
    """A test outside the ``engine`` marker started vLLM."""


def _refuse(item, what: str):
    def refuse(*args, **kwargs):
        raise EngineNotMarked(f"{item.nodeid} starts vLLM ({what}): it belongs under "
                              "tests/engine/, where every test carries the engine marker")
    return refuse


def _runs_vllm(argv) -> bool:
    words = [str(a) for a in (argv if isinstance(argv, (list, tuple)) else [argv])]
    return any(w.endswith(("vllm", "vllm-mtp")) or "vllm_mtp_plugin.tools" in w
               or "import vllm" in w or "from vllm" in w for w in words)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Outside the marker, every way the suite starts vLLM refuses (module-scoped fixtures too:
    they are set up inside this protocol). Looked up where the callers look them up: the offline
    launcher and ``Server.start`` on their module/class, vLLM's ``LLM`` and distributed set-up on
    vLLM's modules, a process by its command line."""
    if item.get_closest_marker("engine") is not None:
        yield
        return
    import subprocess
    import sys
    from unittest import mock

    from vllm_mtp_plugin.tools.engine import offline, server

    real_popen_init = subprocess.Popen.__init__

    def popen_init(self, args, *rest, **kwargs):
        if _runs_vllm(args):
            _refuse(item, f"a process: {args!r:.120}")()
        return real_popen_init(self, args, *rest, **kwargs)

    patches = [mock.patch.object(offline, "_launcher", _refuse(item, "offline.run_config")),
               mock.patch.object(server.Server, "start", _refuse(item, "a vllm-mtp serve server")),
               mock.patch.object(subprocess.Popen, "__init__", popen_init)]
    if "vllm.entrypoints.llm" in sys.modules:
        patches.append(mock.patch.object(sys.modules["vllm.entrypoints.llm"].LLM, "__init__",
                                         _refuse(item, "vllm.LLM")))
    if "vllm.distributed" in sys.modules:
        patches.append(mock.patch.object(sys.modules["vllm.distributed"],
                                         "init_distributed_environment",
                                         _refuse(item, "vLLM's worker set-up")))
    for patch in patches:
        patch.start()
    try:
        yield
    finally:
        for patch in reversed(patches):
            patch.stop()
