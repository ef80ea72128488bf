"""The training loop: AdamW, warm-up + cosine, DeepSeek's expert balancing, checkpoints, resume.

Multi-process with ``torch.distributed`` DDP (``torchrun``; gloo on CPU, NCCL on GPUs): every step
draws one global batch from a seeded generator shared by all ranks, rank r takes every
world-th sequence, and each rank's summed loss is divided by the global count of positions, so
DDP's gradient average equals the one-process gradient of the whole batch (up to summation
order). ``sharding="fsdp"`` shards each MTP layer with FSDP2's ``fully_shard`` instead, for a
full-size layer (``memory.py``). Rank 0 writes checkpoints, history and plots.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import torch

from ..mtp_layer.shard_format import SequenceStore
from ..mtp_layer.trainable import MtpTrainModel
from ..mtp_layer.optim import ExpertLoadBalancer, OptimizerSettings, learning_rate
from ..mtp_layer.v3_target import TrainInputError

CHECKPOINT = "trainer-state.pt"
BEST_LAYERS = "best-layers.pt"


@dataclasses.dataclass
class TrainSettings(OptimizerSettings):
    """``vllm-mtp train``'s run (``OptimizerSettings`` with its defaults, plus what it adds)."""

    steps: int | None = None  # None: ``epochs`` passes over the training sequences
    epochs: float = 6.0
    depth: int = 1
    unroll: str = "chained"
    step_weight: float = 0.6  # depth s weighs step_weight ** s (FastMTP's beta)
    # KL to the target's distribution: served, its layer accepts more than a CE-trained one
    # greedily at T = 0 and with probabilistic drafts at T = 1 (docs/training.md, (e)).
    loss: str = "kl"
    init: str = "auto"
    train_only: tuple[str, ...] | None = None
    max_len: int | None = None  # positions per sequence used (None: all)
    held_out_fraction: float = 0.05
    checkpoint_every: int = 100
    sharding: str = "ddp"


def _dist():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist, dist.get_rank(), dist.get_world_size()
    return None, 0, 1


def split(store_size: int, fraction: float) -> tuple[list[int], list[int]]:
    """Held-out sequences: every round(1 / fraction)-th one (deterministic)."""
    every = max(2, round(1 / fraction)) if fraction > 0 else store_size + 1
    held = [i for i in range(store_size) if i % every == every - 1]
    return [i for i in range(store_size) if i % every != every - 1], held


def total_steps(s: TrainSettings, train_sequences: int) -> int:
    return s.steps if s.steps is not None else max(1, math.ceil(
        s.epochs * train_sequences / s.batch_size))


@torch.no_grad()
def evaluate(model: MtpTrainModel, store: SequenceStore, indices: list[int], settings,
             batch: int = 8) -> dict:
    """Held-out loss and greedy agreement per depth."""
    sums = [[0.0, 0, 0] for _ in range(model.depth)]
    for i in range(0, len(indices), batch):
        tokens, hidden, lengths = (t.to(model.target.lm_head.weight.device)
                                   for t in store.batch(indices[i:i + batch], settings.max_len))
        for s, row in enumerate(model.objective(tokens, hidden, lengths, settings.loss)):
            sums[s][0] += row["loss"].item()
            sums[s][1] += int(row["correct"])
            sums[s][2] += int(row["count"])
    return {"loss": [a / max(c, 1) for a, _, c in sums],
            "accuracy": [b / max(c, 1) for _, b, c in sums]}


class Balancer(ExpertLoadBalancer):
    """DeepSeek's bias balancing on the expert loads of all ranks (the same update everywhere),
    counting real tokens only: right padding differs between one process and several."""

    def __init__(self, model: MtpTrainModel, speed: float):
        super().__init__(model.layers, speed)
        self.model = model

    def _count(self, router, args, output) -> None:
        mask = self.model.input_mask
        if mask is not None and mask.numel() == output[-1].shape[0]:
            output = (*output[:-1], output[-1][mask.reshape(-1)])
        super()._count(router, args, output)

    def step(self) -> None:
        dist, _, _ = _dist()
        if dist is not None:
            for load in self.loads.values():
                dist.all_reduce(load)
        super().step()


