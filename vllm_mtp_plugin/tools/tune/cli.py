"""``vllm-mtp tune MODEL --prompts FILE``: which num_speculative_tokens serves fastest here, per
batch size, measured through vLLM on the user's prompts and hardware.

Prints a ready ``--speculative-config`` (vLLM's ``num_speculative_tokens_per_batch_size``
schedule, and the best fixed k per concurrency for runners without it) and writes ``tune.json``
(the schedule at its top level under vLLM's key, next to every measurement) and ``tune.png``.
Arguments it does not know are vLLM engine arguments (``--dtype``, ``--max-model-len``, ...) and
go to every engine it starts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..throughput import prediction
from ..cli_help import HelpFormatter, examples
from . import plot as tune_plot
from ..throughput.measure import Measured, TuneRun, measure
from .results import Acceptance, MethodChoice, TuneResult

REFUSED = ("speculative_config", "max_num_seqs", "model")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        prog="vllm-mtp tune", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter,
        epilog="Arguments it does not know are vLLM engine arguments (--dtype, "
               "--tensor-parallel-size, --max-model-len, ...), given to every engine it starts.\n\n"
        + examples(
            "vllm-mtp tune /models/DeepSeek-R1 --prompts my_traffic.jsonl --concurrency 1 4 16 \\",
            "    --temperature 0.6 --tensor-parallel-size 8 --max-model-len 8192",
            "vllm-mtp tune trained --concurrency 1 4 --max-k 2   # the trained tiny DeepSeek, on a CPU",
            "python -m vllm_mtp_plugin.tools.tune.check tune.json sweep-c*/results.json --out check/",
            "                                                    # the pick against bench sweeps"))
    p.add_argument("model", help="a DeepSeek checkpoint with MTP layers (or a bench preset name, "
                                 "e.g. bench:noisy:0.8, or 'trained')")
    p.add_argument("--prompts", metavar="FILE", help="plain text (a prompt per line), JSONL of {\"prompt\": ...} "
                                     "or ShareGPT (default: the "
                                     "bundled prompts; for 'trained', its code/prose/chat "
                                     "prompts, all as completions); what your traffic looks like")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 2, 4, 8, 16],
                   help="batch sizes to measure (requests in flight)")
    p.add_argument("--max-k", type=int, default=3, help="largest num_speculative_tokens tried")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of your traffic (acceptance falls with it)")
    p.add_argument("--draft-sample-method", nargs="+", choices=["greedy", "probabilistic"],
                   help="speculative_config.draft_sample_method(s) to measure; default: both when "
                        "--temperature > 0 (recommending the one that pays), else greedy (at "
                        "temperature 0 they draft alike)")
    p.add_argument("--repeats", type=int, default=1, help="measured passes per (k, concurrency)")
    p.add_argument("--seed", type=int, default=0, help="seed of sampled requests")
    p.add_argument("--out", type=Path, default=Path("tune.json"), metavar="FILE",
                   help="the result: the schedule under vLLM's key and every measurement")
    p.add_argument("--log-dir", type=Path,
                   help="engine logs (default: tune-logs/ in the directory of --out)")
    p.add_argument("--no-plot", action="store_true", help="draw no plot (it goes to --out with the suffix .png)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per engine")
    p.add_argument("--remeasure", type=int, default=1,
                   help="measure again (engines in the other order) this many times when the "
                        "measurements are impossible or the machine was busy; still so: no "
                        "recommendation, exit 3")
    return p.parse_known_args(argv)


def draft_methods(args: argparse.Namespace) -> list[str]:
    """The draft methods to measure: as given, else both for sampled traffic (probabilistic
    drafts raise acceptance there) and greedy alone at temperature 0 (they draft alike)."""
    if args.draft_sample_method:
        return args.draft_sample_method
    return ["greedy", "probabilistic"] if args.temperature > 0 else ["greedy"]


def engine_args(extra: list[str]) -> dict:
    """vLLM engine arguments from the command line, as ``LLM(...)`` keywords (non-defaults only)."""
    from ..engine.engine_args import engine_args as parse

    return parse(extra, "vllm-mtp tune", REFUSED, "one engine per k, one pass per concurrency")


def resolve_model(checkpoint_arg: str, log=print) -> str:
    path = Path(checkpoint_arg).expanduser()
    if path.is_dir():
        return str(path)
    from ..tiny.presets import resolve

    try:
        return str(resolve(checkpoint_arg, log=log).path)
    except ValueError as exc:
        raise SystemExit(f"vllm-mtp tune: {checkpoint_arg!r} is neither a checkpoint directory nor a "
                         f"preset ({exc})") from None


def method_points(points: list[dict], method: str) -> list[dict]:
    """The points one draft method's choice rests on: its own k > 0 engines and the k = 0 one."""
    return [p for p in points if not p["k"] or (p.get("draft_sample_method") or "greedy") == method]


