"""Speed figures: speed-up over no speculation, verification against its floor, the bench's own
full tables; each with the range over engine processes where a run had several."""

from __future__ import annotations

from vllm_mtp_plugin.tools.bench import report
from vllm_mtp_plugin.tools.throughput.plausibility import row_problems

from .acceptance import KINDS, TRAINED, _drafts, _temperatures, trained_row
from .common import bench_rows, load, rate, source_line, table
from .quiet import floor_line, floor_problems, quiet_rows, shared_line

VERIFY = {"trained": "benchmarks/results/verify-trained/results.json",
          "bench": "benchmarks/results/verify-bench/results.json",
          "avx2": "benchmarks/results/verify-avx2/results.json"}
FULL = {"offline": "benchmarks/results/offline/results.json",
        "sizes": "benchmarks/results/sizes/results.json",
        "serve": "benchmarks/results/serve/results.json"}


def _speedup(row: dict) -> str:
    return "–" if row.get("speedup") is None else f"{row['speedup']:.2f}"


def trained_speed() -> str:
    """Speed-up against k = 0 of the same kind and temperature, and what it is made of at k = 3."""
    rows = []
    for temperature in _temperatures():
        for drafts in _drafts(temperature):
            for kind in KINDS:
                ours = [trained_row("plugin", k, kind, temperature, drafts) for k in (1, 2, 3)]
                theirs = [trained_row("in-tree", k, kind, temperature, drafts) for k in (1, 2, 3)]
                rows.append([kind, f"{temperature:g}", drafts,
                             " / ".join(_speedup(r) for r in ours),
                             " / ".join(_speedup(r) for r in theirs),
                             rate(ours[2]["output_tok_s"] / theirs[2]["output_tok_s"]),
                             rate(ours[2].get("verify_cost_ratio")),
                             rate(ours[2].get("draft_cost_ratio"))])
    text = table(["prompts", "T", "draft method", "speed-up k = 1 / 2 / 3 (plugin)", "in-tree",
                  "plugin / in-tree tok/s k = 3", "verify cost k = 3 (decode steps)",
                  "draft cost c k = 3"], rows)
    other = max(r["interference"]["other_cpu_s"] for r in bench_rows(TRAINED))
    processes = sorted({r["processes"] for r in bench_rows(TRAINED)})
    return (f"{text}\n\nMedian of {'/'.join(map(str, processes))} engine processes per "
            f"configuration; other processes used at most {other:.1f} CPU-seconds during any "
            f"configuration.{impossible_line(bench_rows(TRAINED))}{floor_line(bench_rows(TRAINED))}"
            f"{shared_line(TRAINED)} {source_line(TRAINED)}")


