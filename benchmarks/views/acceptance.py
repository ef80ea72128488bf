"""Acceptance of the trained tiny DeepSeek per prompt kind and temperature, from vLLM's counters
(``benchmarks/results/trained``), with the drafts counted and 95 % intervals."""

from __future__ import annotations

from vllm_mtp_plugin.tools.stats import distinct_drafts, wilson

from .common import bench_rows, one_row, rate, source_line, table

TRAINED = "benchmarks/results/trained/results.json"
KINDS = ("code", "prose", "chat")


DRAFTS = ("greedy", "probabilistic")


TRAINED_V4 = "benchmarks/results/trained-v4/results.json"


def _temperatures(results: str = TRAINED) -> list[float]:
    return sorted({r["temperature"] for r in bench_rows(results, impl="plugin")})


def _drafts(temperature: float, results: str = TRAINED) -> tuple[str, ...]:
    """The draft methods a temperature's rows show: at T = 0 both draft by argmax (checked in
    ``_same_at_greedy``), so greedy alone."""
    measured = {r.get("draft_sample_method") for r in bench_rows(results, temperature=temperature)
                if r["k"]}
    return tuple(d for d in DRAFTS if d in measured and (temperature or d == "greedy"))


def trained_row(impl: str, k: int, kind: str, temperature: float, drafts: str = "greedy",
                results: str = TRAINED) -> dict:
    """One row of a trained model's run; k = 0 rows have no draft method."""
    return one_row(results, impl=impl, k=k, prompts=kind, temperature=temperature,
                   draft_sample_method=drafts if k else None)


def _same_counters(k: int, kind: str, temperature: float, drafts: str,
                   results: str = TRAINED) -> bool | None:
    """Plugin and in-tree rows with the same counters (None: the run has no in-tree rows)."""
    if not bench_rows(results, impl="in-tree"):
        return None
    rows = [trained_row(impl, k, kind, temperature, drafts, results)
            for impl in ("plugin", "in-tree")]
    return rows[0]["spec_decode"] == rows[1]["spec_decode"]


def _same_at_greedy(results: str = TRAINED) -> bool | None:
    """At T = 0 probabilistic drafts are argmax drafts: the same counters as greedy ones
    (None: no probabilistic rows at T = 0 to compare)."""
    rows = bench_rows(results, impl="plugin", temperature=0.0, draft_sample_method="probabilistic")
    if not rows:
        return None
    return all(trained_row("plugin", r["k"], r["prompts"], 0.0, "probabilistic", results)
               ["spec_decode"] == trained_row("plugin", r["k"], r["prompts"], 0.0, "greedy",
                                              results)["spec_decode"] for r in rows)


def trained_acceptance(results: str = TRAINED) -> str:
    """Per position at k = 1, 2, 3 and the acceptance length, per kind, temperature and draft
    method; drafts counted once."""
    rows, same_counters = [], []
    for temperature in _temperatures(results):
        for drafts in _drafts(temperature, results):
            for kind in KINDS:
                cells, lengths, counted = [kind, f"{temperature:g}", drafts], [], []
                for k in (1, 2, 3):
                    row = trained_row("plugin", k, kind, temperature, drafts, results)
                    cells.append(" ".join(rate(p) for p in row["per_position_acceptance"]))
                    lengths.append(rate(row["mean_acceptance_length"]))
                    counted.append(f"{distinct_drafts(row)[0]:.0f}")
                    same_counters.append(_same_counters(k, kind, temperature, drafts, results))
                rows.append(cells + [" / ".join(lengths), " / ".join(counted)])
    text = table(["prompts", "T", "draft method", "k = 1", "k = 2", "k = 3",
                  "acceptance length k = 1 / 2 / 3", "drafts k = 1 / 2 / 3"], rows)
    same = ("vLLM's in-tree class was not run (on CPU its V4 drafter is a stub)"
            if None in same_counters else
            "vLLM's in-tree class gave the same counters in every row" if all(same_counters) else
            "**the in-tree class's counters differ in some rows** (see the results file)")
    same_at_greedy = _same_at_greedy(results)
    greedy = ("" if same_at_greedy is None else
              "; at T = 0 probabilistic drafts gave the greedy rows' counters (both draft by "
              "argmax)" if same_at_greedy else
              "; **at T = 0 probabilistic drafts gave other counters than greedy ones**")
    return f"{text}\n\nPlugin; {same}{greedy}. {source_line(results)}"


def _interval_cells(drafts: float, accepted: list[float]) -> list[str]:
    cells = []
    for a in accepted:
        low, high = wilson(a, drafts)
        cells.append(f"{a / drafts:.2f} [{low:.2f}–{high:.2f}]")
    return cells


