"""`vllm-mtp inspect`: a checkpoint's MTP layers from its headers, sorted by the layer description
(``weights/layers.py``) for DeepSeek-V3, V3.2 and V4, and the start-up check's problems.

Expected counts are written out from the tiny builders' shapes (``tools/tiny/v3.py``, ``v4.py``),
not taken from the description under test.
"""

import json
import re

import pytest
import torch
from support.checkpoint_edits import drop, edited_copy

from vllm_mtp_plugin.tools.checkpoint.report import inspect_checkpoint
from vllm_mtp_plugin.tools.inspect_cli import main
from vllm_mtp_plugin.tools.tiny.v4 import build_checkpoint as build_v4


def test_a_good_v3_checkpoint(checkpoints, capsys):
    report = inspect_checkpoint(checkpoints("oracle", num_nextn_predict_layers=2))
    assert report["problems"] == [] and report["format"] == "deepseek_v3 (Hugging Face)"
    assert sorted(report["layers"]) == [2, 3]
    layer = report["layers"][2]
    assert layer["prefix"] == "model.layers.2."
    # 4 own + 2 copies of the target's; block: 2 norms, q_a/q_a_layernorm/q_b, kv_a, kv_a_layernorm,
    # kv_b, o_proj, gate + router bias, 3 shared-expert projections; 4 experts x 3 projections.
    assert layer["kinds"] == {"own": 4, "shared": 2, "block": 14, "expert": 12}
    assert layer["tensors"] == 32 and layer["experts"] == 4 and layer["quantized"] == 0
    assert layer["dtypes"] == {"F32": 32}
    assert layer["optional"] == ["model.layers.2.mlp.gate.e_score_correction_bias"]
    assert layer["unknown"] == []
    assert layer["shared_with_target"] == ["model.layers.2.embed_tokens.weight",
                                           "model.layers.2.shared_head.head.weight"]
    assert layer["shared_bytes"] == 2 * 2048 * 256 * 4
    assert main([str(checkpoints("oracle"))]) == 0
    out = capsys.readouterr().out
    assert "MTP layer 2 (model.layers.2.*): 32 tensors" in out
    assert "OK: usable as an MTP drafter" in out


def test_a_checkpoint_without_mtp_layers_names_its_file(checkpoints, tmp_path, capsys):
    oracle = checkpoints("oracle")
    stripped = edited_copy(oracle, tmp_path / "stripped", tensors=drop("model.layers.2."))
    report = inspect_checkpoint(stripped)
    assert report["layers"][2]["tensors"] == 0
    assert report["problems"] == [
        f"{stripped / 'model.safetensors'} has no tensors for MTP layer 0 (model.layers.2.*, "
        "deepseek_v3 (Hugging Face)), although config.json declares it (num_nextn_predict_layers)."
        " The checkpoint may have been quantized or exported without its MTP layers: use a "
        "checkpoint that keeps them, or serve without --speculative-config."]
    assert main([str(stripped)]) == 1
    assert f"PROBLEM: {stripped / 'model.safetensors'} has no tensors" in capsys.readouterr().out