def method_choice(run: TuneRun, points: list[dict], counters: dict) -> MethodChoice:
    """One draft method's acceptance, expected tokens/s and best k per concurrency."""
    taus = prediction.acceptance_lengths(counters, run.max_k)
    expected = prediction.predictions(points, taus, run.max_tokens)
    best = prediction.best_k(expected)
    return MethodChoice(best_fixed_k=best, expected_tok_s=expected,
                        acceptance=Acceptance(taus, counters),
                        mean_best_speedup=prediction.mean_best_speedup(expected, best),
                        mean_best_speculative_speedup=prediction.mean_best_speedup(expected, best,
                                                                                   True))


def result(run: TuneRun, measured: Measured) -> TuneResult:
    """tune.json's content: vLLM's schedule, the chosen draft method, what it was derived
    from (every method's figures, the measurements)."""
    choices = {m: method_choice(run, method_points(measured.points, m), counters)
               for m, counters in measured.counters.items()}
    method = prediction.preferred_draft_method(
        {m: (c.mean_best_speedup, c.mean_best_speculative_speedup) for m, c in choices.items()})
    best = choices[method].best_fixed_k
    if not best:
        raise SystemExit("vllm-mtp tune: no concurrency has decode-step timings without "
                         f"speculation; the engine logs say why ({measured.logs})")
    ranges = prediction.schedule(best)
    return TuneResult(
        schedule=ranges, speculative_config=prediction.speculative_config(ranges, method),
        draft_sample_method=method, choices=choices, measurements=measured.points,
        compilation=measured.compilation, ks_measured=measured.ks,
        settings={"model": run.model, "concurrencies": run.concurrencies,
                  "max_k": run.max_k, "max_tokens": run.max_tokens,
                  "temperature": run.temperature, "repeats": run.repeats,
                  "draft_sample_methods": run.draft_sample_methods,
                  "engine_args": run.engine_args, "num_prompts": len(run.prompts)})


BUSY_RATIO = 1.5
REFUSED_EXIT = 3  # measured, but nothing to recommend from: see docs/tune.md


def busy_points(points: list[dict]) -> list[str]:
    """Where decode steps' mean exceeds their median by half: other work shared the machine."""
    return [f"k = {p['k']}, c = {p['concurrency']}: decode steps' mean {p['mean_step_ms']:.1f} ms "
            f"against a median of {p['step_ms']:.1f} ms (other work shared the machine)"
            for p in points if p.get("mean_step_ms") and p.get("step_ms")
            and p["mean_step_ms"] > BUSY_RATIO * p["step_ms"]]


def problems(data: TuneResult) -> list[str]:
    """Why tune must not recommend from ``data``: impossible figures (of any draft method
    measured) or a busy machine."""
    from ..throughput.plausibility import tune_problems

    found = []
    for method, choice in data.choices.items():
        named = [f"{line} ({method} drafts)" if data.several_methods else line
                 for line in tune_problems(method_points(data.measurements, method),
                                           choice.acceptance.acceptance_lengths,
                                           choice.expected_speedup)]
        found += [line for line in named if line not in found]
    return found + busy_points(data.measurements)


