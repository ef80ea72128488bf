"""``vllm-mtp train`` at world size 2 (torchrun, gloo) against one process: DDP, and FSDP2
``fully_shard`` (the full-size path). The rest of training without an engine:
``tests/unit/train/test_train_pipeline.py``."""

import dataclasses
import json
import os

import pytest
from support.train_fixtures import data, models, settings  # noqa: F401  (fixtures, by name)

from vllm_mtp_plugin.tools.job_files import write_job
from vllm_mtp_plugin.tools.mtp_layer.trainable import MtpTrainModel
from vllm_mtp_plugin.tools.train.run import (LAYERS_FILE, TrainJob, run_training, torchrun,
                                              trained_layers)
from vllm_mtp_plugin.tools.mtp_layer.v3_target import open_target

pytestmark = pytest.mark.engine  # starts a process that runs the package's tools (the engine marker)


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_world_size_two_matches_one_process(models, data, tmp_path, sharding):
    """torchrun with gloo: DDP, and FSDP2 fully_shard (the full-size path)."""
    job = TrainJob(target=str(models[1]), data_dir=str(data), work_dir="",
                   settings=dataclasses.replace(settings(), steps=4, train_only=None,
                                                sharding=sharding))
    one = tmp_path / "one"
    one.mkdir()
    run_training(dataclasses.replace(job, work_dir=str(one)), progress=False)
    two = tmp_path / "two"
    two.mkdir()
    write_job(dataclasses.replace(job, work_dir=str(two)), two / "spec.json")
    done = torchrun("vllm_mtp_plugin.tools.train.run", two / "spec.json", 2, capture_output=True, text=True, timeout=600,
                    env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (two / LAYERS_FILE).exists()
    a, b = trained_layers(one), trained_layers(two)
    initial = MtpTrainModel(open_target(models[1]), "scratch", 1, "chained").checkpoint_tensors()
    moved = max((a[n] - initial[n]).abs().max().item() for n in a)
    differ = max((a[n] - b[n]).abs().max().item() for n in a)
    assert moved > 1e-3  # training changed the layer ...
    assert differ < 1e-5, sorted(((a[n] - b[n]).abs().max().item(), n) for n in a)[-3:]
    # ... the same way in both (stated tolerance: 1e-5 absolute), and the same reported losses
    one_losses = json.loads((one / "history.json").read_text())["loss"]
    two_losses = json.loads((two / "history.json").read_text())["loss"]
    assert max(abs(x[0] - y[0]) for x, y in zip(one_losses, two_losses)) < 1e-4
