"""Numbers derived from raw measurements: medians, latency percentiles, speed-ups, the ideal bound.

The ideal bound. With speculation each engine step emits on average ``tau`` tokens (the measured
mean acceptance length, 1 + accepted / drafts) and costs one verification plus ``k`` draft steps.
If verifying ``k + 1`` tokens cost what one ordinary decode step costs (``T0``, measured at k = 0)
and a draft step cost ``c * T0``, the speed-up would be ``tau / (1 + k * c)``: that is the bound.
``c`` is measured inside the engine (``steptimer``): the median drafting time per step divided by
``k`` and by ``T0``. What the bound leaves out shows up as ``measured / ideal < 1``; the largest
part is usually verification costing more than a decode step (``verify_cost_ratio``, reported too).

The floor. Verifying k + 1 tokens of a request cannot cost less than a decode step with k + 1 rows
per request: the same weights read, k + 1 times the attention rows. The sweep's ``floor`` measures
that step (k = 0 with (k + 1) * c requests in flight, its decode steps full); ``floor_ratio`` is its
time in decode steps of c rows, ``verify_over_floor`` what verification costs against it. On a
machine where ``floor_ratio + k * c`` (the acceptance length at which speculation breaks even with
verification at the floor) reaches k + 1, no drafter can make speculation pay off at that k:
``payoff_bound`` = (k + 1) / (floor_ratio + k * c) is the best speed-up perfect drafts could give.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ..engine.metrics import total_counters
from ..stats import median
from ..throughput.plausibility import row_problems


def latency_summary(seconds: Iterable[float | None]) -> dict:
    """Mean, p50 and p99 in milliseconds (numpy's linear percentiles, as ``vllm bench serve``)."""
    values = np.array([v for v in seconds if v is not None], dtype=float) * 1e3
    if not len(values):
        return {"mean": None, "p50": None, "p99": None}
    return {"mean": float(values.mean()), "p50": float(np.percentile(values, 50)),
            "p99": float(np.percentile(values, 99))}


def median_of(dicts: list[dict | None]) -> dict:
    """Key-wise median of summaries (one per repeat); ``None`` values are skipped."""
    dicts = [d for d in dicts if d]
    keys = dict.fromkeys(k for d in dicts for k in d)
    return {k: median(d.get(k) for d in dicts) for k in keys}


def ideal_speedup(mean_acceptance_length: float, k: int, draft_cost_ratio: float) -> float:
    """``tau / (1 + k * c)``: tokens per step over step cost in target-step units."""
    return mean_acceptance_length / (1.0 + k * draft_cost_ratio)


def _key(row: dict, *fields: str) -> tuple:
    return tuple(row.get(f) for f in fields)


BASELINE_KEY = ("mode", "checkpoint", "concurrency", "prompts", "temperature")
SAME_CONFIG_KEY = (*BASELINE_KEY, "k", "mla_verify", "draft_sample_method",
                   "rejection_sample_method")


def baseline_key(row: dict) -> tuple:
    """Rows sharing a k = 0 baseline. vLLM alone (impl ``vllm``, no plugin loaded) runs other
    engine code even without a drafter (none of the plugin's patches), so it gets its own."""
    return (*_key(row, *BASELINE_KEY), row.get("impl") == "vllm")


DERIVED = ("draft_cost_ratio", "verify_cost_ratio", "ideal_speedup", "measured_over_ideal",
           "floor_ratio", "floor_rows", "verify_over_floor", "break_even_acceptance_length",
           "payoff_bound")


def baselines(rows: list[dict]) -> dict[tuple, dict]:
    """The k = 0 baseline of each (mode, checkpoint, concurrency, prompt kind, temperature),
    pooled over implementations.

    Without speculation no drafter exists, so both implementations run the same engine code;
    pooling their processes halves the process-to-process noise of the denominator every
    speed-up shares. Tokens/s and step time are medians over the pooled per-process medians.
    """
    pooled: dict[tuple, dict] = {}
    for row in rows:
        if row.get("k") != 0 or row.get("floor_only"):  # a floor has its own prompts: not a baseline
            continue
        base = pooled.setdefault(baseline_key(row),
                                 {"tok_s": [], "step_ms": [], "rows": [], "impls": []})
        base["impls"].append(row.get("impl"))
        base["tok_s"] += row.get("output_tok_s_processes") or [row.get("output_tok_s")]
        steps = row.get("steps_processes") or [row.get("steps") or {}]
        base["step_ms"] += [s.get("step_ms") for s in steps]
        base["rows"] += [s.get("tokens_per_step") for s in steps]
    return {key: {"output_tok_s": median(b["tok_s"]), "step_ms": median(b["step_ms"]),
                  "tokens_per_step": median(b["rows"]),
                  "processes": len(b["tok_s"]), "impls": b["impls"]}
            for key, b in pooled.items()}


def floors(rows: list[dict]) -> dict[tuple, dict]:
    """Decode-step time of every k = 0 measurement whose decode steps were full (median rows per
    step = its concurrency), per baseline key: the floor rows, and the sweep's own k = 0 rows where
    their batches were full. Engine processes pooled, as for the baselines."""
    pooled: dict[tuple, list[float]] = {}
    for row in rows:
        if row.get("k") != 0:
            continue
        for steps in row.get("steps_processes") or [row.get("steps") or {}]:
            if steps.get("step_ms") and steps.get("tokens_per_step") == row["concurrency"]:
                pooled.setdefault(baseline_key(row), []).append(steps["step_ms"])
    return {key: {"step_ms": median(values), "tokens_per_step": key[2]}
            for key, values in pooled.items()}


def floor_of(floor_steps: dict[tuple, dict], row: dict) -> dict | None:
    """The full k = 0 step with (k + 1) * c rows in flight for ``row``; None where none was
    measured full (a pass with fewer prompts than rows never fills the batch)."""
    rows = (row["k"] + 1) * row["concurrency"]
    return floor_steps.get(baseline_key({**row, "concurrency": rows}))


def add_derived(rows: list[dict]) -> list[dict]:
    """Fill speed-up against the pooled k = 0 baseline, the ideal bound and measured/ideal where
    step timings exist, and tokens/s relative to in-tree at the same k."""
    bases, floor_steps = baselines(rows), floors(rows)
    in_tree = {_key(r, *SAME_CONFIG_KEY): r for r in rows if r.get("impl") == "in-tree"}
    for row in rows:
        base = bases.get(baseline_key(row))
        if row.get("floor_only"):  # its own k = 0, prompts repeated: the floor table reads it
            base = {"output_tok_s": row.get("output_tok_s"),
                    "step_ms": (row.get("steps") or {}).get("step_ms"),
                    "processes": len(row.get("output_tok_s_processes") or [None])}
        row["baseline"] = base
        row["speedup"] = (row["output_tok_s"] / base["output_tok_s"]
                          if base and base.get("output_tok_s") and row.get("output_tok_s")
                          else None)
        other = in_tree.get(_key(row, *SAME_CONFIG_KEY))
        row["vs_in_tree"] = (row["output_tok_s"] / other["output_tok_s"]
                             if other and row.get("impl") != "in-tree"
                             and other.get("output_tok_s") and row.get("output_tok_s") else None)
        for name in DERIVED:
            row[name] = None
        k, tau = row.get("k"), row.get("mean_acceptance_length")
        t0 = (base or {}).get("step_ms")
        steps = row.get("steps") or {}
        if k == 0 and row["speedup"] is not None:
            row["ideal_speedup"], row["measured_over_ideal"] = 1.0, row["speedup"]
        elif k and tau and t0 and steps.get("draft_ms") is not None:
            row["draft_cost_ratio"] = steps["draft_ms"] / (k * t0)
            row["verify_cost_ratio"] = steps["target_ms"] / t0
            row["ideal_speedup"] = ideal_speedup(tau, k, row["draft_cost_ratio"])
            if row["speedup"] is not None:
                row["measured_over_ideal"] = row["speedup"] / row["ideal_speedup"]
            floor = floor_of(floor_steps, row)
            if floor:
                row["floor_rows"] = floor["tokens_per_step"]
                row["floor_ratio"] = floor["step_ms"] / t0
                row["verify_over_floor"] = steps["target_ms"] / floor["step_ms"]
                row["break_even_acceptance_length"] = row["floor_ratio"] + k * row["draft_cost_ratio"]
                row["payoff_bound"] = (k + 1) / row["break_even_acceptance_length"]
        row["implausible"] = row_problems(row)
    return rows


def finish_row(row: dict, runs: list[dict]) -> dict:
    """Aggregate per-repeat measurements: summed counters, medians of latencies, and for rates
    and step timings the median over engine processes of each process's median."""
    counters = total_counters(r.get("spec_decode") for r in runs)
    processes: dict[int, list[dict]] = {}
    for run in runs:
        processes.setdefault(run.get("process", 0), []).append(run)
    per_process = [median(r.get("output_tok_s") for r in rs) for rs in processes.values()]
    tokens = [r.pop("token_ids", None) for r in runs]
    if tokens and tokens[0] is not None:
        # Generated token ids once (every pass replays the same requests), and whether the
        # replays agreed: what lets acceptance count one pass's drafts, and tokens be compared.
        row["token_ids"] = tokens[0]
        row["replays_agree"] = all(t == tokens[0] for t in tokens)
    row["runs"] = runs
    row["output_tok_s"] = median(per_process)
    row["output_tok_s_processes"] = per_process
    row["spec_decode"] = counters.summary()
    row["acceptance_rate"] = counters.acceptance_rate
    row["mean_acceptance_length"] = counters.mean_acceptance_length
    row["per_position_acceptance"] = counters.per_position_acceptance
    row["ttft_ms"] = median_of([r.get("ttft_ms") for r in runs])
    row["tpot_ms"] = median_of([r.get("tpot_ms") for r in runs])
    if any(r.get("steps") for r in runs):
        row["steps_processes"] = [median_of([r.get("steps") for r in rs])
                                  for rs in processes.values()]
        row["steps"] = median_of(row["steps_processes"])
    if any(r.get("by_drafted_k") for r in runs):
        row["by_drafted_k"] = by_drafted_k(r.get("by_drafted_k") for r in runs)
    return row


def by_drafted_k(per_run) -> dict[str, dict]:
    """Decode steps by the k they drafted, over every run of a row: their number summed, the
    median of the runs' median step times (ms)."""
    steps: dict[str, int] = {}
    times: dict[str, list[float]] = {}
    for groups in per_run:
        for k, group in (groups or {}).items():
            steps[k] = steps.get(k, 0) + group["steps"]
            times.setdefault(k, []).append(group["step_ms"])
    return {k: {"steps": steps[k], "step_ms": median(times[k])}
            for k in sorted(steps, key=int)}