def _wrap(model: MtpTrainModel, sharding: str):
    """What the step calls: the model, DDP around it, or the model with FSDP2-sharded layers."""
    dist, _, world = _dist()
    if world == 1:
        return model
    if sharding == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # On GPUs the gathered weights are bf16 (fp32 master shards and gradient reduction).
        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                  if torch.cuda.is_available() else MixedPrecisionPolicy())
        for layer in model.layers:
            fully_shard(layer, mp_policy=policy)
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def full_state(model: MtpTrainModel, optimizer) -> tuple[dict, dict]:
    """Unsharded layer and optimizer state on rank 0 (torch's distributed state-dict API, which
    gathers FSDP2 shards and passes plain modules through); all ranks must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model.layers, optimizer,
                          options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def trained_tensors(model: MtpTrainModel) -> dict[str, torch.Tensor]:
    """The layers' unsharded tensors in the checkpoint's names, ``model.layers.{L + j}.*``
    (complete on rank 0); all ranks must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return model.checkpoint_tensors(get_model_state_dict(
        model.layers, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))


def load_state(path: Path):
    """A file this trainer wrote (its state, the best layers), read as data only: tensors,
    numbers, strings, lists and dicts (``torch.load(weights_only=True)``). Anything else in it
    (a pickled object, which could run code on load) is refused with what to do."""
    import pickle

    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TrainInputError(f"{path}: not a state this trainer wrote (read as data only, it "
                              f"holds something else: {first[:200]}); remove it to train from "
                              "the start, and check who else writes to this work directory."
                              ) from None


def _restore(model: MtpTrainModel, optimizer, saved: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model.layers, optimizer, model_state_dict=saved["layers"],
                   optim_state_dict=saved["optimizer"],
                   options=StateDictOptions(full_state_dict=True))


