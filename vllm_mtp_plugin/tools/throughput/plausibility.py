"""What measurements of speculative decoding can physically be, and where a run's are not.

A decode step that verifies k drafts per request does everything a plain step of the same batch
does, and more: it cannot be cheaper. And a step emits on average tau tokens per request (the mean
acceptance length), so with verification costing at least the floor (a plain step with k + 1
rows per request, ``floor_ratio`` plain steps; 1 where unmeasured) speculation cannot speed
decoding up by more than tau / floor. A measurement that breaks either was disturbed (other work
slowed one engine and not another) or mis-measured; ``bench`` marks it and ``tune`` re-measures
or refuses to recommend from it.
"""

from __future__ import annotations

# Timer noise between two engines' median steps: a step with drafts may read up to this share
# below a plain step before it counts as impossible.
STEP_TOLERANCE = 0.05
# Expected or measured speed-ups may exceed tau / floor by this share before they count.
SPEEDUP_TOLERANCE = 0.05


def cheaper_than_plain(k: int, concurrency: int, step_ms: float | None,
                       plain_step_ms: float | None,
                       what: str = "a decode step with {k} draft(s) per request") -> str | None:
    """A problem when a step with ``k`` drafts per request (or its verification alone) timed
    below a plain step of the same batch."""
    if not k or step_ms is None or not plain_step_ms:
        return None
    if step_ms < (1 - STEP_TOLERANCE) * plain_step_ms:
        return (f"k = {k}, c = {concurrency}: {what.format(k=k)} took {step_ms:.1f} ms, less "
                f"than a plain decode step of the same batch ({plain_step_ms:.1f} ms)")
    return None


def beyond_acceptance(k: int, concurrency: int, speedup: float | None, tau: float | None,
                      floor_ratio: float | None = None, what: str = "speed-up") -> str | None:
    """A problem when a speed-up exceeds the acceptance length over the verification floor."""
    if not k or speedup is None or not tau:
        return None
    bound = tau / max(1.0, floor_ratio or 1.0)
    if speedup > bound * (1 + SPEEDUP_TOLERANCE):
        return (f"k = {k}, c = {concurrency}: {what} {speedup:.2f}× exceeds what acceptance "
                f"length {tau:.2f} allows" + (f" over the floor {floor_ratio:.2f}"
                                               if floor_ratio and floor_ratio > 1 else "")
                + f" (at most {bound:.2f}×)")
    return None


def tune_problems(points: list[dict], taus: list[float],
                  expected_speedup: dict[int, dict[int, float]]) -> list[str]:
    """Every impossibility in tune's measurements (``points``: per (k, c) the median decode step)
    and in the speed-ups it expects from them."""
    plain = {p["concurrency"]: p.get("step_ms") for p in points if p["k"] == 0}
    problems = [cheaper_than_plain(p["k"], p["concurrency"], p.get("step_ms"),
                                   plain.get(p["concurrency"])) for p in points]
    problems += [beyond_acceptance(k, c, speedup, taus[k] if k < len(taus) else None,
                                   what="expected speed-up")
                 for c, by_k in expected_speedup.items() for k, speedup in by_k.items()]
    return [p for p in problems if p]


def row_problems(row: dict) -> list[str]:
    """Every impossibility in one bench row (after ``analysis.add_derived``)."""
    k, c = row.get("k"), row.get("concurrency")
    base = row.get("baseline") or {}
    target_ms = (row.get("steps") or {}).get("target_ms")
    # adaptive k's rows name the largest k it may choose; its steps drafted 0 .. k
    what = ("a step of adaptive k (0 to {k} drafts per request)" if row.get("impl") == "adaptive"
            else "verifying {k} draft(s) per request")
    problems = [cheaper_than_plain(k, c, target_ms, base.get("step_ms"), what),
                beyond_acceptance(k, c, row.get("speedup"), row.get("mean_acceptance_length"),
                                  row.get("floor_ratio"))]
    return [p for p in problems if p]
