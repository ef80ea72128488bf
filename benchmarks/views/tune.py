"""``vllm-mtp tune``'s pick against sweeps of fixed k (``benchmarks/results/tune-*``): tokens/s
per k as the median of every measured pass, with the lowest and highest pass."""

from __future__ import annotations

import json

from .common import ROOT, command, load, percent, source_line, table

MODELS = {"bench": "`bench` preset, 457 M", "trained": "trained, 8.4 M"}


def _files(name: str) -> tuple[str, str]:
    return f"benchmarks/results/tune-{name}/check.json", f"benchmarks/results/tune-{name}/tune.json"


def verdicts(name: str) -> list[dict]:
    data = load(_files(name)[0])
    return data["verdicts"] if isinstance(data, dict) else data


def _tok_s(figure: dict, ranges: bool) -> str:
    text = f"{figure['median']:.1f}"
    return text + (f" [{figure['low']:.1f}–{figure['high']:.1f}]" if ranges else "")


def _best(v: dict) -> str:
    return f"{v['measured_best_k']}" + (" (within noise)" if v["pick"] == "within noise" else "")


def tune_table(ranges: bool) -> str:
    """Both models; ``ranges`` adds each k's lowest and highest pass and tune's verdict."""
    rows = []
    for name, label in MODELS.items():
        for i, v in enumerate(verdicts(name)):
            ks = sorted(v["tok_s"], key=int)
            cells = [label if i == 0 else "", str(v["concurrency"]),
                     *(_tok_s(v["tok_s"][k], ranges) for k in ks),
                     str(v["tuned_k"]), _best(v), f"{v['tuned_over_no_speculation']:.2f}×"]
            rows.append(cells + ([v["pick"]] if ranges else []))
    header = ["model", "concurrency", *(f"k = {k}" for k in range(4)), "tune's k", "measured best",
              "tuned ÷ k = 0"] + (["tune's pick"] if ranges else [])
    passes = {v["tok_s"]["0"]["passes"] for name in MODELS for v in verdicts(name)}
    processes = {load(str(sweep.relative_to(ROOT)))["settings"]["processes"] for name in MODELS
                 for sweep in (ROOT / _files(name)[0]).parent.glob("offline-c*/results.json")}
    sources = [f for name in MODELS for f in _files(name)[1:]]
    return (f"{table(header, rows)}\n\nOutput tokens/s, median of {'/'.join(map(str, sorted(passes)))} "
            f"passes from {'/'.join(map(str, sorted(processes)))} engine processes per k"
            + (", [lowest–highest pass]" if ranges else "")
            + f"; sweeps in `offline-c*/results.json` beside each. {source_line(*sources)}")


def fixed_k_cost(name: str, k: int) -> str:
    """"19–42 %": what a fixed k cost against no speculation over the concurrencies where it lost
    ("none" where it never did)."""
    losses = [1 - v["tok_s"][str(k)]["median"] / v["tok_s"]["0"]["median"] for v in verdicts(name)]
    losses = [loss for loss in losses if loss > 0]
    if not losses:
        return "none"
    low, high = min(losses), max(losses)
    return f"{100 * low:.0f} %" if round(100 * low) == round(100 * high) else \
        f"{100 * low:.0f}–{100 * high:.0f} %"


def printed_config(name: str) -> str:
    """The ``--speculative-config`` tune printed, as stored in its ``tune.json``."""
    return f"`{json.dumps(load(_files(name)[1])['speculative_config'])}`"


SAMPLED = "benchmarks/results/tune-sampled/tune.json"


