"""The V4 MTP layer outside vLLM (``tools/mtp_layer/transformers_v4_layer.py``) on tiny V4
checkpoints built for a known first-position acceptance: the oracle layer drafts the target's own
greedy token, the noisy one at the rate it was built for, and a swapped ``enorm``/``hnorm`` or the
target's ``hc_head`` in place of the layer's changes the drafts."""

import json

import pytest
import torch

from vllm_mtp_plugin.tools.mtp_layer import transformers_v4_layer as v4
from vllm_mtp_plugin.tools.tiny.v4 import build_checkpoint

pytest.importorskip("transformers.models.deepseek_v4")


@pytest.fixture(autouse=True)
def vllms_config_registered(monkeypatch):
    """Once vLLM has read a V4 config in a process, ``AutoConfig`` maps ``deepseek_v4`` to vLLM's
    own config class (``transformers_utils/config.py`` ``_register_config_class``), which
    transformers' modeling does not take: the reference must not go through ``AutoConfig``."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from vllm.transformers_utils.configs.deepseek_v4 import DeepseekV4Config

    monkeypatch.setitem(CONFIG_MAPPING._extra_content, "deepseek_v4", DeepseekV4Config)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_v4")
    return {mode: build_checkpoint(root / mode, mode, seed=0, quantization=None)
            for mode in ("oracle", "noisy", "random")}


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(1)
    return torch.randint(2, 2048, (8, 64), generator=generator)


def rate(target, layer, prompts):
    accepted, drafted = v4.greedy_first_position(target, layer, prompts)
    assert drafted == 8 * 62
    return accepted / drafted


def test_the_oracle_layer_drafts_the_targets_greedy_token(checkpoints, prompts):
    target, layer = v4.load_reference(checkpoints["oracle"])
    assert rate(target, layer, prompts) == 1.0


def test_the_noisy_layer_drafts_at_the_rate_it_was_built_for(checkpoints, prompts):
    expected = json.loads((checkpoints["noisy"] / "tiny_meta.json").read_text())[
        "expected_acceptance"]
    target, layer = v4.load_reference(checkpoints["noisy"])
    measured = rate(target, layer, prompts)
    sigma = (expected * (1 - expected) / (8 * 62)) ** 0.5
    assert abs(measured - expected) < 3 * sigma, (measured, expected)
    # the tiny checkpoint's norms and hc_head are random, not 1 / 0: wiring them wrong shows
    enorm, hnorm = layer.enorm.weight.data.clone(), layer.hnorm.weight.data.clone()
    layer.enorm.weight.data, layer.hnorm.weight.data = hnorm, enorm
    assert rate(target, layer, prompts) < measured - 6 * sigma


def test_the_layers_own_hc_head_counts(checkpoints, prompts):
    """On the oracle and noisy checkpoints the streams stay near one another, so a norm after any
    mix of them drafts alike; on the random one they part: the target's ``hc_head`` in place of
    the layer's changes drafts."""
    target, layer = v4.load_reference(checkpoints["random"])
    with torch.no_grad(), v4.residual_before_hc_head(target) as caught:
        target(prompts, use_cache=False)
    with torch.no_grad():
        own = v4.layer_logits(target, layer, caught["hidden"], prompts).argmax(-1)
        layer.hc_head.load_state_dict(target.model.hc_head.state_dict())
        wrong = v4.layer_logits(target, layer, caught["hidden"], prompts).argmax(-1)
    assert own.shape == (8, 63) and int((own != wrong).sum()) >= 5


def test_bf16_runs_with_float32_mixers(checkpoints, prompts):
    target, layer = v4.load_reference(checkpoints["oracle"], dtype=torch.bfloat16)
    assert layer.e_proj.weight.dtype == torch.bfloat16
    assert layer.hc_head.hc_fn.dtype == torch.float32
    assert rate(target, layer, prompts[:, :]) > 0.95


def test_names_and_errors(checkpoints, tmp_path):
    config = v4.block_config(checkpoints["oracle"], 2)
    assert len(config.layer_types) == 3 and config.mlp_layer_types[2] == "moe"
    no_mtp = build_checkpoint(tmp_path / "no_mtp", "random", quantization=None, without_mtp=True)
    with pytest.raises(ValueError, match=r"no mtp\.0\.\* tensors"):
        v4.load_reference(no_mtp)
    fp8 = build_checkpoint(tmp_path / "fp8", "random")
    with pytest.raises(ValueError, match="a quantized V4 checkpoint"):
        v4.load_reference(fp8)
    with pytest.raises(KeyError, match=r"ffn\.experts\.0\.w1\.weight"):
        v4.to_module_state({}, 2, 4)
