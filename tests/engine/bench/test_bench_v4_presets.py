"""The benchmark's DeepSeek-V4 presets: parsing, the checkpoint they build, how they are run."""

import pytest

from vllm_mtp_plugin.tools.tiny import presets
from vllm_mtp_plugin.tools.bench.offline_mode import offline_config
from vllm_mtp_plugin.tools.bench.serve_mode import serve_args, server_env
from vllm_mtp_plugin.tools.bench.sweep import Sweep
from vllm_mtp_plugin.tools.engine.eager_reasons import eager_serve_args
from vllm_mtp_plugin.tools.engine.mrv2 import SWITCH, needs_interpreter

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)


def test_v4_preset_specs():
    assert presets.parse_preset("v4tiny:noisy:0.8") == ("v4tiny", "noisy", 0.8)
    assert presets.parse_preset("v4tiny:oracle") == ("v4tiny", "oracle", 0.7)
    assert presets.parse_preset("v4tiny") == ("v4tiny", "noisy", 0.7)
    for bad, says in (("v4huge", "v4tiny"), ("v4tiny:perfect", "'perfect'"),
                      ("v4tiny:noisy:1.5", "0..1")):
        with pytest.raises(ValueError, match=says):
            presets.parse_preset(bad)


def test_a_v4_preset_builds_a_bf16_v4_checkpoint_run_with_the_plugin_on_v2(tmp_path):
    ckpt = presets.resolve("v4tiny:noisy:0.8", tmp_path, log=lambda line: None)
    assert ckpt.label == "v4tiny-noisy-0.8" and ckpt.variant == "v4"
    assert ckpt.meta["mode"] == "noisy" and ckpt.meta["quantization"] is None
    assert abs(ckpt.meta["expected_acceptance"] - 0.8) < 0.01 and ckpt.parameters > 0
    assert presets.resolve(str(ckpt.path)).variant == "v4"  # a directory: from config.json
    assert ckpt.engine == {"dtype": "bfloat16", "runner": "v2", "impls": ("plugin", "adaptive"),
                           "eager": True}

    # the bench CLI keeps, of the implementations asked for (plugin, in-tree), those allowed
    sweep = Sweep(checkpoints=["v4tiny:noisy:0.8", "tiny"], ks=[0, 2],
                  impls_for={"v4tiny:noisy:0.8": ("plugin",)})
    assert [(c.checkpoint, c.impl, c.k) for c in sweep.configs()] == [
        ("v4tiny:noisy:0.8", "plugin", 0), ("v4tiny:noisy:0.8", "plugin", 2),
        ("tiny", "plugin", 0), ("tiny", "plugin", 2), ("tiny", "in-tree", 0), ("tiny", "in-tree", 2)]
    offline = offline_config(sweep, ckpt, sweep.configs()[1], sweep.passes({"all": ["Hello"]}))
    assert (offline.runner, offline.llm_kwargs["dtype"], offline.impl) == ("v2", "bfloat16", "plugin")
    assert offline.llm_kwargs["enforce_eager"] and offline.passes[0]["prompts"] == ["Hello"]
    assert sweep.compilation_for(ckpt) == "eager"  # rows say how the V4 engine really ran
    args = serve_args(sweep, 2, ckpt.engine["dtype"], ckpt.engine["eager"])
    assert args[args.index("--dtype") + 1] == "bfloat16" and eager_serve_args("interpreted-v4")[0] in args
    env = server_env("plugin", ckpt.engine["runner"])
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert (env.get(SWITCH) == "1") == needs_interpreter()
    assert "VLLM_USE_V2_MODEL_RUNNER" not in server_env("plugin")  # V3 presets: vLLM's choice