def trained_intervals() -> str:
    """k = 3 per position with its 95 % interval: what a comparison between kinds can rest on."""
    rows = []
    for temperature in _temperatures():
        for drafts in _drafts(temperature):
            for kind in KINDS:
                row = trained_row("plugin", 3, kind, temperature, drafts)
                counted, accepted = distinct_drafts(row)
                rows.append([kind, f"{temperature:g}", drafts, f"{counted:.0f}",
                             *_interval_cells(counted, accepted)])
    text = table(["prompts", "T", "draft method", "drafts counted", "position 1", "position 2",
                  "position 3"], rows)
    return (f"{text}\n\nk = 3, plugin; 95 % Wilson intervals over the drafts of one pass (engine "
            f"processes replay the same requests). {source_line(TRAINED)}")


def _pooled_rows(k: int, temperature: float, drafts: str, impl: str = "plugin") -> list[dict]:
    return [trained_row(impl, k, kind, temperature, drafts) for kind in KINDS]


def trained_sampling() -> str:
    """Sampled requests, greedy against probabilistic drafts: per position at k = 3 over all
    kinds with 95 % intervals, acceptance lengths, and the speed-up over k = 0 per kind."""
    rows = []
    for temperature in [t for t in _temperatures() if t > 0]:
        for drafts in _drafts(temperature):
            counted, accepted = _pooled(_pooled_rows(3, temperature, drafts))
            lengths = []
            for k in (1, 2, 3):
                n, a = _pooled(_pooled_rows(k, temperature, drafts))
                lengths.append(rate(1 + sum(a) / n))
            speedups = [r.get("speedup") for r in _pooled_rows(3, temperature, drafts)]
            rows.append([f"{temperature:g}", drafts, f"{counted:.0f}",
                         " / ".join(_interval_cells(counted, accepted)), " / ".join(lengths),
                         " / ".join("–" if v is None else f"{v:.2f}×" for v in speedups)])
    text = table(["T", "draft method", "drafts counted (k = 3)", "per position at k = 3 [95 %]",
                  "acceptance length k = 1 / 2 / 3", "speed-up k = 3: code / prose / chat"], rows)
    return (f"{text}\n\nPlugin, code + prose + chat pooled, seeded requests (the same random "
            f"streams for every configuration); speed-up over k = 0 of the same kind and "
            f"temperature, median of the engine processes. {source_line(TRAINED)}")


def sampling_separation() -> str:
    """Whether probabilistic drafts' pooled k = 3 intervals separate from greedy drafts' at every
    position and temperature > 0 (a generated "higher" or "within noise" with where)."""
    from vllm_mtp_plugin.tools.stats import comparison

    verdicts = []
    for temperature in [t for t in _temperatures() if t > 0]:
        pooled = {d: _pooled(_pooled_rows(3, temperature, d)) for d in DRAFTS}
        for i in range(3):
            a, b = (wilson(pooled[d][1][i], pooled[d][0]) for d in ("probabilistic", "greedy"))
            verdicts.append((temperature, i + 1, comparison(a, b)))
    if all(v == "higher" for *_, v in verdicts):
        return "their 95 % intervals above the greedy drafts' at every position and temperature"
    return "; ".join(f"T = {t:g} position {i}: {v}" for t, i, v in verdicts)


def first_position_range(temperature: float, drafts: str = "greedy") -> str:
    """"0.68–0.79": the first position's acceptance over the prompt kinds at k = 1."""
    values = [trained_row("plugin", 1, kind, temperature, drafts)["per_position_acceptance"][0]
              for kind in KINDS]
    return f"{min(values):.2f}–{max(values):.2f}"


def k3_positions(kind: str) -> str:
    """"0.77 / 0.45 / 0.34": greedy acceptance per position at k = 3 for one prompt kind."""
    row = trained_row("plugin", 3, kind, 0.0)
    return " / ".join(rate(p) for p in row["per_position_acceptance"])


V4TINY = "benchmarks/results/v4tiny/results.json"


