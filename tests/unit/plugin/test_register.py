"""The entry point: declared, imported without torch or vLLM, resolved by vLLM's registry, its
patches probed, never raising into vLLM (inside a vLLM process: lazy, idempotent, logged once:
``tests/engine/plugin/test_register_in_vllm.py``)."""

import inspect
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
from support.logs import plugin_log

import vllm_mtp_plugin


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


def test_extra_arguments_reach_vllms_function(monkeypatch):
    """vLLM 0.33 calls ``hf_config_override(hf_config, transformers_mtp_overrides)``, positionally
    and through ``functools.partial(..., transformers_mtp_overrides=...)``."""
    import functools

    from transformers import PretrainedConfig

    from vllm_mtp_plugin.patches import check_mtp_checkpoint

    calls = []

    def vllm_033(hf_config, transformers_mtp_overrides=None):
        calls.append(transformers_mtp_overrides)
        return hf_config

    monkeypatch.setattr(check_mtp_checkpoint, "_vllm_hf_config_override", vllm_033)
    config = PretrainedConfig(num_nextn_predict_layers=1)
    config.model_type = "deepseek_v3"
    assert check_mtp_checkpoint.hf_config_override(config, {"a": 1}) is config
    functools.partial(check_mtp_checkpoint.hf_config_override, transformers_mtp_overrides={"b": 2})(config)
    assert calls == [{"a": 1}, {"b": 2}]
    config.num_nextn_predict_layers = 0
    with pytest.raises(ValueError, match="config.json sets num_nextn_predict_layers to 0"):
        check_mtp_checkpoint.hf_config_override(config, None)
    # The Transformers backend's overrides: vLLM skips its DeepSeek rewrite, and so do the checks.
    assert check_mtp_checkpoint.hf_config_override(config, {"a": 1}) is config
    assert calls[-1] == {"a": 1}
    for model_type in ("deepseek_v32", "glm_moe_dsa", "deepseek_v4"):
        config.model_type = model_type
        with pytest.raises(ValueError, match="config.json sets num_nextn_predict_layers to 0"):
            check_mtp_checkpoint.hf_config_override(config)


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


def test_register_never_raises_into_vllm(monkeypatch):
    from vllm import ModelRegistry

    def broken(*args, **kwargs):
        raise RuntimeError("registry exploded")

    monkeypatch.setattr(ModelRegistry, "register_model", broken)
    with plugin_log() as warned:
        vllm_mtp_plugin.register()
    assert ("vllm-mtp-plugin 0.1.0 not registered (RuntimeError: registry exploded); vLLM's own "
            "MTP classes serve.") in warned
