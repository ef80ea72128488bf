"""Adaptive k under shifting traffic (``benchmarks/adaptive_shift.py``): each arm's seconds per
phase and over the whole run, and adaptive's ratio to the best fixed arm.

``SHIFT`` holds every arm, alternated in one run. ``RERUN``, where stored, holds the adaptive arm
alone, run later on the same machine with a later controller: its row is compared with the fixed
arms of ``SHIFT`` and says so."""

from __future__ import annotations

import statistics

from .common import ROOT, bench_rows, load, source_line, table

SHIFT = "benchmarks/results/adaptive-shift/shift.json"
RERUN = "benchmarks/results/adaptive-shift/rerun/shift.json"
STEADY = "benchmarks/results/adaptive-steady/trained-c1/results.json"
# The same cell run again once the controller could choose every k at one sequence (another
# machine, a later commit).
STEADY_RERUN = "benchmarks/results/adaptive-steady/trained-c1-rerun/results.json"
# The whole steady grid of the proof on the trained model: every fixed k and adaptive (k <= 3)
# at concurrency 1, 4 and 16, T = 0 and 1, per prompt kind.
STEADY_GRID = "benchmarks/results/adaptive-steady/trained/results.json"
# The same grid with the controller that compares costs measured side by side, every engine
# warmed with 8 batches of the measured concurrency first (``--warmup 8``).
STEADY_WARM = "benchmarks/results/adaptive-steady/trained-warm/results.json"
# The same grid once more, a cell's configurations alternated minutes apart (``--order cell``),
# with k = 0 steps that no longer fetch drafts from the workers.
STEADY_CELL = "benchmarks/results/adaptive-steady/trained-cell/results.json"


def _ratios(adaptive: dict, fixed: dict) -> tuple[list[float], float]:
    """The best fixed arm's seconds / adaptive's, per phase and over the whole run."""
    phases = [min(arm["phase_seconds"][i] for arm in fixed.values()) / seconds
              for i, seconds in enumerate(adaptive["phase_seconds"])]
    return phases, min(arm["total_seconds"] for arm in fixed.values()) / adaptive["total_seconds"]


def _row(name: str, arm: dict) -> list[str]:
    return [name, *(f"{s:.1f} s" for s in arm["phase_seconds"]), f"{arm['total_seconds']:.1f} s"]


def _ratio_row(name: str, phases: list[float], total: float) -> list[str]:
    return [name, *(f"{r:.2f}×" for r in phases), f"{total:.2f}×"]


def shift_table() -> str:
    """One row per arm (median seconds of its engine processes), adaptive's ratios to the best
    fixed arm (above 1 is faster), the rerun's rows where stored, the work done and the sources."""
    data = load(SHIFT)
    phases = [p[0] for p in data["settings"]["phases"]]
    summary = data["summary"]
    fixed = {n: arm for n, arm in summary.items() if n != "adaptive"}
    rows = [_row(name, arm) for name, arm in summary.items()]
    if "adaptive" in summary:
        rows.append(_ratio_row("adaptive ÷ best fixed", *_ratios(summary["adaptive"], fixed)))
    sources = [SHIFT]
    rerun = load(RERUN)["summary"]["adaptive"] if (ROOT / RERUN).exists() else None
    if rerun:
        commit = load(RERUN)["environment"]["commit"][:10]
        rows.append(_row(f"adaptive, rerun ({commit})", rerun))
        rows.append(_ratio_row("rerun ÷ best fixed above", *_ratios(rerun, fixed)))
        sources.append(RERUN)
    settings = data["settings"]
    processes = {len(runs) for runs in data["results"].values()}
    work = (f"{settings['requests']} requests per phase of one at a time, "
            f"{settings.get('concurrent_requests') or settings['requests']} in the phase of "
            f"{max(p[3] for p in settings['phases'])} at a time, {settings['max_tokens']} tokens "
            f"each; {'/'.join(map(str, sorted(processes)))} engine process(es) per arm")
    return (f"{table(['arm', *phases, 'whole run'], rows)}\n\nSeconds per phase (lower is "
            f"faster); {work}. {source_line(*sources)}")


def shift_ratio(rerun: bool = False) -> str:
    """"1.19×": adaptive (or the rerun's) against the best single fixed arm, whole run."""
    summary = load(SHIFT)["summary"]
    fixed = {n: arm for n, arm in summary.items() if n != "adaptive"}
    adaptive = load(RERUN)["summary"]["adaptive"] if rerun else summary["adaptive"]
    return f"{_ratios(adaptive, fixed)[1]:.2f}×"