def v4tiny_acceptance() -> str:
    """DeepSeek-V4 MTP through the interpreter harness: acceptance only (its tokens/s time
    Triton's interpreter, not V4 on a CPU)."""
    rows = []
    for row in bench_rows(V4TINY, floor_only=False):
        if not row["k"]:
            continue
        drafts, accepted = distinct_drafts(row)
        cells = [f"{a / drafts:.2f} [{low:.2f}–{high:.2f}]" for a, (low, high) in
                 ((a, wilson(a, drafts)) for a in accepted)]
        rows.append([row["checkpoint"], str(row["k"]), f"{drafts:.0f}", " / ".join(cells),
                     rate(row["mean_acceptance_length"]), row["compilation"]])
    text = table(["checkpoint", "k", "drafts", "per position [95 % interval]", "acceptance length",
                  "engine"], rows)
    return (f"{text}\n\nPlugin, bf16 target, Model Runner V2 through the interpreter harness. "
            f"{source_line(V4TINY)}")


NO_PLUGIN = "benchmarks/results/no-plugin/results.json"
IMPL_NAMES = {"plugin": "plugin", "in-tree": "vLLM's class + the plugin's fixes (`MTP_PLUGIN=off`)",
              "vllm": "vLLM alone (`VLLM_PLUGINS=\"\"`)"}


def _pooled(rows: list[dict]) -> tuple[float, list[float]]:
    """Drafts and accepted per position over several rows (prompt kinds), each counted once."""
    drafts, accepted = 0.0, []
    for row in rows:
        n, a = distinct_drafts(row)
        drafts += n
        accepted = [x + y for x, y in zip(accepted, a)] if accepted else list(a)
    return drafts, accepted


def _same_tokens(impl: str, k: int) -> str:
    """"12 / 12": greedy requests whose tokens at k equal the same implementation's at k = 0."""
    same = total = 0
    for row in bench_rows(NO_PLUGIN, impl=impl, k=k, temperature=0.0):
        reference = one_row(NO_PLUGIN, impl=impl, k=0, prompts=row["prompts"], temperature=0.0)
        pairs = list(zip(row.get("token_ids") or [], reference.get("token_ids") or []))
        same += sum(a == b for a, b in pairs)
        total += len(pairs)
    return f"{same} / {total}" if total else "not stored"


def no_plugin_table() -> str:
    """k = 2 acceptance per temperature for the plugin, the in-tree class with the plugin's fixes,
    and vLLM with no plugin at all; whether greedy output stays that of k = 0."""
    rows = []
    for impl, name in IMPL_NAMES.items():
        for temperature in sorted({r["temperature"] for r in bench_rows(NO_PLUGIN, impl=impl)}):
            drafts, accepted = _pooled(bench_rows(NO_PLUGIN, impl=impl, k=2, temperature=temperature))
            cells = [f"{a / drafts:.2f} [{low:.2f}–{high:.2f}]" for a, (low, high) in
                     ((a, wilson(a, drafts)) for a in accepted)]
            rows.append([name, f"{temperature:g}", f"{drafts:.0f}", *cells,
                         _same_tokens(impl, 2) if temperature == 0 else ""])
    text = table(["implementation", "T", "drafts", "position 1", "position 2",
                  "greedy requests with k = 0's tokens"], rows)
    registered = {r["impl"]: r.get("plugin_registered") for r in bench_rows(NO_PLUGIN)}
    return (f"{text}\n\nk = 2, trained model, code + prose + chat prompts pooled, greedy drafts; "
            f"plugin registered in the engine: "
            + ", ".join(f"{impl} {'yes' if v else 'no'}" for impl, v in registered.items())
            + f". {source_line(NO_PLUGIN)}")


def kinds_compared() -> str:
    """How far the prompt kinds' acceptance can be told apart: the drafts per row, and the
    positions where two kinds' 95 % intervals lie apart (all others overlap)."""
    from itertools import combinations

    from vllm_mtp_plugin.tools.stats import separated

    counts, apart, compared = [], [], 0
    for temperature in _temperatures():
        for drafts in _drafts(temperature):
            for k in (1, 2, 3):
                rows = {kind: trained_row("plugin", k, kind, temperature, drafts) for kind in KINDS}
                n = {kind: distinct_drafts(r) for kind, r in rows.items()}
                counts += [c for c, _ in n.values()]
                for i in range(k):
                    for a, b in combinations(KINDS, 2):
                        compared += 1
                        ia, ib = (wilson(n[x][1][i], n[x][0]) for x in (a, b))
                        if separated(ia, ib):
                            high, low = (a, b) if ia[0] > ib[1] else (b, a)
                            apart.append(f"{high} above {low} at T = {temperature:g} "
                                         f"({drafts} drafts), k = {k}, position {i + 1}")
    where = ("none" if not apart else f"{len(apart)}: " + "; ".join(apart))
    return (f"{min(counts):.0f}–{max(counts):.0f} drafts per row; of {compared} comparisons of two "
            f"kinds at one position, those whose 95 % intervals lie apart: {where}")