def train(model: MtpTrainModel, store: SequenceStore, settings: TrainSettings, work_dir: Path,
          progress: bool = True) -> dict:
    """Train in place; returns the history. Resumes from ``work_dir/trainer-state.pt``."""
    from tqdm import tqdm

    dist, rank, world = _dist()
    device = next(model.layers.parameters()).device
    torch.set_flush_denormal(True)
    torch.manual_seed(settings.seed)
    trainable = model.freeze_except(list(settings.train_only) if settings.train_only else None)
    wrapped = _wrap(model, settings.sharding)
    params = [p for p in model.layers.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=settings.weight_decay)
    balancer = Balancer(model, settings.bias_update_speed)
    train_ids, held_ids = split(len(store), settings.held_out_fraction)
    if len(train_ids) < settings.batch_size:
        raise TrainInputError(f"{len(train_ids)} training sequences, fewer than one batch "
                              f"({settings.batch_size}); collect more (more prompts or "
                              "--samples-per-prompt, more recorded traffic) or give a smaller "
                              "--batch-size.")
    history = {"step": [], "loss": [], "evaluations": [], "trainable_parameters": trainable,
               "train_sequences": len(train_ids), "held_out_sequences": len(held_ids)}
    start = 0
    state_path = work_dir / CHECKPOINT
    if state_path.exists():
        saved = load_state(state_path)
        if saved["settings"] != dataclasses.asdict(settings):
            raise TrainInputError(f"{state_path} was written with other settings; remove it or "
                                  "train with the same options.")
        _restore(model, optimizer, saved)
        history, start = saved["history"], saved["step"]
    gen = torch.Generator().manual_seed(settings.seed)
    for _ in range(start):  # the same batches as an uninterrupted run
        torch.randint(len(train_ids), (settings.batch_size,), generator=gen)
    started = time.monotonic()
    steps = total_steps(settings, len(train_ids))
    history["steps"] = steps
    bar = tqdm(range(start, steps), desc="training MTP", unit="step",
               disable=not progress or rank != 0, initial=start, total=steps)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, settings, steps)
        picks = torch.randint(len(train_ids), (settings.batch_size,), generator=gen).tolist()
        mine = [train_ids[i] for i in picks[rank::world]]
        tokens, hidden, lengths = (t.to(device) for t in store.batch(mine, settings.max_len))
        rows = wrapped(tokens, hidden, lengths, settings.loss)
        counts = torch.stack([r["count"] for r in rows]).float()
        if dist is not None:
            dist.all_reduce(counts)
        weights = [settings.step_weight ** s for s in range(len(rows))]
        loss = sum(w * r["loss"] / counts[s].clamp(min=1) for s, (w, r)
                   in enumerate(zip(weights, rows))) * world / sum(weights)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        balancer.step()
        sums = torch.stack([r["loss"].detach() for r in rows])
        if dist is not None:
            dist.all_reduce(sums)  # the whole batch's loss, as one process reports it
        per_depth = (sums / counts.clamp(min=1)).tolist()
        history["step"].append(step)
        history["loss"].append(per_depth)
        bar.set_postfix(loss=" ".join(f"{v:.2f}" for v in per_depth))
        last = step + 1 == steps
        if held_ids and ((step + 1) % settings.eval_every == 0 or last):
            row = {"step": step + 1, **evaluate(model, store, held_ids, settings)}
            history["evaluations"].append(row)
            balancer.loads.clear()
            score = sum(w * v for w, v in zip(weights, row["loss"]))
            if history.get("best") is None or score < history["best"]["score"]:
                # The layer to export: the best held-out loss, not the last step (a small data
                # set is over-fitted within a few passes).
                history["best"] = {**row, "score": score}
                best = trained_tensors(model)
                if rank == 0:
                    torch.save(best, work_dir / BEST_LAYERS)
        if (step + 1) % settings.checkpoint_every == 0 or last:
            layers, optim = full_state(model, optimizer)
            if rank == 0:
                tmp = state_path.with_suffix(".partial")
                torch.save({"settings": dataclasses.asdict(settings), "step": step + 1,
                            "layers": layers, "optimizer": optim, "history": history}, tmp)
                tmp.rename(state_path)
    del wrapped
    history["seconds"] = history.get("seconds", 0) + time.monotonic() - started
    return history


def plot(history: dict, loss_path: Path, accuracy_path: Path) -> None:
    """Training loss per depth, and held-out agreement with the target per depth, as PNGs."""
    from ..plotting import pyplot

    plt = pyplot(f"{loss_path} and {accuracy_path}")
    if plt is None:
        return

    fig_loss, left = plt.subplots(figsize=(6, 4))
    fig_acc, right = plt.subplots(figsize=(6, 4))
    losses = list(zip(*history["loss"])) if history["loss"] else []
    for s, series in enumerate(losses):
        k = max(1, len(series) // 50)
        smooth = [sum(series[i:i + k]) / len(series[i:i + k]) for i in range(0, len(series), k)]
        left.plot(history["step"][::k][:len(smooth)], smooth, label=f"depth {s + 1}")
    left.set(xlabel="step", ylabel="training loss", title="loss")
    left.legend()
    evals = history["evaluations"]
    for s in range(len(evals[0]["accuracy"]) if evals else 0):
        right.plot([e["step"] for e in evals], [e["accuracy"][s] for e in evals], marker="o",
                   label=f"depth {s + 1}")
    right.set(xlabel="step", ylabel="held-out agreement with the target's greedy token",
              title="accuracy per depth", ylim=(0, 1))
    right.legend()
    for fig, path in ((fig_loss, loss_path), (fig_acc, accuracy_path)):
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


def save_history(history: dict, path: Path) -> None:
    path.write_text(json.dumps(history))
