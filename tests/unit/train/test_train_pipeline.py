"""``vllm-mtp train`` without an engine: refusals, export (bf16 and FP8), resume, the memory plan
of a full-size DeepSeek-V3 layer on the meta device (world size 2:
``tests/engine/train/test_train_world_size.py``).

Training data here is written directly in the collector's shard format from the trained tiny
model's own forward (transformers, ``support/train_fixtures.py``), so these tests need no vLLM
engine; ``test_train_data.py`` checks that format against the served drafter.
"""

import dataclasses
import json
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from support.checkpoint_edits import edited_copy
from support import paths
from support.train_fixtures import data, models, settings  # noqa: F401  (fixtures, by name)

from vllm_mtp_plugin.tools.train import cli
from vllm_mtp_plugin.tools.checkpoint.quantize import dequantize_fp8_blocks, quantize_fp8_blocks
from vllm_mtp_plugin.tools.mtp_layer.v3_target import TrainInputError, open_target
from vllm_mtp_plugin.tools.mtp_layer.drafter_inputs import load_training_prompts
from vllm_mtp_plugin.tools.mtp_layer.shard_format import SequenceStore
from vllm_mtp_plugin.tools.train.export import LAYER_SHARD, export
from vllm_mtp_plugin.tools.mtp_layer.transformers_layer import to_checkpoint_tensors, to_module_state
from vllm_mtp_plugin.tools.train.memory import memory_plan
from vllm_mtp_plugin.tools.mtp_layer.trainable import MtpTrainModel
from vllm_mtp_plugin.tools.train.trainer import train
from vllm_mtp_plugin.weights.preflight import mtp_problems


def test_refusals_name_the_input_and_the_fix(models, tmp_path, capsys):
    full, bare = models
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert cli.main([str(bare), "--out", str(tmp_path / "o"), "--prompts", str(empty)]) == 2
    assert f"--prompts {empty}: no prompts in the file" in capsys.readouterr().out
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama",
                                                   "architectures": ["LlamaForCausalLM"]}))
    assert cli.main([str(other), "--out", str(tmp_path / "o")]) == 2
    assert "'llama' is not a DeepSeek-V3-layout model" in capsys.readouterr().out
    assert cli.main([str(bare), "--out", str(tmp_path / "o"), "--init", "checkpoint"]) == 2
    out = capsys.readouterr().out
    assert "--init checkpoint: " in out and "has no MTP layer" in out
    with pytest.raises(TrainInputError, match="no MTP layer"):
        MtpTrainModel(open_target(bare), "checkpoint", 1, "chained")
    assert cli.main([str(bare), "--out", str(tmp_path / "o"), "--train-only", "eh_proj,heads"]) == 2
    assert "--train-only heads: unknown group" in capsys.readouterr().out


def test_a_mismatched_init_layer_is_refused_by_name(models, tmp_path):
    full, _ = models
    def halve_eh_proj(tensors):
        name = "model.layers.4.eh_proj.weight"
        tensors[name] = tensors[name][:, :256].clone()

    broken = edited_copy(full, tmp_path / "broken", tensors=halve_eh_proj)
    with pytest.raises(TrainInputError) as err:
        MtpTrainModel(open_target(broken), "checkpoint", 1, "chained")
    assert "eh_proj.weight: checkpoint (256, 256), layer (256, 512)" in str(err.value)
    assert str(broken) in str(err.value)