def _alternation(relative: str) -> str:
    """How the run ordered its engine processes (runs before ``--order`` went round by round
    over the whole grid)."""
    if load(relative)["settings"].get("order", "grid") == "cell":
        return ("alternated within each concurrency, round by round, every other round in "
                "reverse (a cell's configurations ran minutes apart)")
    return "alternated round by round over the whole grid"


def steady_table(relative: str = STEADY) -> str:
    """Per prompt kind, temperature and concurrency: each fixed k's and adaptive's output tokens
    per second against k = 0 (no speculation) of the same run, with the range over engine
    processes, and adaptive against the best fixed configuration of its cell (k = 0 included)."""
    fixed_ks = sorted({r["k"] for r in bench_rows(relative, impl="plugin")} - {0})
    largest = max(r["k"] for r in bench_rows(relative, impl="adaptive"))
    rows = []
    for base in bench_rows(relative, k=0, floor_only=False):
        cell = {"prompts": base["prompts"], "temperature": base["temperature"],
                "concurrency": base["concurrency"]}
        arms = {}
        for impl in ("plugin", "adaptive"):
            for r in bench_rows(relative, impl=impl, **cell):
                if r["k"] and arms.setdefault((impl, r["k"]), r) is not r:
                    raise ValueError(f"{relative}: several {impl} k = {r['k']} rows in {cell} "
                                     "(other draft or verify settings): not a steady-proof run")
        cells = [base["prompts"], f"{base['temperature']:g}", f"{base['concurrency']}",
                 f"{base['output_tok_s']:.0f}"]
        for key in [("plugin", k) for k in fixed_ks] + [("adaptive", largest)]:
            arm = arms.get(key)
            if arm is None:
                cells.append("—")
                continue
            low, high = (min(arm["output_tok_s_processes"]) / base["output_tok_s"],
                         max(arm["output_tok_s_processes"]) / base["output_tok_s"])
            cells.append(f"{arm['speedup']:.2f}× ({low:.2f}–{high:.2f})")
        adaptive = arms.get(("adaptive", largest))
        best = max([base] + [arms[("plugin", k)] for k in fixed_ks if ("plugin", k) in arms],
                   key=lambda r: r["output_tok_s"])
        cells.append(f"{adaptive['output_tok_s'] / best['output_tok_s']:.2f}× (k = {best['k']})"
                     if adaptive else "—")
        rows.append(cells)
    header = ["prompts", "T", "c", "k = 0 tok/s", *(f"k = {k} ÷ k = 0" for k in fixed_ks),
              f"adaptive (k ≤ {largest}) ÷ k = 0", "adaptive ÷ best fixed"]
    first = bench_rows(relative, impl="adaptive")[0]
    processes = sorted({r["processes"] for r in bench_rows(relative)})
    flagged = [r for r in bench_rows(relative) if r.get("implausible")]
    flags = (f" The bench flagged {len(flagged)} of these rows as impossible figures (its "
             f"`implausible` field: a disturbed or drifting machine)." if flagged else "")
    return (f"{table(header, rows)}\n\nMedian output tokens per second of "
            f"{'/'.join(map(str, processes))} engine processes per configuration, "
            f"{_alternation(relative)}; "
            f"the range is over those processes against k = 0's median; the best fixed "
            f"configuration is the fastest median among k = 0 and the fixed k of the cell; "
            f"speculative rows with {first['draft_sample_method'] or 'greedy'} drafts.{flags} "
            f"{source_line(relative)}")


def _process_medians(row: dict) -> dict[int, float]:
    """Each engine process's median output tokens per second in a row (its repeats of the row's
    pass)."""
    by_process: dict[int, list[float]] = {}
    for run in row["runs"]:
        by_process.setdefault(run["process"], []).append(run["output_tok_s"])
    return {p: statistics.median(rates) for p, rates in by_process.items()}


def _adaptive_cells(relative: str):
    """(k = 0 row, adaptive row, the fixed rows of its cell: k = 0 and every fixed k) for every
    cell (prompt kind, temperature, concurrency) that has an adaptive row."""
    for base in bench_rows(relative, k=0, floor_only=False):
        cell = {"prompts": base["prompts"], "temperature": base["temperature"],
                "concurrency": base["concurrency"]}
        adaptive = bench_rows(relative, impl="adaptive", **cell)
        if adaptive:
            fixed = [base, *(r for r in bench_rows(relative, impl="plugin", **cell) if r["k"])]
            yield base, adaptive[0], fixed


