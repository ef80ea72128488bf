"""The training loop of ``vllm-mtp train`` on DeepSeek-V4 targets (``v4.py``): the layer's loss on
the target's states, batches, AdamW with warm-up and cosine, the best held-out step kept; in one
process, or as one rank of ``torchrun`` with DDP or FSDP2 (``v4_ranks.py``)."""

from __future__ import annotations

import dataclasses
import math
import random
import time

import torch
import torch.nn.functional as F

from ..mtp_layer import transformers_v4_layer as reference
from ..mtp_layer.v3_target import TrainInputError

HELD_OUT_EVERY = 10  # every 10th sequence is held out
# A sequence's token ids [L] and the target's states at them [L or L-1, hc_mult, H]
Sequence = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass
class V4TrainSettings:
    steps: int | None = None  # default: ``epochs`` passes over the training sequences
    epochs: float = 3.0
    batch_size: int = 8
    learning_rate: float = 1e-3
    loss: str = "kl"
    init: str = "auto"  # auto: the checkpoint's layer if it has one, else scratch
    temperature: float = 1.0
    samples_per_prompt: int = 4
    max_new_tokens: int = 64
    seed: int = 0


def batch_loss(target, layer, ids: torch.Tensor, hidden: torch.Tensor, loss: str,
               drafting=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, top-1 agreement with the target's greedy token i+2) on ``ids`` ``[B, L]`` with the
    target's states ``hidden`` ``[B, >= L-1, hc_mult, H]``: the drafter at position i reads
    state i and token i+1; the target's distribution of token i+2 is its head on state i+1 (what
    its own forward computes from that state). ``drafting``: the module that computes the
    layer's logits (``LayerLogits``, or DDP around it); a new ``LayerLogits`` by default."""
    hidden = hidden.float()
    with torch.no_grad():
        teacher = reference.target_logits(target, hidden[:, 1:ids.shape[1] - 1])
    batch, length = ids.shape
    positions = torch.arange(length - 2, device=ids.device).expand(batch, -1)
    logits = (drafting or LayerLogits(target, layer))(hidden[:, :length - 2], ids[:, 1:-1],
                                                       positions).float()
    if loss == "kl":
        value = F.kl_div(F.log_softmax(logits, -1).flatten(0, 1),
                         F.log_softmax(teacher, -1).flatten(0, 1), log_target=True,
                         reduction="batchmean")
    else:
        value = F.cross_entropy(logits.flatten(0, 1), ids[:, 2:].flatten())
    agreement = (logits.argmax(-1) == teacher.argmax(-1)).float().mean()
    return value, agreement


class LayerLogits(torch.nn.Module):
    """The layer's logits from the target's states and the next tokens, in one forward: DDP must
    see every parameter the loss uses inside the forward it wraps (``hc_head`` and ``norm``
    included). The frozen target is held outside the module's parameters."""

    def __init__(self, target, layer):
        super().__init__()
        self.layer = layer
        self._target = (target,)

    def forward(self, hidden: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor
                ) -> torch.Tensor:
        target = self._target[0]
        streams = reference.layer_streams(target, self.layer, hidden, next_tokens, positions)
        return reference.streams_logits(target, self.layer, streams)


def batches(sequences: list[Sequence], size: int, rng: random.Random):
    """Shuffled batches of equal length (each sequence and its states cut to the batch's
    shortest): ``(ids [B, L], hidden [B, L-1, hc_mult, H])``."""
    order = list(range(len(sequences)))
    while True:
        rng.shuffle(order)
        for start in range(0, len(order) - size + 1, size):
            chosen = [sequences[i] for i in order[start:start + size]]
            length = min(len(ids) for ids, _ in chosen)
            yield (torch.stack([ids[:length] for ids, _ in chosen]),
                   torch.stack([states[:length - 1] for _, states in chosen]))


def train_layer(target, layer, sequences: list[Sequence], settings: V4TrainSettings,
                progress: bool = True) -> dict:
    """Train ``layer`` in place in this process (the best held-out step's weights at the end);
    returns the history."""
    history, best = train_ranks(target, layer, sequences, settings, progress)
    layer.load_state_dict(best)
    layer.eval()
    return history


