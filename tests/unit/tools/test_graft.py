"""``vllm-mtp graft``: FP8 layers are copied as stored; every refusal names the checkpoint and the
reason (the grafted checkpoint served: ``tests/engine/tools/test_graft_serves.py``)."""

import json

import pytest
import torch
from safetensors import safe_open
from support.checkpoint_edits import edited_copy

from vllm_mtp_plugin.tools.graft import GraftError, graft
from vllm_mtp_plugin.tools.tiny import trained


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("graft")
    return (trained.write_checkpoint(root / "full", mtp_layers=1),
            trained.write_checkpoint(root / "bare", mtp_layers=0))


def test_refusals_name_the_checkpoint_and_the_fix(pair, tmp_path):
    full, bare = pair
    cases = [
        ((bare, bare), "SOURCE .*declares no MTP layer"),
        ((full, full), r"TARGET .*already has MTP-layer tensors \(42, e.g. model.layers.4."),
        ((full, edited_copy(bare, tmp_path / "wide", hidden_size=512, vocab_size=8192)),
         r"not the same architecture(.|\n)*- hidden_size: SOURCE 256, TARGET 512\n"
         r"- vocab_size: SOURCE 4096, TARGET 8192"),
        ((full, edited_copy(bare, tmp_path / "fp8", quantization_config={
            "quant_method": "fp8", "weight_block_size": [128, 128]})),
         "quantization_config: SOURCE none, TARGET"),
        ((full, edited_copy(bare, tmp_path / "llama", model_type="llama")),
         "model_type 'llama' is not a DeepSeek model with MTP layers"),
        ((full, tmp_path / "nowhere"), "no config.json"),
    ]
    for i, ((source, target), message) in enumerate(cases):
        with pytest.raises(GraftError, match=message):
            graft(source, target, tmp_path / f"out{i}")
        assert not (tmp_path / f"out{i}").exists()  # nothing written on refusal
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    with pytest.raises(GraftError, match="exists and is not empty"):
        graft(full, bare, tmp_path / "used")


def test_a_dropped_layer_that_config_still_declares_is_grafted(pair, tmp_path):
    """A re-export that kept num_nextn_predict_layers = 1 but dropped the tensors."""
    full, bare = pair
    declared = edited_copy(bare, tmp_path / "declared", num_nextn_predict_layers=1)
    graft(full, declared, tmp_path / "out", copy=True)
    assert not (tmp_path / "out" / "model.safetensors").is_symlink()
    assert json.loads((tmp_path / "out" / "config.json").read_text())[
        "num_nextn_predict_layers"] == 1


