"""``vllm-mtp doctor [MODEL [vLLM engine args]]``: does MTP work here, and why is acceptance low.

Without MODEL: the plugin checked on tiny checkpoints in this platform's default engine mode
(docs/doctor.md lists the checks); with MODEL: a verdict on that checkpoint (healthy,
serving-mismatch, layer-mismatch, not-mtp, refused or undetermined) from a served probe and the
layer evaluated outside vLLM. Prints a table; ``--json FILE`` writes every check with its figures.
Exit status: 0 when every check passes (with MODEL: verdict healthy), 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from ..cli_help import HelpFormatter, examples
from .checks import as_dicts, format_table, write_report


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        prog="vllm-mtp doctor", description=__doc__.split("\n\n")[0], allow_abbrev=False,
        formatter_class=HelpFormatter,
        epilog="Arguments after MODEL that doctor does not know are vLLM engine arguments, given "
               "to every engine it starts. Exit status 0 when every check passes (with MODEL: "
               "verdict healthy), 1 otherwise.\n\n"
        + examples(
            "vllm-mtp doctor --json doctor.json            # does the plugin work on this machine?",
            "vllm-mtp doctor /path/to/checkpoint --prompts my_traffic.jsonl \\",
            "    --tensor-parallel-size 8 --json model.json  # why is its acceptance what it is?"))
    p.add_argument("model", nargs="?", help="a DeepSeek checkpoint directory (omit: check the "
                                            "plugin on this machine); vLLM engine arguments "
                                            "may follow")
    p.add_argument("--json", type=Path, metavar="FILE",
                   help="also write the report (every check, its figures, the platform) to FILE "
                        "as JSON")
    p.add_argument("--prompts", type=Path, metavar="FILE",
                   help="with MODEL: prompts like your traffic (plain lines, JSONL with prompt "
                        "or messages, ShareGPT; default: the bundled ones)")
    p.add_argument("--max-tokens", type=int, default=64, help="with MODEL: tokens per prompt")
    p.add_argument("--batch-sizes", type=_batch_sizes, default=None, metavar="LIST",
                   help="with MODEL: batch sizes at which k = 1 is timed against no speculation "
                        "(two more engines) for the advice on batch size, comma-separated; "
                        "'none' skips it (default: 1,8,32)")
    p.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                   help="without MODEL: also check TP = N (default: 2 where two devices exist; "
                        "on a CPU, vLLM runs a rank per process: --tensor-parallel 2 checks it)")
    p.add_argument("--work-dir", type=Path, metavar="DIR", help="checkpoints, engine logs and recorded data "
                                                 "(default: a temporary directory, removed)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per engine")
    return p.parse_known_args(argv)


def _batch_sizes(text: str) -> tuple[int, ...]:
    if text.strip().lower() == "none":
        return ()
    try:
        sizes = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give batch sizes >= 1, comma-separated "
                                         "(e.g. 1,8,32), or 'none'")
    return sizes


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    if args.model is None and extra:
        raise SystemExit(f"vllm-mtp doctor: {' '.join(extra)}: engine arguments go after MODEL")
    from .platform_facts import platform_facts

    facts = platform_facts()
    print(f"vllm-mtp doctor: {facts['platform']} ({facts['device']}), vLLM "
          f"{facts['versions']['vllm']}, torch {facts['versions']['torch']}", flush=True)
    with tempfile.TemporaryDirectory(prefix="vllm-mtp-doctor-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        if args.model is None:
            report = _selftest(args, facts, work)
        else:
            from ..mtp_layer.v3_target import TrainInputError

            try:
                report = _diagnose(args, extra, work)
            except TrainInputError as exc:
                raise SystemExit(f"vllm-mtp doctor: {exc}") from None
        report["seconds"] = time.monotonic() - started
    checks = report["checks"]
    print(format_table(checks))
    if "verdict" in report:
        _print_verdict(report)
    print(f"{len(checks)} checks, {sum(c.status == 'fail' for c in checks)} failed, "
          f"{report['seconds']:.0f} s" + (f"; report: {args.json}" if args.json else ""))
    environment = facts.pop("environment")
    write_report(args.json, {"environment": environment, "platform": facts, **report,
                             "checks": as_dicts(checks)})
    failed = any(c.status == "fail" for c in checks)
    return 1 if failed or report.get("verdict", "healthy") != "healthy" else 0


def _selftest(args, facts: dict, work: Path) -> dict:
    from . import selftest

    dtype = "float32" if facts["platform"] == "cpu" else "bfloat16"
    tp = args.tensor_parallel or (2 if facts["devices"] >= 2 else 1)
    print(f"building tiny checkpoints ({dtype}) in {work}", flush=True)
    checkpoints = selftest.build_checkpoints(work, dtype)
    from ..tiny.tokenizer import bundled_prompt_texts

    plans = selftest.engine_plans(checkpoints, dtype, bundled_prompt_texts()[:4], tp)
    print(f"running {len(plans)} engines in this platform's default mode", flush=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    results = selftest.run_engines(plans, checkpoints.served, logs, args.timeout)
    checks = selftest.evaluate(results, checkpoints)
    if tp < 2:
        from .checks import Check

        checks.append(Check("tensor-parallel", "skip", f"{facts['devices']} device(s): "
                            "--tensor-parallel 2 runs it", {"devices": facts["devices"]}))
    return {"mode": "selftest", "checks": checks,
            "engines": {name: {"seconds": r.get("wall_s"), "runner": r.get("runner"),
                               "compilation": r.get("compilation"), "error": r.get("error")}
                        for name, r in results.items()}}


def _diagnose(args, extra: list[str], work: Path) -> dict:
    from importlib import resources

    from ..engine.engine_args import engine_args
    from .batch import DEFAULT_BATCH_SIZES
    from .diagnosis import DiagnosisSettings, diagnose

    if not Path(args.model, "config.json").is_file():
        raise SystemExit(f"vllm-mtp doctor: {args.model}: not a checkpoint directory (no "
                         "config.json); give a Hugging Face DeepSeek checkpoint, or no MODEL to "
                         "check the plugin on this machine")
    prompts = args.prompts or Path(str(resources.files("vllm_mtp_plugin.tools").joinpath(
        "data/prompts.jsonl")))
    settings = DiagnosisSettings(
        prompts=prompts, max_tokens=args.max_tokens, timeout=args.timeout,
        batch_sizes=DEFAULT_BATCH_SIZES if args.batch_sizes is None else args.batch_sizes,
        engine_args=engine_args(extra, "vllm-mtp doctor", ("speculative_config", "model"),
                                "the probe drafts with k = 1"))
    return {"mode": "diagnosis", **diagnose(Path(args.model), settings, work)}


def _print_verdict(report: dict) -> None:
    print(f"verdict: {report['verdict']}")
    for title in ("reasons", "causes", "next", "advice"):
        for line in report.get(title) or []:
            print(f"  {title[:-1] if title.endswith('s') else title}: {line}")
