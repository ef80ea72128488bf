"""``vllm-mtp train --nproc 2`` on a DeepSeek-V4 target (torchrun, gloo) against one process:
DDP, and FSDP2 ``fully_shard`` (the full-size path, ``train/memory.py``'s plan). The rest of V4
training: ``tests/unit/train/test_train_v4.py``."""

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from vllm_mtp_plugin.tools.job_files import write_job
from vllm_mtp_plugin.tools.mtp_layer import transformers_v4_layer as reference
from vllm_mtp_plugin.tools.tiny.v4 import build_checkpoint
from vllm_mtp_plugin.tools.train import cli
from vllm_mtp_plugin.tools.train.run import torchrun
from vllm_mtp_plugin.tools.train.v4 import write_states
from vllm_mtp_plugin.tools.train.v4_data import open_v4_target, recorded_sequences, target_states
from vllm_mtp_plugin.tools.train.v4_loop import V4TrainSettings, train_layer
from vllm_mtp_plugin.tools.train.v4_ranks import LAYER_FILE, V4TrainJob

pytest.importorskip("transformers.models.deepseek_v4")
pytestmark = pytest.mark.engine  # starts processes that run the package's tools

SETTINGS = V4TrainSettings(steps=3, batch_size=4, learning_rate=3e-3, init="checkpoint")


@pytest.fixture(scope="module")
def noisy_with_data(tmp_path_factory):
    """The noisy tiny V4 and shards of its own states on 20 random sequences."""
    root = tmp_path_factory.mktemp("v4ranks")
    model = build_checkpoint(root / "noisy", "noisy", quantization=None)
    target, _ = reference.load_reference(model, 0, torch.float32)
    generator = torch.Generator().manual_seed(3)
    sequences = target_states(target, [torch.randint(0, 2048, (20,), generator=generator)
                                       for _ in range(20)])
    return model, write_states(sequences, [4] * len(sequences), root / "data")


def _torchrun(job: V4TrainJob, work):
    work.mkdir()
    write_job(job, work / "job.json")
    done = torchrun("vllm_mtp_plugin.tools.train.v4_ranks", work / "job.json", 2, capture_output=True, text=True, timeout=600,
                    env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return load_file(str(work / LAYER_FILE)), json.loads((work / "history.json").read_text())


@pytest.mark.parametrize("sharding, init", [("ddp", "checkpoint"), ("fsdp", "scratch")])
def test_two_ranks_train_the_layer_one_process_trains(noisy_with_data, tmp_path, sharding, init):
    """A new layer (``scratch``) is drawn from the seed: FSDP2 does not broadcast rank 0's
    weights, each rank shards the layer it drew itself."""
    model, data = noisy_with_data
    config = json.loads((model / "config.json").read_text())
    settings = dataclasses.replace(SETTINGS, init=init)
    target, layer, _ = open_v4_target(model, init, blocks=False, seed=settings.seed)
    initial = {k: v.clone() for k, v in layer.state_dict().items()}
    one = train_layer(target, layer, recorded_sequences(data, config), settings, progress=False)
    job = V4TrainJob(target=str(model), data_dir=str(data), work_dir=str(tmp_path / "two"),
                     settings=settings, sharding=sharding, progress=False)
    two, history = _torchrun(job, tmp_path / "two")
    trained = layer.state_dict()
    assert set(two) == set(trained)
    moved = max((trained[n] - initial[n]).abs().max().item() for n in trained)
    assert moved > 1e-3  # training changed the layer ...
    # ... the same way in both: the same reported losses (stated tolerance 1e-4), and the same
    # weights up to summation order. AdamW moves every element by about the learning rate
    # whatever its gradient's size, so an element whose gradient is within rounding of zero
    # (experts few tokens reach) may move either way: under 1 % of the elements may differ by
    # more than 1e-5. Ranks that do not average their gradients differ in most elements, and
    # in their losses from the second step on.
    assert max(abs(a - b) for a, b in zip(one["loss"], history["loss"])) < 1e-4
    differing = sum(int(((trained[n] - two[n]).abs() > 1e-5).sum()) for n in trained)
    assert differing < 0.01 * sum(t.numel() for t in trained.values()), differing
    assert (history["processes"], history["sharding"]) == (2, sharding)


def test_the_command_with_two_processes_writes_a_servable_checkpoint(noisy_with_data, tmp_path,
                                                                     capsys):
    model, data = noisy_with_data
    out = tmp_path / "out"
    code = cli.main([str(model), "--data", str(data), "--out", str(out), "--steps", "2",
                     "--batch-size", "4", "--nproc", "2", "--sharding", "fsdp",
                     "--work-dir", str(tmp_path / "work"), "--quiet"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "2 processes (fsdp)" in printed
    record = json.loads((out / "training" / "training.json").read_text())
    assert record["history"]["processes"] == 2
    _, served = reference.load_reference(out, 0, torch.float32)  # read back as vLLM loads it
    written = load_file(str(tmp_path / "work" / LAYER_FILE))
    assert torch.equal(served.e_proj.weight, written["e_proj.weight"].to(torch.bfloat16).float())


def test_ranks_that_reject_their_input_exit_with_the_reason(noisy_with_data, tmp_path):
    """The ranks refuse a batch they cannot share (5 sequences on 2 ranks): they leave the
    process group (``run.process_group``) and exit with the reason, without a traceback."""
    model, data = noisy_with_data
    settings = dataclasses.replace(SETTINGS, batch_size=5)
    job = V4TrainJob(target=str(model), data_dir=str(data), work_dir=str(tmp_path / "work"),
                     settings=settings, sharding="ddp", progress=False)
    (tmp_path / "work").mkdir()
    write_job(job, tmp_path / "work" / "job.json")
    done = torchrun("vllm_mtp_plugin.tools.train.v4_ranks", tmp_path / "work" / "job.json", 2,
                    capture_output=True, text=True, timeout=300,
                    env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0
    assert "vllm-mtp train: --batch-size 5 is not a multiple of --nproc 2" in done.stderr, \
        done.stderr[-3000:]
    assert "TrainInputError" not in done.stderr  # a rank's traceback would name it
    assert not (tmp_path / "work" / LAYER_FILE).exists()
