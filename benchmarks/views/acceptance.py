"""Acceptance of the trained tiny DeepSeek per prompt kind and temperature, from vLLM's counters
(``benchmarks/results/trained``), with the drafts counted and 95 % intervals."""

from __future__ import annotations

from vllm_mtp_plugin.tools.bench.stats import distinct_drafts, wilson

from .common import bench_rows, one_row, rate, source_line, table

TRAINED = "benchmarks/results/trained/results.json"
KINDS = ("code", "prose", "chat")


def _temperatures() -> list[float]:
    return sorted({r["temperature"] for r in bench_rows(TRAINED, impl="plugin")})


def _same_counters(k: int, kind: str, temperature: float) -> bool:
    rows = [one_row(TRAINED, impl=impl, k=k, prompts=kind, temperature=temperature)
            for impl in ("plugin", "in-tree")]
    return rows[0]["spec_decode"] == rows[1]["spec_decode"]


def trained_acceptance() -> str:
    """Per position at k = 1, 2, 3 and the acceptance length; drafts counted once."""
    rows, identical = [], True
    for temperature in _temperatures():
        for kind in KINDS:
            cells, lengths, drafts = [kind, f"{temperature:g}"], [], []
            for k in (1, 2, 3):
                row = one_row(TRAINED, impl="plugin", k=k, prompts=kind, temperature=temperature)
                cells.append(" ".join(rate(p) for p in row["per_position_acceptance"]))
                lengths.append(rate(row["mean_acceptance_length"]))
                drafts.append(f"{distinct_drafts(row)[0]:.0f}")
                identical &= _same_counters(k, kind, temperature)
            rows.append(cells + [" / ".join(lengths), " / ".join(drafts)])
    text = table(["prompts", "T", "k = 1", "k = 2", "k = 3", "acceptance length k = 1 / 2 / 3",
                  "drafts k = 1 / 2 / 3"], rows)
    same = ("vLLM's in-tree class gave the same counters in every row" if identical else
            "**the in-tree class's counters differ in some rows** (see the results file)")
    return f"{text}\n\nPlugin; {same}. {source_line(TRAINED)}"


def trained_intervals() -> str:
    """k = 3 per position with its 95 % interval: what a comparison between kinds can rest on."""
    rows = []
    for temperature in _temperatures():
        for kind in KINDS:
            row = one_row(TRAINED, impl="plugin", k=3, prompts=kind, temperature=temperature)
            drafts, accepted = distinct_drafts(row)
            cells = []
            for a in accepted:
                low, high = wilson(a, drafts)
                cells.append(f"{a / drafts:.2f} [{low:.2f}–{high:.2f}]")
            rows.append([kind, f"{temperature:g}", f"{drafts:.0f}", *cells])
    text = table(["prompts", "T", "drafts", "position 1", "position 2", "position 3"], rows)
    return (f"{text}\n\nk = 3, plugin; 95 % Wilson intervals over the drafts of one pass (engine "
            f"processes replay the same requests). {source_line(TRAINED)}")


def first_position_range(temperature: float) -> str:
    """"0.68–0.79": the first position's acceptance over the prompt kinds at k = 1."""
    values = [one_row(TRAINED, impl="plugin", k=1, prompts=kind,
                      temperature=temperature)["per_position_acceptance"][0] for kind in KINDS]
    return f"{min(values):.2f}–{max(values):.2f}"


def k3_positions(kind: str) -> str:
    """"0.77 / 0.45 / 0.34": greedy acceptance per position at k = 3 for one prompt kind."""
    row = one_row(TRAINED, impl="plugin", k=3, prompts=kind, temperature=0.0)
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
