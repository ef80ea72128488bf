"""``vllm-mtp build-tiny OUT_DIR``: a tiny DeepSeek-V3 (or, ``--variant v4``, DeepSeek-V4) checkpoint
written to OUT_DIR, constructed (``v3.py``, ``v4.py``) or the trained one (``trained.py``,
``trained_v4.py``: the shipped files, or rebuilt from scratch)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..cli_help import HelpFormatter, examples
from . import BUILD_TINY_MODES, CONSTRUCTED_MODES

DESCRIPTION = "Write a tiny DeepSeek-V3 or DeepSeek-V4 checkpoint with MTP layers."


def main(argv: list[str]) -> int:
    from .v3 import PRESETS, build_checkpoint

    parser = argparse.ArgumentParser(
        prog="vllm-mtp build-tiny", description=DESCRIPTION, formatter_class=HelpFormatter,
        epilog=examples(
            "vllm-mtp build-tiny tiny-trained --mode trained           # the shipped trained model",
            "vllm-mtp build-tiny no-mtp --mode trained --mtp-layers 0  # the same, without its MTP layer",
            "vllm-mtp build-tiny noisy --preset small --mode noisy --acceptance 0.8",
            "vllm-mtp build-tiny rebuilt --mode trained --rebuild     # train it from scratch",
            "vllm-mtp build-tiny v4 --variant v4 --mode trained      # the shipped trained DeepSeek-V4",
            "vllm-mtp build-tiny v4-flash --variant v4 --mode trained --quantization fp8"))
    parser.add_argument("out_dir", metavar="OUT_DIR", help="directory to write the checkpoint to")
    parser.add_argument("--variant", default="v3", choices=("v3", "v4"),
                        help="v3: DeepSeek-V3/R1 layout; v4: DeepSeek-V4 (hyper-connections, "
                             "mtp.0.*; --preset does not apply)")
    parser.add_argument("--quantization", default="none", choices=("none", "fp8"),
                        help="with --variant v4: none (bf16) or fp8 (V4-Flash: FP8 linears, FP4 "
                             "experts with UE8M0 scales; vLLM's CPU kernels serve it on AMX only)")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                        help="size of a constructed checkpoint, smallest first: tiny, small, bench, large")
    parser.add_argument("--mode", default="oracle", choices=BUILD_TINY_MODES,
                        help=f"{'/'.join(CONSTRUCTED_MODES)}: constructed weights (acceptance set "
                             "by construction); trained: a small DeepSeek trained on real text, "
                             "shipped with the package (its acceptance is measured)")
    parser.add_argument("--rebuild", action="store_true",
                        help="with --mode trained: train it from scratch into OUT_DIR (time on "
                             "2 cores: docs/trained-model.md; downloads its corpus with pip) "
                             "instead of writing the shipped files")
    parser.add_argument("--steps", type=int, default=None,
                        help="with --rebuild: training steps (default: the shipped model's)")
    parser.add_argument("--cache-dir", default=None,
                        help="with --rebuild: where the corpus archive is kept (default: "
                             "OUT_DIR/.corpus)")
    parser.add_argument("--acceptance", type=float, default=0.7,
                        help="with --mode noisy: the share of first-position drafts the "
                             "drafter gets right (0..1)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of a constructed checkpoint's random weights")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="dtype of a constructed checkpoint's weights")
    parser.add_argument("--mtp-layers", type=int, default=None,
                        help="num_nextn_predict_layers: MTP layers written (default: the "
                             "preset's; with --mode trained 1, its one trained layer, or 0)")
    args = parser.parse_args(argv)
    if args.variant == "v4":
        return build_v4(args)
    if args.quantization != "none":
        parser.error("--quantization applies to --variant v4 only")
    if args.mode == "trained":
        return build_trained(args)
    overrides = {} if args.mtp_layers is None else {"num_nextn_predict_layers": args.mtp_layers}
    out = build_checkpoint(args.out_dir, args.preset, args.mode, args.seed, args.acceptance,
                           args.dtype, **overrides)
    print(out)
    return 0


def build_trained(args) -> int:
    from . import trained
    from .pretrain import PretrainSettings

    if args.rebuild:
        settings = PretrainSettings() if args.steps is None else PretrainSettings(steps=args.steps)
        cache = Path(args.cache_dir) if args.cache_dir else Path(args.out_dir) / ".corpus"
        record = trained.rebuild(Path(args.out_dir), cache, settings)
        print_metrics(record)
        if settings == PretrainSettings():
            tol = trained.REPRODUCTION_TOLERANCE
            for line, ok in trained.reproduction_report(record):
                print(f"{'reproduces' if ok else 'DIFFERS FROM'} the shipped model: {line} "
                      f"(tolerance {tol['perplexity']:.0%} perplexity, "
                      f"{tol['mtp_top1_accuracy']} top-1)")
        print(Path(args.out_dir))
        return 0
    mtp_layers = 1 if args.mtp_layers is None else args.mtp_layers
    print(trained.write_checkpoint(Path(args.out_dir), mtp_layers))
    return 0


def build_v4(args) -> int:
    quantization = None if args.quantization == "none" else args.quantization
    if args.mode == "trained":
        from . import trained_v4

        if args.rebuild:
            record = trained_v4.rebuild(Path(args.out_dir), Path(args.cache_dir) if args.cache_dir
                                        else Path(args.out_dir) / ".corpus",
                                        trained_v4.settings(args.steps))
            print_metrics(record)
            print(Path(args.out_dir))
            return 0
        mtp_layers = 1 if args.mtp_layers is None else args.mtp_layers
        print(trained_v4.write_checkpoint(Path(args.out_dir), mtp_layers, quantization))
        return 0
    from .v4 import build_checkpoint

    overrides = {} if args.mtp_layers is None else {"num_nextn_predict_layers": args.mtp_layers}
    print(build_checkpoint(args.out_dir, args.mode, args.seed, quantization=quantization,
                           acceptance=args.acceptance, **overrides))
    return 0


def print_metrics(record: dict) -> None:
    for kind, row in record["metrics"].items():
        print(f"{kind}: held-out perplexity {row['perplexity']:.1f} (unigram "
              f"{row['unigram_perplexity']:.1f}), MTP top-1 accuracy "
              f"{row['mtp_top1_accuracy']:.3f}")