def _paired(relative: str):
    """Per cell: its k = 0 row, its best fixed row, and adaptive's ratios over rounds to each."""
    for base, adaptive, fixed in _adaptive_cells(relative):
        best = max(fixed, key=lambda r: r["output_tok_s"])
        ours = _process_medians(adaptive)
        ratios = []
        for other in (base, best):
            theirs = _process_medians(other)
            ratios.append([ours[p] / theirs[p] for p in sorted(ours) if p in theirs])
        yield base, best, ratios


def _missed(medians: list[float]) -> list[str]:
    """The steady targets a cell's paired medians (against k = 0, against the best) miss."""
    return [f"{m:.3f}× of {name} is below {target:g}×" for m, name, target in
            zip(medians, ("k = 0", "the best fixed"), (0.97, 0.95)) if m < target]


def steady_paired_table(relative: str = STEADY_CELL) -> str:
    """Per cell, adaptive against k = 0 and against the best fixed k, process by process: round
    r's adaptive process over round r's process of the other configuration (in a run ordered cell
    by cell they ran minutes apart), the median and range over rounds; and whether the medians
    of those ratios reach the steady targets (0.95x the best fixed configuration, 0.97x k = 0)."""
    largest = max(r["k"] for r in bench_rows(relative, impl="adaptive"))
    rows = []
    for base, best, ratios in _paired(relative):
        medians = [statistics.median(r) for r in ratios]
        missed = _missed(medians)
        rows.append([base["prompts"], f"{base['temperature']:g}", f"{base['concurrency']}",
                     *(f"{m:.2f}× ({min(r):.2f}–{max(r):.2f})" for m, r in zip(medians, ratios)),
                     f"k = {best['k']}", "no: " + "; ".join(missed) if missed else "yes"])
    header = ["prompts", "T", "c", f"adaptive (k ≤ {largest}) ÷ k = 0", "adaptive ÷ best fixed",
              "best fixed (medians)", "targets met"]
    return (f"{table(header, rows)}\n\nRatios of engine processes of the same round (median "
            f"and range over rounds; a process's rate is the median of its repeated passes), "
            f"{_alternation(relative)}; the best fixed configuration is the fastest median "
            f"among k = 0 and the fixed k of the cell; targets met in "
            f"{steady_paired_met(relative)}. {source_line(relative)}")


def steady_paired_met(relative: str = STEADY_CELL) -> str:
    """"0 of 18 cells": where the medians of the paired ratios reach both steady targets."""
    cells = [not _missed([statistics.median(r) for r in ratios])
             for _, _, ratios in _paired(relative)]
    return f"{sum(cells)} of {len(cells)} cells"


def steady_targets_met(relative: str = STEADY_GRID) -> str:
    """"2 of 18 cells": where adaptive reached both of the steady proof's targets (at least 0.95x
    the best fixed configuration and 0.97x k = 0, medians)."""
    met = total = 0
    for base, adaptive, fixed in _adaptive_cells(relative):
        best = max(r["output_tok_s"] for r in fixed)
        rate = adaptive["output_tok_s"]
        total += 1
        met += rate >= 0.95 * best and rate >= 0.97 * base["output_tok_s"]
    return f"{met} of {total} cells"


def adaptive_choices_table(relative: str = STEADY_WARM) -> str:
    """Per cell, what adaptive drafted: its decode steps by the k they drafted (share of its
    steps) and their median time, beside the k = 0 engine's step (``by_drafted_k``, the bench's
    step timer: the model runner's time, a step verifying the drafts of the step before it)."""
    largest = max(r["k"] for r in bench_rows(relative, impl="adaptive"))
    ks = range(largest + 1)
    rows = []
    for base in bench_rows(relative, k=0, floor_only=False):
        cell = {"prompts": base["prompts"], "temperature": base["temperature"],
                "concurrency": base["concurrency"]}
        adaptive = bench_rows(relative, impl="adaptive", **cell)
        groups = adaptive[0].get("by_drafted_k") if adaptive else None
        if not groups:
            continue
        total = sum(g["steps"] for g in groups.values())
        zero = (base.get("by_drafted_k") or {}).get("0")
        cells = [base["prompts"], f"{base['temperature']:g}", f"{base['concurrency']}"]
        for k in ks:
            group = groups.get(str(k))
            cells.append(f"{100 * group['steps'] / total:.0f} % ({group['step_ms']:.2f} ms)"
                         if group else "—")
        cells.append(f"{zero['step_ms']:.2f} ms" if zero else "—")
        rows.append(cells)
    header = ["prompts", "T", "c", *(f"adaptive at k = {k}" for k in ks),
              "k = 0 engine's step"]
    return (f"{table(header, rows)}\n\nAdaptive's decode steps by the k they drafted, summed over "
            f"its engine processes and passes: share of its steps (median step time, the model "
            f"runner's, of the passes' medians). {source_line(relative)}")