def test_fp8_layers_are_copied_as_stored(pair, tmp_path):
    """FP8 block-quantized source and target: weights stay float8 with their scales, bit for bit."""
    full, bare = pair
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": [128, 128]}
    fp8 = {}

    def quantize_layer(tensors):
        for name, t in tensors.items():
            if name.startswith("model.layers.4.") and (".mlp.experts." in name
                                                        or name.endswith("o_proj.weight")):
                fp8[name] = t.float().clamp(-448, 448).to(torch.float8_e4m3fn)
                rows, cols = (-(-d // 128) for d in t.shape)
                fp8[name.removesuffix("weight") + "weight_scale_inv"] = torch.rand(rows, cols)
        tensors.update(fp8)

    source = edited_copy(full, tmp_path / "src8", tensors=quantize_layer, quantization_config=quant)
    target = edited_copy(bare, tmp_path / "dst8", quantization_config=quant)
    graft(source, target, tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "mtp-00001-of-00001.safetensors"), "pt") as f:
        assert set(fp8) <= set(f.keys())
        for name, t in fp8.items():
            stored = f.get_tensor(name)
            assert stored.dtype == t.dtype, name
            assert torch.equal(stored.view(torch.uint8), t.view(torch.uint8)), name
        assert f.get_tensor("model.layers.4.enorm.weight").dtype == torch.bfloat16  # as stored


@pytest.fixture(scope="module")
def v4_pairs(tmp_path_factory):
    """Tiny V4-Flash-format checkpoints (FP8 linears, FP4 experts, UE8M0 scales) with and without
    their MTP layer, a bf16 one without, and a DSpark drafter stored under ``mtp.``."""
    from vllm_mtp_plugin.tools.tiny.v4 import build_checkpoint

    root = tmp_path_factory.mktemp("graft-v4")
    return {
        "flash": build_checkpoint(root / "flash", "noisy"),
        "flash-bare": build_checkpoint(root / "flash-bare", "noisy", without_mtp=True),
        "bf16-bare": build_checkpoint(root / "bf16-bare", "noisy", quantization=None,
                                      without_mtp=True),
        "bf16": build_checkpoint(root / "bf16", "noisy", quantization=None),
        "dspark": build_checkpoint(root / "dspark", "random", dspark=True),
    }


def test_v4_flash_layer_is_copied_as_stored(v4_pairs, tmp_path):
    """FP8 weights, packed FP4 experts, UE8M0 and float32 scales, float32 mixers: bit for bit."""
    summary = graft(v4_pairs["flash"], v4_pairs["flash-bare"], tmp_path / "out")
    with safe_open(str(v4_pairs["flash"] / "model.safetensors"), "pt") as f:
        source = {n: f.get_tensor(n) for n in f.keys() if n.startswith("mtp.0.")}
    assert summary["tensors"] == len(source)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert {n for n in index["weight_map"] if n.startswith("mtp.")} == set(source)
    with safe_open(str(tmp_path / "out" / "mtp-00001-of-00001.safetensors"), "pt") as f:
        for name, tensor in source.items():
            stored = f.get_tensor(name)
            assert stored.dtype == tensor.dtype, name
            assert torch.equal(stored.view(torch.uint8), tensor.view(torch.uint8)), name
    kinds = {t.dtype for t in source.values()}
    assert {torch.float8_e4m3fn, torch.int8, torch.float8_e8m0fnu, torch.float32} <= kinds
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["model_type"] == "deepseek_v4"


def test_v4_bf16_graft_keeps_the_float32_tensors(v4_pairs, tmp_path):
    graft(v4_pairs["bf16"], v4_pairs["bf16-bare"], tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "mtp-00001-of-00001.safetensors"), "pt") as f:
        assert f.get_tensor("mtp.0.hc_head_fn").dtype == torch.float32
        assert f.get_tensor("mtp.0.hc_attn_fn").dtype == torch.float32
        assert f.get_tensor("mtp.0.attn.attn_sink").dtype == torch.float32
        assert f.get_tensor("mtp.0.e_proj.weight").dtype == torch.bfloat16


def test_v4_refusals(v4_pairs, pair, tmp_path):
    cases = [
        ((v4_pairs["bf16"], v4_pairs["flash-bare"]), "quantization_config: SOURCE none, TARGET"),
        ((v4_pairs["flash"], v4_pairs["bf16-bare"]), "quantization_config: SOURCE .*fp8"),
        ((v4_pairs["dspark"], v4_pairs["flash-bare"]), r'DSpark drafter.*"method": "dspark"'),
        ((v4_pairs["flash"], pair[1]), "model_type: SOURCE 'deepseek_v4', TARGET 'deepseek_v3'"),
        ((v4_pairs["flash"], v4_pairs["flash"]), r"TARGET .*already has MTP-layer tensors"),
    ]
    for i, ((source, target), message) in enumerate(cases):
        with pytest.raises(GraftError, match=message):
            graft(source, target, tmp_path / f"out{i}")
        assert not (tmp_path / f"out{i}").exists()


def test_a_v3_config_transformers_saved_takes_the_original_layer(pair, tmp_path):
    """transformers writes ``head_dim`` into a DeepSeek-V3 config it saves; the original has none
    (V4's fields are compared for V4 checkpoints only)."""
    full, bare = pair
    saved = edited_copy(bare, tmp_path / "saved", head_dim=64)
    graft(full, saved, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["head_dim"] == 64
