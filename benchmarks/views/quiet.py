"""Rows that shared the machine, kept out of the baselines the docs' speed-ups stand on, and
verification timed below its own floor.

The bench re-runs an engine process during which other work took more than
``interference.BUSY_SHARE`` of the CPUs (``discarded_disturbed``), and pools every k = 0 row of a
checkpoint and concurrency into one baseline. The processes it keeps can still add up to a row
that shared the machine for a good part of its time (the plugin's k = 0 row of
``results/offline``: 15.9 CPU-seconds of other work, where the other rows of that run have about
one). Such a row is shown with its "other CPU s" and named under its table; a k = 0 row of that
kind is left out of the baseline, and the speed-ups that stood on it (with what T0 scales: draft
and verify cost, the ideal bound, the floor) are derived again from the quiet k = 0 rows alone.
"""

from __future__ import annotations

import copy
import json
import statistics
from functools import lru_cache

from vllm_mtp_plugin.tools.throughput.plausibility import cheaper_than_plain
from vllm_mtp_plugin.tools.engine.interference import BUSY_SHARE

from .common import load, percent

# Half the share at which the bench re-runs one engine process: a row whose kept processes
# together took more shared the machine (the quiet rows of the stored runs stay near 1 %).
SHARED_SHARE = BUSY_SHARE / 2


def cpus(relative: str) -> int:
    env = load(relative).get("environment") or {}
    return env.get("cpus") or 1


def share(row: dict, cpus: int) -> float | None:
    """Other processes' CPU time over the machine's CPU time while the row ran."""
    i = row.get("interference") or {}
    if i.get("other_cpu_s") is None or not i.get("wall_s"):
        return None
    return i["other_cpu_s"] / (i["wall_s"] * cpus)


def shared_machine(row: dict, cpus: int) -> bool:
    return (share(row, cpus) or 0.0) > SHARED_SHARE


def _median(values) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def pooled_baseline(k0_rows: list[dict]) -> dict:
    """Tokens/s and decode step of k = 0 rows pooled as the bench pools them: the median over
    every engine process's median."""
    return {"output_tok_s": _median(v for r in k0_rows for v in r.get("output_tok_s_processes")
                                    or [r.get("output_tok_s")]),
            "step_ms": _median(s.get("step_ms") for r in k0_rows
                               for s in r.get("steps_processes") or [r.get("steps") or {}]),
            "impls": [r["impl"] for r in k0_rows]}


def rebase(row: dict, base: dict) -> None:
    """``row``'s figures against another k = 0 baseline: the speed-up, and every ratio to T0."""
    old_t0, new_t0 = (row.get("baseline") or {}).get("step_ms"), base.get("step_ms")
    scale = old_t0 / new_t0 if old_t0 and new_t0 else None
    row["baseline"] = base
    if row.get("output_tok_s") and base.get("output_tok_s"):
        row["speedup"] = row["output_tok_s"] / base["output_tok_s"]
    k = row.get("k")
    if scale:
        for name in ("draft_cost_ratio", "verify_cost_ratio", "floor_ratio"):
            if row.get(name) is not None:
                row[name] *= scale
    if k == 0 and row.get("speedup") is not None:
        row["ideal_speedup"] = 1.0
    if k and row.get("draft_cost_ratio") is not None and row.get("mean_acceptance_length"):
        row["ideal_speedup"] = row["mean_acceptance_length"] / (1 + k * row["draft_cost_ratio"])
        if row.get("floor_ratio") is not None:
            row["break_even_acceptance_length"] = row["floor_ratio"] + k * row["draft_cost_ratio"]
            row["payoff_bound"] = (k + 1) / row["break_even_acceptance_length"]
    if row.get("speedup") is not None and row.get("ideal_speedup"):
        row["measured_over_ideal"] = row["speedup"] / row["ideal_speedup"]


@lru_cache(maxsize=None)
def quiet_rows(relative: str) -> tuple[list[dict], list[dict]]:
    """A bench results file's rows with every baseline pooled over quiet k = 0 rows only, and the
    k = 0 rows left out (none: the stored rows as they are)."""
    rows, n = load(relative)["results"], cpus(relative)
    left_out = [r for r in rows if r["k"] == 0 and not r.get("floor_only")
                and shared_machine(r, n)]
    if not left_out:
        return rows, []
    rows = copy.deepcopy(rows)
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("baseline") and not r.get("floor_only"):
            groups.setdefault(json.dumps(r["baseline"], sort_keys=True), []).append(r)
    for members in groups.values():
        bases = [r for r in members if r["k"] == 0]
        quiet = [r for r in bases if not shared_machine(r, n)]
        if len(quiet) == len(bases) or not quiet:
            continue
        base = pooled_baseline(quiet)
        for r in members:
            rebase(r, base)
    return rows, left_out


def row_name(r: dict) -> str:
    verify = " (verify off)" if r.get("mla_verify") == "off" else ""
    return (f"{r['impl']}{verify} k = {r['k']}" + (f", c = {r['concurrency']}"
                                                  if r.get("concurrency", 1) != 1 else "")
            + (f", {r['prompts']}" if r.get("prompts") not in (None, "all") else "")
            + (" (floor)" if r.get("floor_only") else ""))


def shared_line(relative: str) -> str:
    """" Shared the machine ...": the rows above ``SHARED_SHARE``, and the baselines re-pooled."""
    rows, left_out = quiet_rows(relative)
    n = cpus(relative)
    shared = [f"{row_name(r)} ({r['interference']['other_cpu_s']:.1f} CPU-s in "
              f"{r['interference']['wall_s']:.0f} s, {percent(share(r, n))} of the CPUs)"
              for r in load(relative)["results"] if shared_machine(r, n)]
    if not shared:
        return ""
    text = (f" **Shared the machine** (other processes took more than {percent(SHARED_SHARE)} of its "
            f"CPU time; figures shown, not quoted in the text): {', '.join(shared)}.")
    if left_out:
        text += (" Left out of the k = 0 baseline (the stored `speedup` pools it): "
                 + ", ".join(row_name(r) for r in left_out)
                 + "; speed-ups and the ratios to T0 here are against the other k = 0 rows.")
    return text


def floor_line(rows: list[dict]) -> str:
    """" **Below its floor** ...": rows whose verification timed below its floor."""
    found = [f"{r['checkpoint']} {r['impl']}" + (" (verify off)" if r.get("mla_verify") == "off"
                                                  else "") + f", {problem}"
             for r in rows for problem in floor_problems(r)]
    return (" **Verification below its floor** (impossible for one engine: the floor's engine "
            "processes ran slower than the row's, this machine's process-to-process spread; the "
            "floor, verify / floor and the best possible speed-up of these rows are not to be "
            "used): " + "; ".join(found) + ".") if found else ""


def floor_problems(row: dict) -> list[str]:
    """Verification timed below its floor (a plain step with k + 1 rows per request), beyond the
    timer tolerance of ``plausibility``: the floor's engine processes ran slower than the row's."""
    k, target = row.get("k"), (row.get("steps") or {}).get("target_ms")
    ratio = row.get("verify_over_floor")
    if not k or not target or not ratio:
        return []
    problem = cheaper_than_plain(k, row.get("concurrency"), target, target / ratio,
                                 f"verifying {{k}} draft(s) per request (verify / floor {ratio:.2f})")
    return [problem] if problem else []