def train_ranks(target, layer, sequences: list[Sequence], settings: V4TrainSettings,
                progress: bool = True, sharding: str = "ddp") -> tuple[dict, dict]:
    """The training loop, in one process or as one rank of ``torchrun`` (``v4_ranks.py``):
    (history, the best held-out step's layer tensors, whole on rank 0 and empty elsewhere).

    Every rank draws the same global batch from the seeded generator and takes every world-th
    sequence of it; with equal shares the mean of the ranks' mean losses is the whole batch's,
    so DDP's gradient average (or FSDP2's reduce-scatter, ``--sharding fsdp``) is the
    one-process gradient up to summation order."""
    from tqdm import tqdm

    from ..mtp_layer.optim import OptimizerSettings, learning_rate
    from .trainer import _dist

    dist, rank, world = _dist()
    torch.set_flush_denormal(True)
    torch.manual_seed(settings.seed)
    check_split(len(sequences), settings.batch_size, world)
    held = [s for i, s in enumerate(sequences) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    train = [s for i, s in enumerate(sequences) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    for p in target.parameters():
        p.requires_grad_(False)
    for p in layer.parameters():
        p.requires_grad_(True)
    device = next(layer.parameters()).device
    drafting = wrap_layer(LayerLogits(target, layer), sharding, world)
    params = list(layer.parameters())  # after sharding: FSDP2's shards
    steps = settings.steps or max(1, math.ceil(settings.epochs * len(train) / settings.batch_size))
    schedule = OptimizerSettings(learning_rate=settings.learning_rate,
                                 warmup_steps=min(100, steps // 10))
    optimizer = torch.optim.AdamW(params, lr=settings.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=0.0)
    history: dict = {"step": [], "loss": [], "evaluations": []}
    best: tuple = (math.inf, {}, 0)
    data = batches(train, settings.batch_size, random.Random(settings.seed))
    evaluate_every = max(1, steps // 5)
    started = time.monotonic()
    layer.train()
    for step in tqdm(range(steps), desc="training", disable=not progress or rank != 0,
                     unit="step"):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, schedule, steps)
        ids, states = next(data)  # the states stay on the host; a rank's share goes over
        value, _ = batch_loss(target, layer, ids[rank::world].to(device),
                              states[rank::world].to(device), settings.loss, drafting)
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        reported = value.detach().clone()
        if dist is not None:  # the whole batch's loss, as one process reports it
            dist.all_reduce(reported)
            reported /= world
        history["step"].append(step)
        history["loss"].append(reported.item())
        if (step + 1) % evaluate_every == 0 or step + 1 == steps:
            row = evaluate(target, layer, held, settings.loss)
            if dist is not None:  # one decision on every rank: keeping the layer is collective
                decided = torch.tensor([row["loss"]], dtype=torch.float64, device=device)
                dist.broadcast(decided, 0)
                row["loss"] = decided.item()
            history["evaluations"].append({"step": step + 1, **row})
            if row["loss"] < best[0]:
                best = (row["loss"], layer_state(layer), step + 1)
            layer.train()
    history.update(seconds=time.monotonic() - started, steps=steps, best_step=best[2],
                   sequences={"train": len(train), "held_out": len(held)},
                   trainable_parameters=sum(p.numel() for p in layer.parameters()),
                   processes=world, sharding=sharding if world > 1 else None)
    return history, best[1]


def check_split(sequences: int, batch_size: int, world: int = 1) -> None:
    """Enough sequences for a batch once every 10th is held out, and a batch every rank can
    share equally; otherwise what to change."""
    held = sequences // HELD_OUT_EVERY
    if sequences - held < batch_size or not held:
        raise TrainInputError(f"{sequences} sequences: too few to train on batches of "
                              f"{batch_size} with every {HELD_OUT_EVERY}th held out; give more "
                              "prompts or --samples-per-prompt.")
    if batch_size % world:
        raise TrainInputError(f"--batch-size {batch_size} is not a multiple of --nproc {world}: "
                              "every rank takes an equal share of each batch.")


def wrap_layer(drafting: LayerLogits, sharding: str, world: int):
    """What computes the layer's logits: ``drafting`` itself in one process; DDP around it, or
    its layer sharded in place by FSDP2 (``fully_shard``: the block and ``norm`` each a unit,
    the float32 hyper-connection mixers and ``hc_head`` units of their own, kept float32 where
    GPUs gather the rest in bf16, as ``memory.py``'s plan counts; the projections and input norms
    in the layer's own unit)."""
    if world == 1:
        return drafting
    layer = drafting.layer
    if sharding == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        gathered = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                    if torch.cuda.is_available() else MixedPrecisionPolicy())
        for name in reference.FLOAT32_MODULES:
            fully_shard(layer.get_submodule(name), mp_policy=MixedPrecisionPolicy())
        fully_shard(layer.block, mp_policy=gathered)
        fully_shard(layer.norm, mp_policy=gathered)
        fully_shard(layer, mp_policy=gathered)
        return drafting
    from torch.nn.parallel import DistributedDataParallel

    # Every parameter gets a gradient at every step: transformers' experts are 3-D tensors of
    # all experts, the router's bias a buffer.
    return DistributedDataParallel(drafting)


def layer_state(layer) -> dict[str, torch.Tensor]:
    """The layer's tensors, whole (FSDP2's shards gathered) on rank 0, copied to the CPU; every
    rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(layer, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    return {name: t.detach().to("cpu", copy=True) for name, t in state.items()}


@torch.no_grad()
def evaluate(target, layer, held: list[Sequence], loss: str) -> dict:
    layer.eval()
    values, agreements = [], []
    device = target.lm_head.weight.device
    for ids, states in held:
        value, agreement = batch_loss(target, layer, ids[None].to(device),
                                      states[None].to(device), loss)
        values.append(value.item())
        agreements.append(agreement.item())
    return {"loss": sum(values) / len(values), "agreement": sum(agreements) / len(agreements)}
