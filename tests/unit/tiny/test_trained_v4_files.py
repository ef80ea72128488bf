"""The trained tiny DeepSeek-V4's files (``tools/tiny/trained_v4.py``): what training holds in
transformers' modules is what the DeepSeek-named checkpoint gives back, in bf16 and V4-Flash
format, with or without the MTP layer; ``build-tiny --variant v4`` writes them."""

import json

import pytest
import torch
from safetensors.torch import load_file

from vllm_mtp_plugin.tools.mtp_layer import transformers_v4_layer as reference
from vllm_mtp_plugin.tools.tiny import build, trained_v4
from vllm_mtp_plugin.tools.tiny.tokenizer import write_tokenizer

pytest.importorskip("transformers.models.deepseek_v4")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    model = trained_v4.TargetWithV4Mtp(trained_v4.config_json()).eval()
    with torch.no_grad():  # what the balancer leaves: a bias per expert, to be written as gate.bias
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_()
    return model


@pytest.fixture(scope="module")
def files(model, tmp_path_factory):
    out = trained_v4.save_checkpoint(model, tmp_path_factory.mktemp("v4") / "trained")
    write_tokenizer(out, trained_v4.ARCH.vocab_size)
    (out / "training.json").write_text(json.dumps({"parameters": 1}))
    (out / "loss.png").write_bytes(b"png")
    return out


def test_checkpoint_reads_back_into_transformers_modules_tensor_for_tensor(model, files):
    target, layer = reference.load_reference(files, 0, torch.float32)
    for ours, theirs, what in ((model.target.state_dict(), target.state_dict(), "target"),
                               (model.mtp.state_dict(), layer.state_dict(), "mtp layer")):
        assert set(ours) == set(theirs), what
        for name, value in theirs.items():
            exact, bf16 = ours[name].float(), ours[name].to(torch.bfloat16).float()
            assert torch.equal(value.float(), exact) or torch.equal(value.float(), bf16), (what, name)
    stored = load_file(str(files / "model.safetensors"))
    assert stored["layers.0.ffn.gate.bias"].abs().sum() > 0  # the balancer's bias is kept
    assert stored["mtp.0.hc_head_fn"].dtype == torch.float32  # mixers stay float32, as DeepSeek's
    assert stored["mtp.0.e_proj.weight"].dtype == torch.bfloat16


def test_logits_are_the_targets_and_the_mtp_layers(model):
    ids = torch.randint(2, trained_v4.ARCH.vocab_size, (2, 12))
    with torch.no_grad():
        main, drafted = model.logits(ids)
        direct = model.target(input_ids=ids, use_cache=False).logits
    assert main.shape == (2, 11, trained_v4.ARCH.vocab_size)
    assert drafted.shape == (2, 10, trained_v4.ARCH.vocab_size)
    assert torch.equal(main, direct[:, :-1])


def test_written_checkpoints_bf16_fp8_and_without_the_layer(files, tmp_path):
    bf16 = trained_v4.write_checkpoint(tmp_path / "bf16", source=files)
    assert load_file(str(bf16 / "model.safetensors")).keys() == \
        load_file(str(files / "model.safetensors")).keys()
    flash = trained_v4.write_checkpoint(tmp_path / "fp8", quantization="fp8", source=files)
    tensors = load_file(str(flash / "model.safetensors"))
    assert tensors["mtp.0.e_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["mtp.0.e_proj.scale"].dtype == torch.float8_e8m0fnu
    assert tensors["layers.0.ffn.experts.0.w1.weight"].dtype == torch.int8  # FP4, two a byte
    config = json.loads((flash / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    bare = trained_v4.write_checkpoint(tmp_path / "bare", mtp_layers=0, source=files)
    assert not [k for k in load_file(str(bare / "model.safetensors")) if k.startswith("mtp.")]
    assert json.loads((bare / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert (bare / "tokenizer.json").exists() and (bare / "training.json").exists()


def test_write_checkpoint_errors(files, tmp_path):
    with pytest.raises(ValueError, match="one MTP layer"):
        trained_v4.write_checkpoint(tmp_path / "x", mtp_layers=2, source=files)
    with pytest.raises(ValueError, match="V4-Flash"):
        trained_v4.write_checkpoint(tmp_path / "x", quantization="int4", source=files)
    with pytest.raises(FileNotFoundError, match="--variant v4 --mode trained --rebuild"):
        trained_v4.write_checkpoint(tmp_path / "x", source=tmp_path)


def test_build_tiny_variant_v4_constructed_and_its_errors(tmp_path, capsys):
    assert build.main([str(tmp_path / "noisy"), "--variant", "v4", "--mode", "noisy"]) == 0
    config = json.loads((tmp_path / "noisy" / "config.json").read_text())
    assert config["model_type"] == "deepseek_v4" and "quantization_config" not in config
    with pytest.raises(SystemExit):
        build.main([str(tmp_path / "v3"), "--quantization", "fp8"])
    assert "--variant v4 only" in capsys.readouterr().err
