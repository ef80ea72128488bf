"""``vllm-mtp train --nproc N`` on a DeepSeek-V4 target: each rank of ``torchrun``.

``python -m torch.distributed.run --nproc-per-node N -m vllm_mtp_plugin.tools.train.v4_ranks JOB``
starts N ranks (gloo on CPU, NCCL on GPUs). Each reads the target without its blocks and the
states in ``data_dir`` (recorded while vLLM served, or written by the collection from prompts),
trains ``mtp.0`` with DDP or FSDP2 (``v4_loop.train_ranks``), and rank 0 writes the layer of the best
held-out step (``LAYER_FILE``, transformers' module names) and the history into ``work_dir``;
``vllm-mtp train`` then exports it in the target's format.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from .v4_loop import V4TrainSettings

LAYER_FILE = "trained-v4-layer.safetensors"
HISTORY_FILE = "history.json"


@dataclasses.dataclass
class V4TrainJob:
    """One V4 training run, as ``vllm-mtp train`` hands it to ``torchrun``'s ranks."""

    target: str  # the target's checkpoint directory
    data_dir: str  # shards of states (``shard_format.py``)
    work_dir: str  # the trained layer and its history
    settings: V4TrainSettings
    sharding: str = "ddp"
    progress: bool = True  # rank 0's progress bar


def run_ranks(job: V4TrainJob) -> None:
    from safetensors.torch import save_file

    from .run import process_group
    from .v4_data import open_v4_target, recorded_sequences
    from .v4_loop import train_ranks

    with process_group() as distributed:
        config = json.loads((Path(job.target) / "config.json").read_text())
        sequences = recorded_sequences(Path(job.data_dir), config)
        target, layer, _ = open_v4_target(Path(job.target), job.settings.init, blocks=False,
                                          seed=job.settings.seed)
        if torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
            target.to(device)
            layer.to(device)  # the states stay on the host: each step moves its batch
        history, best = train_ranks(target, layer, sequences, job.settings, job.progress,
                                    job.sharding)
        if not distributed or torch.distributed.get_rank() == 0:
            work = Path(job.work_dir)
            save_file({name: t.contiguous() for name, t in best.items()}, str(work / LAYER_FILE))
            (work / HISTORY_FILE).write_text(json.dumps(history))


def trained_layer(work_dir: Path, target, layer) -> dict:
    """``layer`` (built as the ranks built theirs) with the tensors rank 0 wrote, and the
    history."""
    from safetensors.torch import load_file

    layer.load_state_dict(load_file(str(Path(work_dir) / LAYER_FILE)))
    layer.eval()
    return json.loads((Path(work_dir) / HISTORY_FILE).read_text())


if __name__ == "__main__":
    from ..job_files import read_job
    from ..mtp_layer.v3_target import TrainInputError

    try:
        run_ranks(read_job(V4TrainJob, sys.argv[1]))
    except TrainInputError as exc:  # the data, named, without a traceback per rank
        print(f"vllm-mtp train: {exc}", file=sys.stderr)
        sys.exit(2)