def verify_table(name: str) -> str:
    """Verification with and without ``mla_verify_as_decode`` (``VLLM_MTP_MLA_VERIFY=0``), next
    to its floor; the other CPU seconds of each pair say whether the run was quiet."""
    relative = VERIFY[name]
    stored, rows = quiet_rows(relative)[0], []

    def one(**where) -> dict:
        (row,) = [r for r in stored if all(r.get(f) == v for f, v in where.items())]
        return row

    for impl in ("plugin", "in-tree"):
        for k in sorted({r["k"] for r in bench_rows(relative, impl=impl) if r["k"]}):
            on, off = (one(impl=impl, k=k, mla_verify=m, floor_only=False) for m in ("on", "off"))

            def pair(field, fmt="{:.2f}"):
                return " → ".join("–" if r.get(field) is None else fmt.format(r[field])
                                  for r in (off, on))
            rows.append([impl, str(k), pair("verify_cost_ratio"), pair("verify_over_floor"),
                         pair("draft_cost_ratio"), pair("speedup", "{:.2f}×"),
                         " / ".join(f"{r['interference']['other_cpu_s']:.1f}" for r in (off, on))])
    base = [r for r in bench_rows(relative) if r["k"] == 0 and not r.get("floor_only")]
    t0 = sorted(r["steps"]["step_ms"] for r in base)[len(base) // 2]
    floors = sorted({(r["k"], round(r["floor_ratio"], 2)) for r in bench_rows(relative)
                     if r.get("floor_ratio")})
    text = table(["impl", "k", "verify, off → on", "verify / floor, off → on",
                  "draft c, off → on", "speed-up, off → on", "other CPU s, off / on"], rows)
    return (f"{text}\n\nDecode step T0 = {t0:.1f} ms (k = 0, median over its rows); floor "
            + ", ".join(f"{f:.2f} at k = {k}" for k, f in floors)
            + f"; {_processes(relative)} per configuration."
            + impossible_line(stored) + floor_line(stored) + shared_line(relative)
            + f" {source_line(relative)}")


def _processes(relative: str) -> str:
    counts = sorted({r["processes"] for r in bench_rows(relative)})
    return "/".join(map(str, counts)) + (" engine process" if counts == [1] else " engine processes")


def rerun_line(rows: list[dict]) -> str:
    """" Re-run ...": engine processes the bench discarded because other work shared the machine
    (``interference.disturbed``), and rows still above the threshold after the re-runs."""
    from vllm_mtp_plugin.tools.engine.interference import BUSY_SHARE, disturbed

    def name(r: dict) -> str:
        return f"{r['impl']} k = {r['k']}" + (" (floor)" if r.get("floor_only") else "")

    rerun = [f"{name(r)}: {len(r['interference']['discarded_disturbed'])}" for r in rows
             if (r.get("interference") or {}).get("discarded_disturbed")]
    still = [name(r) for r in rows if disturbed(r.get("interference"))]
    text = (f" Engine processes re-run because other work used more than {BUSY_SHARE:.0%} of the "
            f"CPUs meanwhile (discarded, never pooled): {', '.join(rerun)}." if rerun else "")
    return text + (f" **Still disturbed after the re-runs**: {', '.join(still)}." if still else "")


def full_table(name: str) -> str:
    """The bench's own table of a run, as ``vllm-mtp bench report`` renders it."""
    relative = FULL[name]
    rows = quiet_rows(relative)[0]
    notes = " ".join(part.strip() for part in (impossible_line(rows), floor_line(rows),
                                               rerun_line(rows), shared_line(relative),
                                               source_line(relative)) if part)
    return f"{report.markdown_table(rows)}\n\n{notes}"


def impossible_line(rows: list[dict]) -> str:
    """" **Impossible figures** ...": rows whose timings cannot be (``throughput/plausibility.py``),
    checked afresh on the stored rows; empty when there are none."""
    found = [f"{r['impl']} {r.get('prompts') or 'all'} T={r.get('temperature') or 0:g} "
             f"(verify {r.get('mla_verify', 'on')}): {problem}"
             for r in rows for problem in row_problems(r)]
    return (" **Impossible figures, not to be used** (`tools/throughput/plausibility.py`): "
            + "; ".join(found) + ".") if found else ""


def _speculative_rows(name: str) -> dict[str, list[dict]]:
    rows = [r for r in quiet_rows(FULL[name])[0] if r["k"] and not r.get("floor_only")]
    return {impl: sorted((r for r in rows if r["impl"] == impl), key=lambda r: r["k"])
            for impl in ("plugin", "in-tree")}


def draft_cost(name: str) -> str:
    """"0.21 / 0.22 / 0.16 ours, 0.30 / 0.26 / 0.24 in-tree at k = 1 / 2 / 3": c per k."""
    by_impl = _speculative_rows(name)
    ks = " / ".join(str(r["k"]) for r in by_impl["plugin"])
    return (" / ".join(rate(r.get("draft_cost_ratio")) for r in by_impl["plugin"]) + " ours, "
            + " / ".join(rate(r.get("draft_cost_ratio")) for r in by_impl["in-tree"])
            + f" in-tree at k = {ks}")


def measured_over_ideal(name: str) -> str:
    """"0.81–0.95": measured over ideal speed-up over every speculative row of a run."""
    values = [r["measured_over_ideal"] for rows in _speculative_rows(name).values() for r in rows
              if r.get("measured_over_ideal") is not None]
    return f"{min(values):.2f}–{max(values):.2f}"


def k0_passes(name: str) -> str:
    """"29.0 and 32.7 tokens/s in one engine process, ...": every pass of the quietest k = 0 row
    of a run with several passes per process, by process (the lottery between processes)."""
    relative = VERIFY[name]
    rows = [r for r in bench_rows(relative, k=0, floor_only=False) if r["repeats"] > 1]
    row = min(rows, key=lambda r: r["interference"]["other_cpu_s"])
    by_process: dict[int, list[float]] = {}
    for run in row["runs"]:
        by_process.setdefault(run["process"], []).append(run["output_tok_s"])
    passes = "; ".join(" and ".join(f"{v:.1f}" for v in values)
                       for values in sorted(by_process.values(), key=min))
    return (f"{passes} tokens/s, each group the passes of one engine process (the "
            f"{row['impl']} k = 0 row of `{relative.removeprefix('benchmarks/')}`, "
            f"{row['interference']['other_cpu_s']:.1f} CPU-seconds of other work in "
            f"{row['interference']['wall_s']:.0f} s)")


def verify_changes(name: str) -> str:
    """What the patch changed per row: verification and drafting cost, the speed-ups with it,
    and how far the k = 0 processes spread."""
    rows = quiet_rows(VERIFY[name])[0]
    pairs = [(off, on) for on in rows if on["k"] and on.get("mla_verify") == "on"
             and not on.get("floor_only")
             for off in rows if off.get("mla_verify") == "off" and off["impl"] == on["impl"]
             and off["k"] == on["k"] and not off.get("floor_only")]

    def moved(field: str) -> str:
        rose = [f"{on['impl']} k = {on['k']}" for off, on in pairs
                if round(on[field], 2) > round(off[field], 2)]
        fell = sum(round(on[field], 2) < round(off[field], 2) for off, on in pairs)
        return (f"fell in every row" if fell == len(pairs) else
                f"fell in {fell} of {len(pairs)} rows" + (f", rose in {', '.join(rose)}"
                                                          if rose else ""))

    ratios = [on["verify_cost_ratio"] / off["verify_cost_ratio"] for off, on in pairs]
    speedups = [on["speedup"] for _, on in pairs]
    k0 = [v for r in rows if r["k"] == 0 and not r.get("floor_only")
          for v in r["output_tok_s_processes"]]
    return (f"verification cost {moved('verify_cost_ratio')} (with the patch "
            f"{min(ratios):.2f}–{max(ratios):.2f} of its cost without), draft cost c "
            f"{moved('draft_cost_ratio')}; speed-ups with the patch {min(speedups):.2f}×–"
            f"{max(speedups):.2f}×; the k = 0 engine processes ran at {min(k0):.1f}–"
            f"{max(k0):.1f} tokens/s")


def payoff_example() -> str:
    """The verification run whose floor caps speculation most, as the bound's worked example."""
    rows = [(name, r) for name, relative in VERIFY.items() for r in quiet_rows(relative)[0]
            if r["k"] and r.get("mla_verify") == "on" and r.get("payoff_bound")
            and not floor_problems(r)]
    name, r = min(rows, key=lambda pair: pair[1]["payoff_bound"])
    k, c, floor = r["k"], r["draft_cost_ratio"], r["floor_ratio"]
    return (f"in `results/verify-{name}` ({r['impl']}, k = {k}) a decode step with k + 1 = "
            f"{k + 1} rows cost {floor:.2f} plain steps and a draft step c = {c:.2f} of one, so the "
            f"best possible speed-up there was {k + 1} / ({floor:.2f} + {k} · {c:.2f}) ≈ "
            f"{r['payoff_bound']:.2f}×")


def run_settings(name: str) -> str:
    """"5 engine processes per configuration, 1 measured pass each", as the run was set."""
    s = load(FULL[name])["settings"]
    passes = f"{s['repeats']} measured pass{'es' if s['repeats'] > 1 else ''} each"
    if s["mode"] != "offline":
        return f"one server per configuration, {passes}"
    return f"{s['processes']} engine processes per configuration, {passes}"


def sizes_speedups() -> str:
    """"0.99× on the 5 M-parameter `tiny` preset, ...": k = 3 over k = 0 per preset, smallest
    first."""
    rows = sorted((r for r in quiet_rows(FULL["sizes"])[0] if r["k"] == 3
                   and not r.get("floor_only")), key=lambda r: r["parameters"])
    return ", ".join(f"{r['speedup']:.2f}× on the {r['parameters'] / 1e6:.0f} M-parameter "
                     f"`{r['checkpoint'].split('-')[0]}`" for r in rows)


def draft_memory(name: str, difference: bool = False) -> str:
    """"393.6 vs 361.6 MiB" (in-tree vs plugin, what each drafter allocates at load), or their
    difference alone."""
    mib = {impl: {r["draft_bytes"] / 2**20 for r in load(FULL[name])["results"]
                  if r["impl"] == impl and r.get("draft_bytes")} for impl in ("in-tree", "plugin")}
    (theirs,), (ours,) = mib["in-tree"], mib["plugin"]
    return f"{theirs - ours:.1f} MiB" if difference else f"{theirs:.1f} vs {ours:.1f} MiB"