def test_help_explains_every_choice(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for phrase in ("refresh TARGET's own MTP layer", "last-layer", "recursive", "chained",
                   "KL divergence", "--train-only", "--nproc", "fsdp", "--temperature"):
        assert phrase in text, phrase


def test_prompt_formats(tmp_path):
    plain = tmp_path / "p.txt"
    plain.write_text("first prompt\n\nsecond prompt\n")
    assert load_training_prompts(plain) == ["first prompt", "second prompt"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a"}\n{"messages": [{"role": "user", "content": "b"}]}\n'
                     '{"kind": "chat", "prompt": "c"}\n')
    assert load_training_prompts(jsonl) == ["a", [{"role": "user", "content": "b"}],
                                            [{"role": "user", "content": "c"}]]
    sharegpt = tmp_path / "s.json"
    sharegpt.write_text(json.dumps([{"conversations": [{"from": "human", "value": "d"},
                                                       {"from": "gpt", "value": "e"}]}]))
    assert load_training_prompts(sharegpt) == [[{"role": "user", "content": "d"}]]


def test_layer_names_round_trip(models):
    target = open_target(models[0])
    stored = target.layer(4)
    back = to_checkpoint_tensors(to_module_state(stored, 8))
    assert set(back) == set(stored) - {"embed_tokens.weight", "shared_head.head.weight"}
    for name, tensor in back.items():
        assert torch.equal(tensor, stored[name]), name


def test_a_layer_trained_from_an_export_exports_again(models, tmp_path):
    """A refresh of a refreshed layer (``--adapt`` trains each round from the layer that serves):
    the first export's report is not carried into the second, whose own goes there."""
    full, _ = models
    model = MtpTrainModel(open_target(full), "checkpoint", 1, "chained")
    layer = model.checkpoint_tensors()
    export(open_target(full), layer, tmp_path / "first")
    (tmp_path / "first" / "training").mkdir()
    (tmp_path / "first" / "training" / "training.json").write_text("{}")
    eh_proj = "model.layers.4.eh_proj.weight"
    layer[eh_proj] = layer[eh_proj] * 1.5
    export(open_target(tmp_path / "first"), layer, tmp_path / "second")
    second = tmp_path / "second"
    assert not (second / "training").exists()
    assert not mtp_problems(second, json.loads((second / "config.json").read_text()))
    with safe_open(str(second / LAYER_SHARD), "pt") as f:
        assert torch.equal(f.get_tensor(eh_proj), layer[eh_proj].to(torch.bfloat16))


def test_export_serves_the_trained_layer_beside_the_targets_files(models, data, tmp_path):
    full, _ = models
    target = open_target(full)
    model = MtpTrainModel(target, "checkpoint", 1, "chained")
    layer = model.checkpoint_tensors()
    eh_proj = "model.layers.4.eh_proj.weight"
    layer[eh_proj] = layer[eh_proj] * 1.5  # a changed layer
    summary = export(target, layer, tmp_path / "out")
    out = tmp_path / "out"
    assert summary["rewritten"] == ["model.safetensors"]  # the old layer shared the file
    assert not mtp_problems(out, json.loads((out / "config.json").read_text()))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert not [n for n in f.keys() if n.startswith("model.layers.4.")]
    with safe_open(str(out / LAYER_SHARD), "pt") as f:
        stored = f.get_tensor(eh_proj)
        assert stored.dtype == torch.bfloat16
        assert torch.equal(stored, layer[eh_proj].to(torch.bfloat16))
        assert "model.layers.4.shared_head.head.weight" in f.keys()  # vLLM's own class loads it


def test_fp8_target_round_trip(models, tmp_path, capsys):
    """A block-FP8 tiny target: its layer is read dequantized and exported as FP8 again, with
    eh_proj and norms unquantized, as DeepSeek ships them."""
    full, _ = models
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": [128, 128]}
    def quantize(tensors):
        for name in list(tensors):
            if name.startswith("model.layers.") and name.endswith("proj.weight") and \
                    "eh_proj" not in name and ".mlp.gate." not in name:
                weight, scale = quantize_fp8_blocks(tensors[name].float(), (128, 128))
                tensors[name], tensors[name + "_scale_inv"] = weight, scale

    fp8_dir = edited_copy(full, tmp_path / "fp8", tensors=quantize, quantization_config=quant)
    target = open_target(fp8_dir)
    assert target.fp8_block == (128, 128)
    layer = MtpTrainModel(target, "checkpoint", 1, "chained").checkpoint_tensors()
    original = load_file(str(full / "model.safetensors"))
    expert = "mlp.experts.3.up_proj.weight"
    assert (layer["model.layers.4." + expert]
            - original["model.layers.4." + expert].float()).abs().max() < 0.02
    export(target, layer, tmp_path / "out")
    with safe_open(str(tmp_path / "out" / LAYER_SHARD), "pt") as f:
        weight = f.get_tensor("model.layers.4." + expert)
        scale = f.get_tensor("model.layers.4." + expert + "_scale_inv")
        assert weight.dtype == torch.float8_e4m3fn and tuple(scale.shape) == (1, 2)
        assert f.get_tensor("model.layers.4.eh_proj.weight").dtype == torch.bfloat16
        assert f.get_tensor("model.layers.4.enorm.weight").dtype == torch.bfloat16
        back = dequantize_fp8_blocks(weight, scale, (128, 128))
        trained = layer["model.layers.4." + expert]
        assert (back - trained).abs().max() <= 0.07 * trained.abs().max()
    from vllm_mtp_plugin.tools.inspect_cli import main as inspect_main

    assert inspect_main([str(tmp_path / "out")]) == 0
    described = capsys.readouterr().out
    # Every linear the target stores as FP8 is FP8 again in the export (30 in the tiny layer).
    with safe_open(str(fp8_dir / "model.safetensors"), "pt") as f:
        quantized = sum(n.startswith("model.layers.4.") and n.endswith("_scale_inv")
                        for n in f.keys())
    assert "MTP layer 4 (model.layers.4.*): " in described
    assert f"{quantized} linears quantized" in described and "PROBLEM" not in described
    assert "OK: usable as an MTP drafter" in described


def test_resume_continues_where_it_stopped(models, data, tmp_path, monkeypatch):
    target = open_target(models[1])
    store = SequenceStore(data)
    whole = MtpTrainModel(target, "scratch", 1, "chained")
    (tmp_path / "whole").mkdir()
    train(whole, store, settings(), tmp_path / "whole", progress=False)
    (tmp_path / "cut").mkdir()
    stopped = MtpTrainModel(target, "scratch", 1, "chained")
    calls = {"n": 0}
    real_step = torch.optim.AdamW.step

    def step_then_stop(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 4:  # after the checkpoint at step 2 and another step
            raise KeyboardInterrupt
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", step_then_stop)
    with pytest.raises(KeyboardInterrupt):
        train(stopped, store, settings(), tmp_path / "cut", progress=False)
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    resumed = MtpTrainModel(target, "scratch", 1, "chained")
    history = train(resumed, store, settings(), tmp_path / "cut", progress=False)
    assert history["step"] == list(range(6))
    for (name, a), b in zip(whole.layers.state_dict().items(),
                            resumed.layers.state_dict().values()):
        assert torch.equal(a, b), name


def test_train_finishes_without_matplotlib(models, data, tmp_path, monkeypatch, capsys):
    """vLLM's requirements bring no matplotlib: train exports, writes training.json and says
    which pictures it left out."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    out = tmp_path / "out"
    assert cli.main([str(models[0]), "--data", str(data), "--out", str(out), "--steps", "4",
                     "--batch-size", "4", "--quiet"]) == 0
    assert json.loads((out / "training" / "training.json").read_text())["settings"]["steps"] == 4
    assert not list((out / "training").glob("*.png"))
    assert "not drawn: matplotlib is not installed (pip install matplotlib" in capsys.readouterr().err


def test_too_little_data_is_a_refusal_not_a_traceback(models, data, tmp_path, capsys):
    assert cli.main([str(models[0]), "--data", str(data), "--out", str(tmp_path / "out"),
                     "--steps", "4", "--batch-size", "64", "--quiet"]) == 2
    out = capsys.readouterr().out
    assert "training sequences, fewer than one batch (64)" in out and "vllm-mtp train: " in out
    assert "--batch-size" in out and "Traceback" not in out


class _RunsCode:
    """A pickled object whose load would run code (writes a file)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_trainer_state_that_would_run_code_is_refused(models, data, tmp_path):
    """Resuming reads the work directory's state as data only: a file that holds a pickled
    object (anyone with write access to the directory could plant one) is refused by name, and
    the object is never built."""
    marker = tmp_path / "code-ran"
    work = tmp_path / "work"
    work.mkdir()
    torch.save({"settings": {}, "hostile": _RunsCode(marker)}, work / "trainer-state.pt")
    model = MtpTrainModel(open_target(models[1]), "scratch", 1, "chained")
    with pytest.raises(ValueError, match="trainer-state.pt: not a state this trainer wrote"):
        train(model, SequenceStore(data), settings(), work, progress=False)
    assert not marker.exists()


def test_memory_plan_of_a_full_size_deepseek_v3_layer():
    config = json.loads((paths.DATA / "deepseek_v3_config.json").read_text())
    plan = memory_plan(config, gpus=8, sharding="fsdp")
    assert 11.5e9 < plan.parameters < 11.8e9  # 256 experts x 3 x 7168 x 2048 and the rest
    assert plan.total_per_gpu < 80 * 2**30  # fits an 80 GB GPU with FSDP2 over 8
    assert memory_plan(config, gpus=8, sharding="ddp").total_per_gpu > 141 * 2**30  # DDP does not
    subset = memory_plan(config, gpus=8, train_only=["eh_proj", "norms", "attention", "router",
                                                      "shared_expert"])
    assert subset.trained_parameters < 0.4e9 and subset.total_per_gpu < plan.total_per_gpu


def test_memory_plan_command(tmp_path, capsys):
    target = tmp_path / "v3"
    target.mkdir()
    (target / "config.json").write_text(
        (paths.DATA / "deepseek_v3_config.json").read_text())
    save_file({"model.embed_tokens.weight": torch.zeros(1)}, str(target / "model.safetensors"))
    assert cli.main([str(target), "--memory-plan", "--nproc", "8", "--sharding", "fsdp"]) == 0
    text = capsys.readouterr().out
    assert "8 GPU(s), fsdp" in text and "MTP layer: 11.61 B parameters" in text


def test_two_chained_layers_export(models, tmp_path):
    """``--depth 2`` with chained layers: every layer carries its own copy of the embedding and
    head in the layer shard (safetensors refuses tensors that share memory)."""
    full, _ = models
    target = open_target(full)
    layers = MtpTrainModel(target, "auto", 2, "chained").checkpoint_tensors()
    export(target, layers, tmp_path / "out")
    out = tmp_path / "out"
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 2
    assert not mtp_problems(out, config)
    with safe_open(str(out / LAYER_SHARD), "pt") as f:
        for index in (4, 5):
            assert torch.equal(f.get_tensor(f"model.layers.{index}.shared_head.head.weight"),
                               target.tensor("lm_head.weight"))
