"""Broken checkpoints fail with one clear message naming the file, tensor and remedy: before the
engine starts where the headers show it (``weights/preflight.py``), else when the drafter loads."""

import pytest
from support.checkpoint_edits import drop, edited_copy

from vllm_mtp_plugin.tools.engine.offline import OfflineConfig, run_config

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)


def load_error(model) -> str:
    with pytest.raises(RuntimeError) as info:
        run_config(OfflineConfig(str(model), 1, "plugin", ["Hello"], 4))
    return str(info.value)


def test_checkpoint_without_its_mtp_layer(checkpoints, tmp_path):
    model = edited_copy(checkpoints("oracle"), tmp_path / "no-mtp", tensors=drop("model.layers.2."))
    message = load_error(model)
    assert f"{model}/model.safetensors has no tensors for MTP layer 0 (model.layers.2.*" in message
    assert "quantized or exported without its MTP layers" in message


def test_tensor_of_the_wrong_shape(checkpoints, tmp_path):
    def shrink(t):
        t["model.layers.2.eh_proj.weight"] = t["model.layers.2.eh_proj.weight"][:, :256].clone()
        return t

    model = edited_copy(checkpoints("oracle"), tmp_path / "bad-shape", tensors=shrink)
    message = load_error(model)
    assert (f"{model}/model.safetensors: tensor 'model.layers.2.eh_proj.weight' has shape "
            "[256, 256], but config.json (hidden_size 256) needs [256, 512]") in message


def test_a_tensor_the_layer_does_not_have_is_caught_by_the_loader(checkpoints, tmp_path):
    """The start-up check looks for what is missing; the loader names what does not belong.
    (An extra ``.bias`` is skipped instead, as vLLM's own loaders skip GPTQ's.)"""
    def add_unknown(t):
        t["model.layers.2.self_attn.o_gate.weight"] = t["model.layers.2.enorm.weight"].clone()
        return t

    model = edited_copy(checkpoints("oracle"), tmp_path / "unknown-tensor", tensors=add_unknown)
    message = load_error(model)
    assert (f"CheckpointError: {model}/model.safetensors: tensor "
            "'model.layers.2.self_attn.o_gate.weight' (shape [256]) maps to parameter "
            "'model.layers.2.mtp_block.self_attn.o_gate.weight', which the deepseek_v3 (Hugging "
            "Face) MTP layer does not have") in message


def test_missing_enorm(checkpoints, tmp_path):
    model = edited_copy(checkpoints("oracle"), tmp_path / "no-enorm", tensors=drop("enorm"))
    message = load_error(model)
    assert "MTP layer 0 (model.layers.2.*) is incomplete: 1 tensor(s) missing: " \
           "model.layers.2.enorm.weight" in message


def test_config_without_mtp_layers(checkpoints, tmp_path):
    model = edited_copy(checkpoints("oracle"), tmp_path / "no-nextn", num_nextn_predict_layers=0)
    message = load_error(model)
    assert "config.json sets num_nextn_predict_layers to 0, so the checkpoint has no MTP layer" in message


def test_a_block_tensor_of_the_wrong_shape_is_refused_at_load(checkpoints, tmp_path):
    """The start-up check reads only the MTP layer's own shapes; the loader checks the block's."""
    def shrink(t):
        t["model.layers.2.self_attn.o_proj.weight"] = \
            t["model.layers.2.self_attn.o_proj.weight"][:, :64].clone()
        return t

    model = edited_copy(checkpoints("oracle"), tmp_path / "bad-block-shape", tensors=shrink)
    message = load_error(model)
    assert (f"CheckpointError: {model}/model.safetensors: tensor "
            "'model.layers.2.self_attn.o_proj.weight' has shape [256, 64], but parameter "
            "'model.layers.2.mtp_block.self_attn.o_proj.weight' expects [256, 128]") in message
