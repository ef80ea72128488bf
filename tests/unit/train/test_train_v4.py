"""``vllm-mtp train`` on DeepSeek-V4 targets (``tools/train/v4.py``): the layer's export is the
checkpoint's own tensors when nothing was trained, a short run writes a servable checkpoint with its
record, and what V4 does not take yet is refused by name. That a trained layer is accepted as
often as a jointly trained one, served by vLLM, is ``benchmarks/train_proofs.py v4``'s."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from support import paths

from vllm_mtp_plugin.tools.mtp_layer import transformers_v4_layer as reference
from vllm_mtp_plugin.tools.tiny.v4 import build_checkpoint, encode
from vllm_mtp_plugin.tools.mtp_layer.shard_format import write_shard
from vllm_mtp_plugin.tools.train import cli, v4, v4_data, v4_loop
from vllm_mtp_plugin.tools.train.memory import v4_memory_plan

pytest.importorskip("transformers.models.deepseek_v4")


@pytest.fixture(scope="module")
def noisy(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("v4") / "noisy", "noisy", quantization=None)


def test_an_untrained_layer_exports_the_checkpoints_own_tensors(noisy):
    config = json.loads((noisy / "config.json").read_text())
    _, layer = reference.load_reference(noisy, 0, torch.float32)
    exported = encode(reference.layer_tensors(layer, config), None, config["expert_dtype"])
    stored = {k: v for k, v in load_file(str(noisy / "model.safetensors")).items()
              if k.startswith("mtp.0.")}
    assert set(exported) == set(stored)
    for name, tensor in stored.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name], tensor), name


def test_a_short_run_writes_a_servable_checkpoint(noisy, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"prompt number {i} reads\n" for i in range(12)))
    out = tmp_path / "out"
    code = cli.main([str(noisy), "--out", str(out), "--prompts", str(prompts), "--steps", "3",
                     "--samples-per-prompt", "1", "--max-new-tokens", "8", "--batch-size", "4",
                     "--init", "scratch", "--quiet"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "init scratch" in printed and "held-out agreement" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["model_type"] == "deepseek_v4"
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    layer_names = {n for n, shard in index.items() if shard == "mtp-00001-of-00001.safetensors"}
    assert layer_names == {n for n in index if n.startswith("mtp.")} and layer_names
    old = load_file(str(noisy / "model.safetensors"))
    new = load_file(str(out / "mtp-00001-of-00001.safetensors"))
    assert not torch.equal(new["mtp.0.e_proj.weight"], old["mtp.0.e_proj.weight"])  # trained
    assert new["mtp.0.hc_head_fn"].dtype == torch.float32
    record = json.loads((out / "training" / "training.json").read_text())
    assert record["variant"] == "v4" and record["history"]["sequences"] == {"train": 11,
                                                                            "held_out": 1}
    target, layer = reference.load_reference(out, 0, torch.float32)  # read back as served
    assert layer.e_proj.weight.shape == (256, 256)


def test_what_v4_does_not_take_yet_is_refused_by_name(noisy, tmp_path, capsys):
    fp8 = build_checkpoint(tmp_path / "fp8", "noisy")
    bare = build_checkpoint(tmp_path / "bare", "noisy", quantization=None, without_mtp=True)
    headless = build_checkpoint(tmp_path / "headless", "noisy", quantization=None)
    tensors = load_file(str(headless / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "head.weight"},
              str(headless / "model.safetensors"))
    target, _ = reference.load_reference(noisy, 0, torch.float32)
    data = _recorded(tmp_path / "data", target, [torch.arange(2, 20)] * 4)
    cases = [
        ([str(noisy), "--train-only", "router"], "--train-only: not available for DeepSeek-V4"),
        ([str(noisy), "--depth", "2"], "--depth 2: not available for DeepSeek-V4"),
        ([str(noisy), "--init", "last-layer"], "--init last-layer: not available"),
        ([str(noisy), "--data", str(data), "--nproc", "3", "--batch-size", "4"],
         "--batch-size 4 is not a multiple of --nproc 3"),
        ([str(fp8)], "a quantized DeepSeek-V4 checkpoint; collecting from prompts"),
        ([str(bare), "--init", "checkpoint"], "has no mtp.0.* tensors"),
        ([str(headless), "--data", str(data)], "the target's lm_head.weight not found in its "
                                               "*.safetensors"),
    ]
    for i, (argv, message) in enumerate(cases):
        assert cli.main([*argv, "--out", str(tmp_path / f"out{i}"), "--quiet"]) == 2
        assert message in capsys.readouterr().out


def test_memory_plan_of_a_full_size_deepseek_v4_flash_layer(tmp_path, capsys):
    """V4-Flash's config (tests/data) on the meta device: the layer as the V4 trainer builds it,
    and the target its trainer runs, counted; FSDP2 over 8 fits an 80 GB GPU, DDP does not."""

    config = json.loads((paths.DATA / "deepseek_v4_config.json").read_text())
    plan = v4_memory_plan(config, gpus=8, sharding="fsdp")
    # 256 experts x 3 x 4096 x 2048 = 6.44 B, attention 0.10 B, e_proj + h_proj 0.03 B, ...
    assert 6.55e9 < plan.parameters < 6.65e9 and plan.trained_parameters == plan.parameters
    assert plan.total_per_gpu < 80 * 2**30
    assert v4_memory_plan(config, gpus=8, sharding="ddp").total_per_gpu > 80 * 2**30
    assert "284.33 B parameters" in plan.notes[0]  # DeepSeek's V4-Flash: 284 B
    assert "32768 bytes per token" in plan.notes[1]  # hc_mult 4 x 4096 x bf16
    target = tmp_path / "v4-flash"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(config))
    assert cli.main([str(target), "--memory-plan", "--nproc", "8", "--sharding", "fsdp"]) == 0
    text = capsys.readouterr().out
    assert "8 GPU(s), fsdp" in text and "MTP layer: 6.61 B parameters" in text
    assert cli.main([str(target), "--memory-plan", "--train-only", "router"]) == 2
    assert "a DeepSeek-V4 layer is trained whole" in capsys.readouterr().out
    short = dict(config, compress_ratios=config["compress_ratios"][:43])  # none for the MTP block
    (target / "config.json").write_text(json.dumps(short))
    assert cli.main([str(target), "--memory-plan"]) == 2
    assert (f"{target}/config.json: compress_ratios has 43 entries, none for the MTP block at "
            "layer 43") in capsys.readouterr().out
    (target / "config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                    if k != "vocab_size"}))
    assert cli.main([str(target), "--memory-plan"]) == 2
    assert "config.json: no 'vocab_size' field" in capsys.readouterr().out


def _recorded(directory, target, sequences, states=None):
    """Shards as a recording writes them (tokens T + 1, states T, flattened streams)."""
    states = states or [s for _, s in v4_data.target_states(target, sequences)]
    directory.mkdir()
    write_shard(directory / "shard-00000.safetensors", [ids[:-1].tolist() for ids in sequences],
                [int(ids[-1]) for ids in sequences], [s[:-1].flatten(1) for s in states],
                [4] * len(sequences), {})
    return directory


def test_the_targets_distribution_from_its_states_is_its_forwards(noisy):
    """Training reads the target's states, never runs its blocks: its head on state i+1 must be
    the distribution its own forward gives for token i+2, or KL trains toward something else."""
    target, layer = reference.load_reference(noisy, 0, torch.float32)
    ids = torch.randint(0, 2048, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), reference.residual_before_hc_head(target) as caught:
        logits = target(ids, use_cache=False).logits.float()
    assert torch.allclose(reference.target_logits(target, caught["hidden"]), logits, atol=1e-5)
    states = [s for _, s in v4_data.target_states(target, list(ids))]
    assert states[0].shape == (20, 4, 256) and states[0].dtype == torch.bfloat16
    loss, agreement = v4_loop.batch_loss(target, layer, ids, torch.stack(states), "kl")
    assert loss.item() > 0 and 0 <= agreement.item() <= 1


def test_training_from_recorded_shards(noisy, tmp_path, capsys):
    """``--data DIR``: the states a recording stores (width hc_mult x hidden) read back exactly,
    a short run from them writes a servable layer, the target read without its blocks; shards of
    another model, or --prompts beside --data, refused by name."""
    target, _ = reference.load_reference(noisy, 0, torch.float32)
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, 2048, (n,), generator=generator) for n in [24, 30] * 6]
    collected = v4_data.target_states(target, sequences)
    data = _recorded(tmp_path / "data", target, sequences, [s for _, s in collected])
    config = json.loads((noisy / "config.json").read_text())
    read = v4_data.recorded_sequences(data, config)
    assert len(read) == 12
    for (ids, states), (want_ids, want_states) in zip(read, collected):
        assert torch.equal(ids, want_ids) and torch.equal(states, want_states[:-1])
    out = tmp_path / "out"
    code = cli.main([str(noisy), "--data", str(data), "--out", str(out), "--steps", "3",
                     "--batch-size", "4", "--quiet"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "recorded data: 12 sequences, 324 tokens" in printed and "init checkpoint" in printed
    record = json.loads((out / "training" / "training.json").read_text())
    assert record["data"] == str(data) and record["sequences"] == 12
    reference.load_reference(out, 0, torch.float32)  # read back as served
    no_blocks = reference.load_target(noisy, blocks=False)
    assert len(no_blocks.model.layers) == 0 and no_blocks.config.num_hidden_layers == 2
    narrow = tmp_path / "narrow"
    narrow.mkdir()
    write_shard(narrow / "shard-00000.safetensors", [[1, 2, 3]], [4], [torch.zeros(3, 256)],
                [1], {})
    cases = [([str(noisy), "--data", str(narrow)], "states of width 256 (shard-00000"
              ".safetensors); this DeepSeek-V4 target's drafter reads 1024 (hc_mult 4 x "
              "hidden_size 256)"),
             ([str(noisy), "--data", str(data), "--prompts", str(data)],
              "--data DIR trains on recorded shards; --prompts is for collecting")]
    for i, (argv, message) in enumerate(cases):
        assert cli.main([*argv, "--out", str(tmp_path / f"refused{i}"), "--quiet"]) == 2
        assert message in capsys.readouterr().out


def test_a_quantized_target_trains_from_recorded_states_and_keeps_its_format(noisy, tmp_path,
                                                                            capsys):
    """V4-Flash's format (FP8 linears, FP4 experts, UE8M0 scales): the layer is read dequantized
    and written back as the target stores it: untrained, its own values in its own dtypes; after a
    short run from --data, every tensor in its stored dtype, the start-up check passed."""
    fp8 = build_checkpoint(tmp_path / "fp8", "noisy")
    config = json.loads((fp8 / "config.json").read_text())
    stored = {k: v for k, v in load_file(str(fp8 / "model.safetensors")).items()
              if k.startswith("mtp.0.")}
    ends, layer, _ = v4_data.open_v4_target(fp8, "auto", blocks=False)
    v4.export(fp8, layer, config, tmp_path / "untrained")
    again = load_file(str(tmp_path / "untrained" / v4.LAYER_SHARD))
    assert {n: t.dtype for n, t in again.items()} == {n: t.dtype for n, t in stored.items()}
    # the same values (a block whose largest code rounded to half the range may take the scale
    # below it: 224 x 2^-6 is stored again as 448 x 2^-7)
    _, twin = reference.load_reference(noisy, 0, torch.float32)  # the same weights in bf16
    for name, bound in (("e_proj.weight", 0.05), ("block.mlp.experts.gate_up_proj", 0.2)):
        error = layer.state_dict()[name] - twin.state_dict()[name]  # FP8 ~2 %, FP4 ~12 %
        assert error.norm() / twin.state_dict()[name].norm() < bound, name
    read_back = reference.load_layer(tmp_path / "untrained", ends.config).state_dict()
    for name, tensor in layer.state_dict().items():
        assert torch.equal(read_back[name], tensor), name
    target, _ = reference.load_reference(noisy, 0, torch.float32)
    generator = torch.Generator().manual_seed(2)
    data = _recorded(tmp_path / "data", target,
                     [torch.randint(0, 2048, (20,), generator=generator) for _ in range(12)])
    out = tmp_path / "out"
    code = cli.main([str(fp8), "--data", str(data), "--out", str(out), "--steps", "3",
                     "--batch-size", "4", "--quiet"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    trained = load_file(str(out / v4.LAYER_SHARD))
    assert {n: t.dtype for n, t in trained.items()} == {n: t.dtype for n, t in stored.items()}
    assert not torch.equal(trained["mtp.0.e_proj.weight"].view(torch.uint8),
                           stored["mtp.0.e_proj.weight"].view(torch.uint8))  # trained
    assert json.loads((out / "config.json").read_text())["quantization_config"] == \
        config["quantization_config"]
    assert cli.main([str(fp8), "--out", str(tmp_path / "prompts"), "--quiet"]) == 2
    assert "train with --data DIR" in capsys.readouterr().out