def test_an_incomplete_v3_layer_and_an_unknown_tensor(checkpoints, tmp_path, capsys):
    oracle = checkpoints("oracle")
    no_hnorm = edited_copy(oracle, tmp_path / "no-hnorm", tensors=lambda t: {
        **drop("hnorm")(t), "model.layers.2.self_attn.o_gate.weight": torch.zeros(4)})
    report = inspect_checkpoint(no_hnorm)
    assert report["problems"] == [
        f"{no_hnorm}: MTP layer 0 (model.layers.2.*) is incomplete: 1 tensor(s) missing: "
        "model.layers.2.hnorm.weight. Re-export the checkpoint with every tensor of its MTP "
        "layers, or serve without --speculative-config."]
    assert report["layers"][2]["unknown"] == ["model.layers.2.self_attn.o_gate.weight"]
    assert main([str(no_hnorm)]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM: " in out and "missing: model.layers.2.hnorm.weight" in out
    assert "not in the layer's description" in out and "self_attn.o_gate.weight" in out


INDEXER = {"index_n_heads": 4, "index_head_dim": 64, "index_topk": 128}


@pytest.fixture(scope="module")
def v32(checkpoints, tmp_path_factory):
    """The tiny V3 checkpoint as DeepSeek-V3.2 stores it: V3's layer plus the attention's indexer
    (vLLM's ``deepseek_v2.Indexer``: wq_b [heads*dim, q_lora], wk [dim, hidden], k_norm weight
    and bias [dim], weights_proj [heads, hidden])."""
    oracle = checkpoints("oracle")
    cfg = json.loads((oracle / "config.json").read_text())
    heads, dim, hidden = INDEXER["index_n_heads"], INDEXER["index_head_dim"], cfg["hidden_size"]
    p = "model.layers.2.self_attn.indexer."
    indexer = {p + "wq_b.weight": torch.zeros(heads * dim, cfg["q_lora_rank"]),
               p + "wk.weight": torch.zeros(dim, hidden), p + "k_norm.weight": torch.ones(dim),
               p + "k_norm.bias": torch.zeros(dim), p + "weights_proj.weight": torch.zeros(heads, hidden)}
    return edited_copy(oracle, tmp_path_factory.mktemp("v32") / "v32",
                       tensors=lambda t: t.update(indexer), model_type="deepseek_v32", **INDEXER)


def test_a_v32_checkpoint_is_v3s_layer_plus_the_indexer(v32, tmp_path):
    report = inspect_checkpoint(v32)
    assert report["problems"] == [] and report["format"] == "deepseek_v32 (Hugging Face)"
    layer = report["layers"][2]
    assert layer["kinds"] == {"own": 4, "shared": 2, "block": 14 + 5, "expert": 12}
    assert layer["tensors"] == 32 + 5 and layer["unknown"] == []
    no_wk = edited_copy(v32, tmp_path / "no-wk", tensors=drop(".indexer.wk."))
    assert inspect_checkpoint(no_wk)["problems"] == [
        f"{no_wk}: MTP layer 0 (model.layers.2.*) is incomplete: 1 tensor(s) missing: "
        "model.layers.2.self_attn.indexer.wk.weight. Re-export the checkpoint with every tensor "
        "of its MTP layers, or serve without --speculative-config."]
    # The same tensors under V3's model_type: the indexer is no part of V3's description.
    as_v3 = edited_copy(v32, tmp_path / "as-v3", model_type="deepseek_v3")
    assert inspect_checkpoint(as_v3)["layers"][2]["unknown"] == sorted(
        f"model.layers.2.self_attn.indexer.{t}" for t in
        ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"))


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return build_v4(tmp_path_factory.mktemp("v4") / "random", "random")


def test_a_good_v4_checkpoint(v4, capsys):
    report = inspect_checkpoint(v4)
    assert report["problems"] == [] and report["format"] == "deepseek_v4 (DeepSeek naming)"
    layer = report["layers"][2]  # mtp.0 of a 2-layer target
    assert layer["prefix"] == "mtp.0."
    # Tiny V4 (FP8 linears with .scale, FP4 experts with .scale): own = enorm, hnorm, norm,
    # e_proj/h_proj (weight + scale), hc_head fn/base/scale; block = attn_sink, q_norm, kv_norm,
    # wq_a/wq_b/wkv/wo_a/wo_b (x2), two norms, gate weight + bias, shared w1/w2/w3 (x2), hc_attn/
    # hc_ffn fn/base/scale; 64 experts x 3 projections x (weight + scale).
    assert layer["kinds"] == {"own": 10, "block": 3 + 10 + 2 + 2 + 6 + 6, "expert": 64 * 6}
    assert layer["experts"] == 64
    assert layer["quantized"] == 2 + 5 + 3 + 64 * 3
    assert layer["optional"] == ["mtp.0.ffn.gate.bias"] and layer["unknown"] == []
    assert main([str(v4)]) == 0
    assert "MTP layer 2 (mtp.0.*)" in capsys.readouterr().out


def test_v4_problems_are_the_start_up_checks(v4, tmp_path):
    dspark = edited_copy(v4, tmp_path / "dspark", tensors=drop("mtp.0.enorm.", "mtp.0.hnorm."))
    (problem,) = inspect_checkpoint(dspark)["problems"]
    assert problem.startswith(f"{dspark}: mtp.0.* has ")
    assert "no enorm/hnorm, so it is not a DeepSeek MTP layer; it looks like a DSpark drafter" in problem
    bare = edited_copy(v4, tmp_path / "bare", tensors=drop("mtp."))
    assert inspect_checkpoint(bare)["problems"][0].startswith(
        f"{bare / 'model.safetensors'} has no tensors for MTP layer 0 (mtp.0.*, deepseek_v4 "
        "(DeepSeek naming))")


def test_an_unknown_model_type_is_refused_naming_config_json(checkpoints, tmp_path):
    other = edited_copy(checkpoints("oracle"), tmp_path / "llama", model_type="llama")
    with pytest.raises(SystemExit, match=re.escape(
            f"{other / 'config.json'}: model_type 'llama'; vllm-mtp inspect knows deepseek_v3, "
            "deepseek_v32, deepseek_v4 checkpoints")):
        inspect_checkpoint(other)
