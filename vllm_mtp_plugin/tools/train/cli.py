"""``vllm-mtp train TARGET --out DIR``: train the MTP layer(s) of TARGET on its own outputs.

Three stages, each resumable from the work directory (``--work-dir``, default
``default_work_dir(DIR)``, outside DIR's directory):

1. collect: the target continues the prompts through vLLM and the drafter's inputs are recorded
   (``tools/state_collection.py``; a separate process, whose engine memory is gone before
   training);
2. train: the MTP layer(s) on those sequences, the target's embedding and head frozen
   (``trainer.py``; ``--nproc N`` runs N ranks through torchrun);
3. export: TARGET's files linked, the trained layer(s) in a shard of their own, checked by the
   plugin's start-up check (``export.py``), with ``training/loss.png`` and
   ``training/accuracy.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from importlib import resources
from pathlib import Path

from ..checkpoint.target import TargetCheckpoint, TargetCheckpointError, model_type
from ..state_collection import CollectJob, CollectSettings
from ..job_files import write_job
from ..mtp_layer.trainable import INITS, PARAMETER_GROUPS, UNROLLS
from ..mtp_layer.v3_target import TrainInputError, open_target
from ..cli_help import HelpFormatter, examples
from .trainer import TrainSettings

DEFAULT_PROMPTS = "data/train_prompts.jsonl"
WORK_ROOT_ENV = "VLLM_MTP_WORK_ROOT"


def default_work_dir(out: Path) -> Path:
    """Where a run for ``out`` keeps its state when ``--work-dir`` is not given: below
    ``$VLLM_MTP_WORK_ROOT`` or the user's cache, named after ``out``'s absolute path, so a
    re-run resumes. Never beside ``out``: in a
    fleet set-up ``out`` lies in a server's reload directory, and the work directory holds the
    trainer state that a resume reads back."""
    root = os.environ.get(WORK_ROOT_ENV)
    if not root:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        root = cache / "vllm-mtp" / "train"
    key = hashlib.sha256(str(Path(out).resolve()).encode()).hexdigest()[:12]
    return Path(root) / f"{Path(out).name}-{key}"

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-mtp train", description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter, epilog=examples(
            "vllm-mtp train /models/my-finetune --out /models/my-finetune-mtp   # refresh its layer",
            "vllm-mtp train /models/my-finetune --data recorded/ --out /models/my-finetune-mtp",
            "vllm-mtp train /models/DeepSeek-V3 --memory-plan --nproc 8 --sharding fsdp",
            "vllm-mtp train /models/DeepSeek-V3 --out /models/DeepSeek-V3-mtp --nproc 8 "
            "--sharding fsdp  # through torchrun"))
    p.add_argument("target", help="DeepSeek-V3-layout checkpoint directory (with or without MTP "
                                  "layers; unquantized or block-FP8), or a bf16 DeepSeek-V4 one "
                                  "(docs/training.md: what V4 takes)")
    p.add_argument("--out", metavar="DIR",
                   help="new (or empty) directory for the servable result; required except with "
                        "--memory-plan")
    p.add_argument("--memory-plan", action="store_true",
                   help="print the per-GPU memory plan of training TARGET's MTP layer on --nproc "
                        "GPUs with --sharding and --train-only (counted on the meta device), "
                        "and exit")
    p.add_argument("--work-dir", help="collected data, trainer state and logs (default: "
                                      f"${WORK_ROOT_ENV}/OUTNAME-HASH, else "
                                      "$XDG_CACHE_HOME/vllm-mtp/train/... or ~/.cache/...: never "
                                      "beside OUT, which may lie in a server's reload "
                                      "directory); a re-run with the same options resumes there")
    p.add_argument("--prompts", metavar="FILE", help="prompt file: plain text lines, JSONL with 'prompt' or "
                                     "'messages', or ShareGPT JSON (default: a bundled set of "
                                     "short code and prose openings)")
    p.add_argument("--data", metavar="DIR",
                   help="train on shards already recorded (vllm-mtp serve --record DIR, or a "
                        "work directory's data/) instead of collecting from --prompts: no "
                        "collection pass, sequences held out by request")
    p.add_argument("--init", default="auto", choices=INITS,
                   help="checkpoint: refresh TARGET's own MTP layer; scratch: transformers' "
                        "random initialisation; last-layer: TARGET's last decoder layer as the "
                        "block; auto: checkpoint if TARGET has an MTP layer, else scratch")
    p.add_argument("--depth", type=int, default=1,
                   help="draft steps trained (D); serve with num_speculative_tokens up to D")
    p.add_argument("--unroll", default="chained", choices=UNROLLS,
                   help="chained: D layers, step s runs layer L+s (Model Runner V2; DeepSeek's "
                        "sequential MTP); recursive: one layer reused for every step (vLLM's V1 "
                        "runner for k > 1)")
    p.add_argument("--loss", default="kl", choices=("ce", "kl"),
                   help="kl (default): KL divergence to the target's full distribution (from "
                        "its stored hidden states and frozen head), what probabilistic drafting "
                        "(draft_sample_method: probabilistic) rewards; ce: cross-entropy on the "
                        "target's tokens. docs/training.md (e) measures both")
    p.add_argument("--step-weight", type=float, default=0.6,
                   help="depth s weighs STEP_WEIGHT**s")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps (default: --epochs passes over the collected sequences)")
    p.add_argument("--epochs", type=float, default=TrainSettings.epochs,
                   help="passes over the collected sequences, when --steps is not given")
    p.add_argument("--batch-size", type=int, default=TrainSettings.batch_size,
                   help="sequences per step, all ranks together")
    p.add_argument("--lr", type=float, default=TrainSettings.learning_rate,
                   help="peak learning rate of AdamW (linear warm-up, cosine decay to a tenth)")
    p.add_argument("--train-only", default=None,
                   help=f"comma-separated groups to train, the rest frozen (e.g. routed experts "
                        f"frozen: eh_proj,norms,attention,router,shared_expert); groups: "
                        f"{', '.join(PARAMETER_GROUPS)} (default: all of them)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature of the target's continuations (1: its own "
                        "distribution, self-distillation; 0: greedy)")
    p.add_argument("--max-new-tokens", type=int, default=CollectSettings.max_new_tokens,
                   help="tokens the target generates per continuation")
    p.add_argument("--samples-per-prompt", type=int, default=16,
                   help="continuations sampled per prompt (at --temperature > 0 they differ)")
    p.add_argument("--max-len", type=int, default=CollectSettings.max_len,
                   help="longest prompt + continuation, in tokens")
    p.add_argument("--nproc", type=int, default=1,
                   help="training processes (torchrun; gloo on CPU, NCCL on GPUs)")
    p.add_argument("--sharding", default="ddp", choices=("ddp", "fsdp"),
                   help="with --nproc > 1: DDP replicas, or FSDP2 fully_shard per layer (needed "
                        "for a full-size DeepSeek-V3 or V4 layer; see --memory-plan)")
    p.add_argument("--dtype", default="auto",
                   help="dtype of the collecting engine (vLLM's --dtype)")
    p.add_argument("--copy", action="store_true",
                   help="copy TARGET's files into OUT instead of linking them")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of sampling, initialisation and data order")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _scaffold(target: TargetCheckpoint, settings: TrainSettings, work: Path) -> Path | None:
    """For a target without an MTP layer: the target + the initial layer, so that vLLM builds the
    drafter whose inputs are recorded."""
    if target.mtp_layers():
        return None
    scaffold = work / "scaffold"
    if (scaffold / "config.json").exists():
        return scaffold
    from .export import export
    from ..mtp_layer.trainable import MtpTrainModel

    model = MtpTrainModel(target, settings.init, 1, "recursive", settings.seed)
    export(target, model.checkpoint_tensors(), scaffold)
    return scaffold


def _collect(args, target: TargetCheckpoint, settings: TrainSettings, work: Path,
             prompts: Path) -> dict:
    collect_settings = CollectSettings(temperature=args.temperature,
                                       max_new_tokens=args.max_new_tokens,
                                       samples_per_prompt=args.samples_per_prompt,
                                       max_len=args.max_len, seed=args.seed)
    scaffold = _scaffold(target, settings, work)
    job = CollectJob(model_dir=str(target.dir), prompts=str(prompts),
                     data_dir=str(work / "data"), settings=collect_settings, dtype=args.dtype,
                     serve_dir=str(scaffold) if scaffold else None)
    write_job(job, work / "collect.json")
    print(f"[1/3] collecting the target's continuations and the drafter's inputs through vLLM "
          f"({prompts})", flush=True)
    done = subprocess.run([sys.executable, "-m", "vllm_mtp_plugin.tools.state_collection",
                           str(work / "collect.json")])
    if done.returncode != 0:
        raise SystemExit(f"vllm-mtp train: collection failed (exit {done.returncode}); the "
                         f"engine's log is above. Re-run to resume from {work / 'data'}.")
    return json.loads((work / "data" / "manifest.json").read_text())


def _recorded(args, target: TargetCheckpoint) -> tuple[int, int]:
    """Sequences and tokens in ``--data DIR``, refused when they cannot train this target."""
    from ..mtp_layer.shard_format import SHARD_FORMATS, shard_summary

    if args.prompts:
        raise TrainInputError("--data DIR trains on recorded shards; --prompts is for "
                              "collecting new data. Give one of them.")
    summary = shard_summary(Path(args.data))
    if summary["formats"] - SHARD_FORMATS:
        raise TrainInputError(f"--data {args.data}: shards of format "
                              f"{', '.join(sorted(summary['formats'] - SHARD_FORMATS))}, not "
                              f"{', '.join(sorted(SHARD_FORMATS))}.")
    hidden = target.config.get("hidden_size")
    if hidden is not None and summary["hidden_size"] != hidden:
        raise TrainInputError(f"--data {args.data}: the shards hold hidden states of width "
                              f"{summary['hidden_size']} ({summary['first']}), {target.dir} has "
                              f"hidden_size {hidden}: they were recorded from another model.")
    return summary["sequences"], summary["tokens"]


def _train(args, settings: TrainSettings, work: Path) -> None:
    from .run import TrainJob, run_training, torchrun

    data = Path(args.data) if args.data else work / "data"
    job = TrainJob(target=str(Path(args.target)), data_dir=str(data), work_dir=str(work),
                   settings=settings)
    print(f"[2/3] training {settings.depth if settings.unroll == 'chained' else 1} MTP layer(s) "
          f"(init {settings.init}, depth {settings.depth} {settings.unroll}, loss "
          f"{settings.loss}, "
          f"{f'{settings.steps} steps' if settings.steps else f'{settings.epochs:g} epochs'}, "
          f"{args.nproc} process(es))", flush=True)
    if args.nproc <= 1:
        run_training(job, progress=not args.quiet)
        return
    write_job(job, work / "train.json")
    done = torchrun("vllm_mtp_plugin.tools.train.run", work / "train.json", args.nproc)
    if done.returncode != 0:
        raise SystemExit(f"vllm-mtp train: training failed (exit {done.returncode}); re-run to "
                         f"resume from {work}.")


def _prompts_path(args) -> Path:
    return Path(args.prompts) if args.prompts else Path(str(
        resources.files("vllm_mtp_plugin.tools").joinpath(DEFAULT_PROMPTS)))


def _v4_memory_plan(args) -> int:
    from .memory import v4_memory_plan

    if args.train_only:
        raise TrainInputError("--train-only: a DeepSeek-V4 layer is trained whole; the plan "
                              "counts every parameter.")
    config = json.loads((Path(args.target) / "config.json").read_text())
    source = f"{args.target}/config.json"
    try:
        plan = v4_memory_plan(config, gpus=args.nproc, sharding=args.sharding, source=source)
    except KeyError as exc:
        raise TrainInputError(f"{source}: no {exc} field, which the plan needs") from None
    except ValueError as exc:
        raise TrainInputError(str(exc)) from None
    print(f"{args.target}, {args.nproc} GPU(s), {args.sharding}:\n{plan.describe()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return _run(args)
    except (TrainInputError, TargetCheckpointError) as exc:
        print(f"vllm-mtp train: {exc}")
        return 2


def _run(args) -> int:
    from .export import export
    from ..mtp_layer.trainable import resolve_init
    from .run import history, trained_layers
    from .trainer import plot

    if model_type(Path(args.target)) == "deepseek_v4":
        from .v4 import run_v4

        if args.memory_plan:
            return _v4_memory_plan(args)
        if not args.out:
            raise TrainInputError("--out DIR is required (a new directory for the result).")
        if Path(args.out).exists() and any(Path(args.out).iterdir()):
            raise TrainInputError(f"--out {args.out} exists and is not empty; give a new "
                                  "directory.")
        return run_v4(args, _prompts_path(args),
                      Path(args.work_dir) if args.work_dir else default_work_dir(Path(args.out)))
    target = open_target(args.target)
    groups = tuple(args.train_only.split(",")) if args.train_only else None
    unknown = [g for g in groups or () if g not in PARAMETER_GROUPS]
    if unknown:
        raise TrainInputError(f"--train-only {','.join(unknown)}: unknown group; choose "
                              f"from {', '.join(PARAMETER_GROUPS)}.")
    if args.memory_plan:
        from .memory import memory_plan

        plan = memory_plan(target.config, gpus=args.nproc, sharding=args.sharding,
                           train_only=list(groups) if groups else None)
        print(f"{target.dir}, {args.nproc} GPU(s), {args.sharding}:\n{plan.describe()}")
        return 0
    if not args.out:
        raise TrainInputError("--out DIR is required (a new directory for the result).")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise TrainInputError(f"--out {out} exists and is not empty; give a new directory.")
    prompts = _prompts_path(args)
    if args.data:
        sequences, tokens = _recorded(args, target)
    else:
        from ..mtp_layer.drafter_inputs import load_training_prompts

        load_training_prompts(prompts)  # a bad prompt file fails before any engine starts
    settings = TrainSettings(steps=args.steps, epochs=args.epochs, batch_size=args.batch_size,
                             learning_rate=args.lr, depth=args.depth, unroll=args.unroll,
                             step_weight=args.step_weight, loss=args.loss,
                             init=resolve_init(args.init, target), train_only=groups,
                             seed=args.seed, sharding=args.sharding)
    work = Path(args.work_dir) if args.work_dir else default_work_dir(out)
    work.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not args.work_dir:
        print(f"      work directory: {work} (--work-dir to choose)", flush=True)
    if args.data:
        print(f"[1/3] recorded data: {sequences} sequences, {tokens} tokens in {args.data} (no "
              "collection)", flush=True)
    else:
        manifest = _collect(args, target, settings, work, prompts)
        sequences = sum(s["sequences"] for s in manifest["shards"])
        tokens = sum(s["tokens"] for s in manifest["shards"])
        print(f"      {sequences} sequences, {tokens} tokens in {work / 'data'}", flush=True)
    _train(args, settings, work)
    record = history(work)
    print(f"[3/3] exporting to {out}", flush=True)
    summary = export(target, trained_layers(work), out, copy=args.copy,
                     metadata={"vllm_mtp_train": json.dumps(dataclasses.asdict(settings))})
    report = out / "training"
    report.mkdir()
    plot(record, report / "loss.png", report / "accuracy.png")
    final = record.get("best")
    (report / "training.json").write_text(json.dumps(
        {"settings": dataclasses.asdict(settings), "sequences": sequences, "tokens": tokens,
         "held_out": final, "seconds": record.get("seconds"),
         "trainable_parameters": record["trainable_parameters"]}, indent=1))
    if final:
        print(f"exported the layer(s) of step {final['step']} of {record['steps']} (best held-out "
              "loss); held-out agreement with the target's greedy token, per depth: "
              + ", ".join(f"{a:.3f}" for a in final["accuracy"]))
    if not args.work_dir:  # the default one, in the user's cache: no optimizer state left
        from .trainer import BEST_LAYERS, CHECKPOINT

        for name in (CHECKPOINT, BEST_LAYERS):
            (work / name).unlink(missing_ok=True)
        print(f"      removed the trainer state from {work} (exported; its data stays for a "
              "re-run with other settings)", flush=True)
    k = summary["mtp_layers"] if settings.unroll == "chained" else settings.depth
    print(f"{out}: {summary['mtp_layers']} MTP layer(s) written; the target's files "
          f"{'copied' if args.copy else 'linked'}. Serve it with\n  vllm-mtp serve {out} "
          f"--speculative-config '{{\"method\": \"mtp\", \"num_speculative_tokens\": {k}}}'")
    return 0
