"""From measurements to a choice of k: expected throughput per (batch size, k), the best fixed k
per concurrency (V1 runner) and vLLM's batch-size schedule (Model Runner V2).

Expected throughput. A decode step of c requests with k drafts each emits c * tau_k tokens, where
tau_k = 1 + a_1 + ... + a_k is the mean acceptance length at k, from the per-position acceptance
a_i measured at k = max-k (a draft at position i is accepted or not whatever comes after it, so
the first k positions of a longer run are what a run at k would see). It costs the measured
decode step at (k, c) plus the time each step spends outside the model runner. A request of N
output tokens takes its prompt's prefill (measured per pass: the steps that start requests) and
(N - 1) / tau_k decode steps, so for c requests at once

``tok/s(c, k) = c * N / (prefill(k, c) + (N - 1) / tau_k * (step(k, c) + outside(k, c)))``

with N = ``--max-tokens`` (set it to your typical output length); k = 0 has tau = 1.

Draft method. Sampled traffic is measured with each draft method (greedy, probabilistic); each
gives its own tau and step costs, hence its own best k per concurrency. vLLM takes one method per
engine, so tune recommends the one whose best k gains most over no speculation across the
concurrencies measured (mean speed-up; on a tie, the better best k > 0; then greedy, vLLM's
default).
"""

from __future__ import annotations


def acceptance_lengths(counters: dict, max_k: int) -> list[float]:
    """tau_0 .. tau_max_k from the counters of the k = max-k engine."""
    drafts = counters.get("num_drafts") or 0
    per_position = list(counters.get("accepted_per_position") or [])
    rates = [(per_position[i] / drafts if drafts and i < len(per_position) else 0.0)
             for i in range(max_k)]
    taus = [1.0]
    for rate in rates:
        taus.append(taus[-1] + rate)
    return taus


def predictions(points: list[dict], taus: list[float],
                max_tokens: int) -> dict[int, dict[int, float]]:
    """Expected output tokens/s, ``{concurrency: {k: tok/s}}``."""
    table: dict[int, dict[int, float]] = {}
    for p in points:
        if p.get("step_ms") is None:
            continue
        step_s = (p["step_ms"] + (p.get("outside_ms") or 0.0)) / 1e3
        seconds = (p.get("prefill_ms") or 0.0) / 1e3 + (max_tokens - 1) / taus[p["k"]] * step_s
        table.setdefault(p["concurrency"], {})[p["k"]] = p["concurrency"] * max_tokens / seconds
    return table


def best_k(expected: dict[int, dict[int, float]]) -> dict[int, int]:
    """The fastest k per concurrency (the smaller k on a tie: fewer drafts, less memory); only
    concurrencies measured without speculation too (the comparison every choice needs)."""
    return {c: max(sorted(by_k), key=lambda k: by_k[k]) for c, by_k in sorted(expected.items())
            if 0 in by_k}


def mean_best_speedup(expected: dict[int, dict[int, float]], best: dict[int, int],
                      speculating: bool = False) -> float:
    """The speed-up over k = 0 of each concurrency's best k (``speculating``: best k > 0),
    averaged over concurrencies."""
    gains = []
    for c in best:
        by_k = expected[c]
        if not by_k.get(0):
            continue
        ks = [k for k in by_k if k] if speculating else [best[c]]
        if ks:
            gains.append(max(by_k[k] for k in ks) / by_k[0])
    return sum(gains) / len(gains) if gains else 0.0


def preferred_draft_method(gains: dict[str, tuple[float, float]]) -> str:
    """The draft method with the largest mean best speed-up; where they tie (e.g. no k pays with
    either, both 1.0), the larger mean speed-up of the best k > 0, i.e. the method to speculate
    with; the first listed (greedy) on a full tie."""
    return max(gains, key=lambda m: (*gains[m], -list(gains).index(m)))


def schedule(best: dict[int, int]) -> list[list[int]]:
    """vLLM's ``num_speculative_tokens_per_batch_size``: inclusive batch-size ranges and their k.

    Measured concurrency c_i covers batch sizes c_i .. c_(i+1) - 1 (the first range starts at 1,
    as vLLM requires; the last k carries on to max_num_seqs, as vLLM's lookup does); neighbours
    with the same k merge. k = 0 is allowed: vLLM drafts nothing at those batch sizes."""
    cs = sorted(best)
    ranges: list[list[int]] = []
    for i, c in enumerate(cs):
        start = 1 if i == 0 else c
        end = cs[i + 1] - 1 if i + 1 < len(cs) else c
        if ranges and ranges[-1][2] == best[c]:
            ranges[-1][1] = end
        else:
            ranges.append([start, end, best[c]])
    return ranges


def speculative_config(ranges: list[list[int]],
                       draft_sample_method: str = "greedy") -> dict | None:
    """The ``--speculative-config`` for the schedule (with the draft method where it is not
    vLLM's default); None where no batch size gains from MTP."""
    top = max(k for _, _, k in ranges)
    if top == 0:
        return None
    config = {"method": "mtp", "num_speculative_tokens": top}
    if draft_sample_method != "greedy":
        config["draft_sample_method"] = draft_sample_method
    if len({k for _, _, k in ranges}) > 1:
        config["num_speculative_tokens_per_batch_size"] = ranges
    return config
