"""One training run, in this process or as each rank of ``torchrun``.

``python -m torch.distributed.run --nproc-per-node N -m vllm_mtp_plugin.tools.train.run JOB``
starts N ranks (gloo on CPU, NCCL on GPUs); without torchrun's environment the run is one
process. Rank 0 writes ``trained-layers.safetensors`` (the layers at the step with the best held-out
loss, in the checkpoint's names ``model.layers.{L+j}.*``) and ``history.json`` into the work
directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from ..mtp_layer.v3_target import open_target
from ..mtp_layer.shard_format import SequenceStore
from ..mtp_layer.trainable import MtpTrainModel
from .trainer import (BEST_LAYERS, TrainSettings, load_state, save_history, train,
                      trained_tensors)

LAYERS_FILE = "trained-layers.safetensors"
HISTORY_FILE = "history.json"


def torchrun(module: str, job_file: Path, nproc: int, **run_kwargs) -> subprocess.CompletedProcess:
    """``module``'s ``__main__`` on ``job_file`` as ``nproc`` ranks of ``torchrun`` (one host)."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={nproc}", "-m", module, str(job_file)],
                          **run_kwargs)


@contextlib.contextmanager
def process_group():
    """torchrun's process group around a run (gloo on CPU, NCCL on GPUs); yields whether there
    is one. A run that ends well has the ranks wait for each other (rank 0 writes the files)
    before the group is destroyed, so no rank shuts its connections while a peer still works (a
    two-rank gloo run aborted once, "terminate called without an active exception"). A run that
    fails destroys it at once: a barrier could wait forever on a rank that failed."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        yield False
        return
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    try:
        yield True
        dist.barrier()
    finally:
        dist.destroy_process_group()


@dataclasses.dataclass
class TrainJob:
    """One training run, as ``vllm-mtp train`` hands it to ``torchrun``'s ranks."""

    target: str  # the target's checkpoint directory
    data_dir: str  # the shards
    work_dir: str  # trainer state, history, the trained layers
    settings: TrainSettings


def run_training(job: TrainJob, progress: bool = True) -> None:
    with process_group() as distributed:
        settings = job.settings
        work = Path(job.work_dir)
        target = open_target(job.target)
        model = MtpTrainModel(target, settings.init, settings.depth, settings.unroll,
                              settings.seed)
        if torch.cuda.is_available():
            model.to(torch.device("cuda", torch.cuda.current_device()))
        history = train(model, SequenceStore(job.data_dir), settings, work, progress)
        tensors = trained_tensors(model)
        if not distributed or torch.distributed.get_rank() == 0:
            from safetensors.torch import save_file

            if (work / BEST_LAYERS).exists():  # the layer with the best held-out loss
                tensors = load_state(work / BEST_LAYERS)
            save_file({name: t.contiguous() for name, t in tensors.items()},
                      str(work / LAYERS_FILE))
            save_history({**history, "init": model.init}, work / HISTORY_FILE)


def trained_layers(work_dir: Path) -> dict[str, torch.Tensor]:
    """The trained layers in the checkpoint's names, ``model.layers.{L + j}.*``."""
    from safetensors.torch import load_file

    return load_file(str(work_dir / LAYERS_FILE))


def history(work_dir: Path) -> dict:
    return json.loads((work_dir / HISTORY_FILE).read_text())


if __name__ == "__main__":
    from ..job_files import read_job

    run_training(read_job(TrainJob, sys.argv[1]))