def sampled_methods() -> str:
    """tune on sampled traffic: per draft method its acceptance per position at max-k, the mean
    expected speed-up of its best k, and its best k per concurrency; which one tune chose."""
    data = load(SAMPLED)
    if not data.get("draft_methods"):
        return (f"One draft method measured ({data.get('draft_sample_method')}): nothing to "
                f"compare. {source_line(SAMPLED)}")
    if data.get("refused"):
        return (f"**tune refused to recommend** from this run: {'; '.join(data['refused'])}. "
                f"{source_line(SAMPLED)}")
    rows = []
    cs, max_k = data["settings"]["concurrencies"], data["settings"]["max_k"]
    measured = {(p["concurrency"], p["k"], p.get("draft_sample_method")): p["measured_tok_s"]
                for p in data["measurements"]}

    def speedups(c: int, method: str) -> str:  # tune's own passes, k = 1..max-k over k = 0
        base = measured[(c, 0, None)]
        return " / ".join(f"{measured[(c, k, method)] / base:.2f}×" for k in range(1, max_k + 1)
                          if (c, k, method) in measured)

    for method, choice in data["draft_methods"].items():
        rows.append([method + (" (chosen)" if method == data["draft_sample_method"] else ""),
                     " / ".join(f"{a:.2f}" for a in choice["acceptance"]["per_position"]),
                     *(speedups(c, method) for c in cs),
                     ", ".join(f"c = {c}: k = {k}" for c, k in choice["best_fixed_k"].items()),
                     f"{choice['mean_best_speculative_speedup']:.2f}×"])
    text = table(["draft method", f"acceptance per position at k = {max_k}",
                  *(f"measured speed-up k = 1 … {max_k}, c = {c}" for c in cs), "best k",
                  "expected speed-up of the best k > 0 (mean over c)"], rows)
    spec = data["speculative_config"]
    advice = (f"`tune` printed `--speculative-config '{json.dumps(spec)}'`" if spec else
              "`tune` recommended serving without speculation")
    return f"{text}\n\n{advice}. {source_line(SAMPLED)}"


def _sweeps(name: str) -> list[str]:
    folder = ROOT / _files(name)[0]
    return sorted((p.relative_to(ROOT).as_posix() for p in folder.parent.glob("offline-c*/"
                                                                               "results.json")),
                  key=lambda p: int(p.split("offline-c")[1].split("/")[0]))


def sweep_command(name: str) -> str:
    """The first sweep's command as it ran (the others differ in ``--concurrency``,
    ``--num-prompts`` and their folders)."""
    return f"`{command(load(_sweeps(name)[0])['environment']['argv'])}`"


def sweeps_interference() -> str:
    """Other processes' CPU time in the sweeps' rows, and the engine processes re-run."""
    from .quiet import cpus, share

    rows = [(sweep, r) for name in MODELS for sweep in _sweeps(name)
            for r in load(sweep)["results"]]
    worst_sweep, worst = max(rows, key=lambda pair: share(pair[1], cpus(pair[0])) or 0)
    rerun = [f"{sweep.split('/')[2]} {sweep.split('/')[3].removeprefix('offline-')} "
             f"k = {r['k']} ({len(r['interference']['discarded_disturbed'])})"
             for sweep, r in rows if r["interference"].get("discarded_disturbed")]
    return (f"other processes took at most {percent(share(worst, cpus(worst_sweep)))} of the CPUs "
            f"during a row ({worst['interference']['other_cpu_s']:.1f} CPU-seconds)"
            + (f"; engine processes run again because other work took more than the bench's "
               f"threshold meanwhile (discarded, never pooled): {', '.join(rerun)}"
               if rerun else "; no engine process was run again"))


def k0_processes(name: str, concurrency: int) -> str:
    """The k = 0 engine processes of one sweep: their tokens/s, slowest first."""
    sweep = next(s for s in _sweeps(name) if s.endswith(f"offline-c{concurrency}/results.json"))
    (row,) = [r for r in load(sweep)["results"] if r["k"] == 0 and not r.get("floor_only")]
    values = sorted(row["output_tok_s_processes"])
    return (", ".join(f"{v:.1f}" for v in values[:-1]) + f" and {values[-1]:.1f} tokens/s")