def summary_text(data: TuneResult) -> str:
    """The table of expected (and, from tune's own passes, measured) tokens/s, and the advice."""
    max_k = data.settings["max_k"]
    chosen = data.chosen
    measured = {(p["concurrency"], p["k"]): p["measured_tok_s"] for p in method_points(
        data.measurements, data.draft_sample_method)}
    lines = ["expected tokens/s (measured in tune's own pass), per concurrency and k; * = best", "",
             "| concurrency | " + " | ".join(f"k = {k}" for k in range(max_k + 1)) + " | best k |",
             "|---|" + "---|" * (max_k + 2)]
    for c, by_k in chosen.expected_tok_s.items():
        if c not in chosen.best_fixed_k:
            lines.append(f"| {c} | no decode steps measured without speculation: left out |")
            continue
        cells = []
        for k in range(max_k + 1):
            value = by_k.get(k)
            seen = measured.get((c, k))
            cells.append("–" if value is None else f"{value:.1f}"
                         + (f" ({seen:.1f})" if seen else "")
                         + (" *" if chosen.best_fixed_k[c] == k else ""))
        lines.append(f"| {c} | " + " | ".join(cells) + f" | {chosen.best_fixed_k[c]} |")
    lines += [""]
    for name, choice in data.choices.items():
        lines.append("acceptance per draft position at k = %d%s: %s" % (
            max_k, f", {name} drafts" if data.several_methods else "",
            " ".join(f"{a:.2f}" for a in choice.acceptance.per_position)))
    if data.several_methods:
        methods = data.choices.items()
        lines.append(f"draft method: {data.draft_sample_method} (mean over concurrencies of the "
                     "best k's speed-up over no speculation: " + ", ".join(
                         f"{name} {choice.mean_best_speedup:.2f}x" for name, choice in methods)
                     + "; of the best k > 0: " + ", ".join(
                         f"{name} {choice.mean_best_speculative_speedup:.2f}x"
                         for name, choice in methods) + ")")
    spec = data.speculative_config
    if spec is None:
        lines += ["", "MTP does not pay off at any concurrency measured here: serve without "
                      "--speculative-config."]
    else:
        lines += ["", "serve with (Model Runner V2 reads the schedule; fixed k where it is one):",
                  f"  --speculative-config '{json.dumps(spec)}'"]
        fixed = sorted(set(chosen.best_fixed_k.values()))
        if len(fixed) > 1:
            lines.append("best fixed k per concurrency (a runner without the schedule): "
                         + ", ".join(f"c = {c}: k = {k}" for c, k in chosen.best_fixed_k.items()))
    lines.append(adaptive_k_hint(max_k))
    return "\n".join(lines)


def adaptive_k_hint(max_k: int) -> str:
    """The alternative to a measured schedule that goes stale when traffic changes."""
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": max_k})
    return ("or let the engine choose k (0 included) at every step from what it measures while "
            f"it serves: VLLM_MTP_ADAPTIVE_K=1 with --speculative-config '{spec}' "
            "(docs/adaptive-k.md)")


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    from ..prompt_files import load_prompts
    from ..tiny.presets import default_prompts

    try:
        prompts = load_prompts(args.prompts or default_prompts([args.model]))
    except ValueError as exc:  # a prompt file it cannot read: file, line, what was expected
        raise SystemExit(f"vllm-mtp tune: --prompts {exc}") from None
    run = TuneRun(model=resolve_model(args.model), prompts=prompts,
                  concurrencies=args.concurrency, max_k=args.max_k, max_tokens=args.max_tokens,
                  temperature=args.temperature, seed=args.seed, repeats=args.repeats,
                  engine_args=engine_args(extra), timeout=args.timeout,
                  draft_sample_methods=draft_methods(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    logs = args.log_dir or args.out.parent / "tune-logs"
    logs.mkdir(parents=True, exist_ok=True)
    from ..provenance import machine_line
    from ..provenance import environment, portable

    machine = environment()
    for attempt in range(args.remeasure + 1):
        measured = measure(run, logs, reverse=attempt % 2 == 1)
        measured.logs = str(logs)
        data = result(run, measured)
        found = problems(data)
        if not found:
            break
        print("tune: these measurements cannot be right:\n  " + "\n  ".join(found)
              + ("\n  measuring again, engines in the other order" if attempt < args.remeasure
                 else ""))
    data.plausibility = {"measurements": attempt + 1, "problems": found}
    if found:
        data.refused = found
        data.speculative_config = None
        data.schedule = None
    data.machine = machine
    args.out.write_text(json.dumps(portable(data.to_json()), indent=1))
    print(machine_line(data.machine))
    if found:
        print(f"vllm-mtp tune: no recommendation after {attempt + 1} measurement(s): the figures "
              "above are impossible or the machine was busy. Rerun on an idle machine, with "
              f"--repeats 3 (measurements in {args.out}).")
        return REFUSED_EXIT
    print(summary_text(data))
    if not args.no_plot:
        drawn = tune_plot.expected(data, args.out.with_suffix(".png"))
        if drawn is not None:
            print(f"plot: {drawn}")
    print(f"results: {args.out}")
    return 0
