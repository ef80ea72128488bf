"""Benchmark output: a JSON file with everything, a Markdown table, and PNG plots.

Plots: acceptance per draft position; speed-up against k (measured, and the ideal bound dashed);
tokens/s of the plugin next to vLLM's in-tree class for each k.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..provenance import machine_line

COLUMNS = ("checkpoint", "impl", "prompts", "T", "k", "conc", "tok/s", "speed-up", "ideal", "meas/ideal",
           "vs in-tree", "accept", "accept len", "per position", "TTFT ms mean/p50/p99",
           "TPOT ms mean/p50/p99", "draft MiB", "other CPU s")


# Row fields of the speculative sampling axes: (field, table label, vLLM's default).
SAMPLE_METHOD_FIELDS = (("draft_sample_method", "draft", "greedy"),
                        ("rejection_sample_method", "rejection", "standard"))


def _num(value, fmt: str = "{:.2f}") -> str:
    return "–" if value is None else fmt.format(value)


def _latency(d: dict | None) -> str:
    d = d or {}
    if d.get("mean") is None:
        return "–"
    return " / ".join(f"{d[q]:.0f}" if d[q] >= 10 else f"{d[q]:.1f}" for q in ("mean", "p50", "p99"))


def _tok_s(r: dict) -> str:
    """Median tokens/s, with the range over engine processes when there were several."""
    per_process = [v for v in r.get("output_tok_s_processes") or [] if v is not None]
    text = _num(r.get("output_tok_s"), "{:.1f}")
    if len(per_process) > 1:
        text += f" ({min(per_process):.1f}–{max(per_process):.1f})"
    return text


def _impl(r: dict) -> str:
    """The implementation with what sets the row apart: the mla_verify patch off, a draft or
    rejection sampling method other than vLLM's default."""
    notes = (["verify off"] if r.get("mla_verify") == "off" else []) + [
        f"{label} {r[field]}" for field, label, default in SAMPLE_METHOD_FIELDS
        if r.get(field) not in (None, default)]
    return r["impl"] + (f" ({', '.join(notes)})" if notes else "")


def table_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        per_pos = r.get("per_position_acceptance") or []
        out.append([
            r["checkpoint"], _impl(r), str(r.get("prompts") or "all")
            + (" (floor)" if r.get("floor_only") else ""),
            _num(r.get("temperature"), "{:g}"), str(r["k"]), str(r["concurrency"]),
            _tok_s(r), _num(r.get("speedup"), "{:.2f}×"),
            _num(r.get("ideal_speedup"), "{:.2f}×"), _num(r.get("measured_over_ideal")),
            _num(r.get("vs_in_tree")), _num(r.get("acceptance_rate"), "{:.1%}"),
            _num(r.get("mean_acceptance_length")),
            " ".join(f"{p:.2f}" for p in per_pos) or "–",
            _latency(r.get("ttft_ms")), _latency(r.get("tpot_ms")),
            _num(r["draft_bytes"] / 2**20 if r.get("draft_bytes") else None, "{:.1f}"),
            _num((r.get("interference") or {}).get("other_cpu_s"), "{:.1f}"),
        ])
    return out


def markdown_table(rows: list[dict]) -> str:
    modes = sorted({r.get("compilation") or "eager" for r in rows})
    lines = [f"Engines: {', '.join(modes)}.", ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells) + " |" for cells in table_rows(rows)]
    return "\n".join(lines)


def floor_text(rows: list[dict], env: dict) -> str:
    """The verification floor and whether speculation can pay off on this machine, per k.

    One line per speculative row that has a floor: what verifying costs (in decode steps of the
    row's concurrency) with and without the mla_verify patch, the floor (a decode step with
    k + 1 rows per request), the drafting cost, the acceptance length at which speculation breaks
    even with verification at the floor, and the best speed-up perfect drafts could give here."""
    speculative_rows = [r for r in rows if r.get("k") and r.get("floor_ratio") is not None]
    if not speculative_rows:
        return ""
    lines = [machine_line(env), "",
             "| checkpoint | impl | prompts | T | c | k | mla-verify | floor: k+1 rows "
             "(decode steps) | verify (decode steps) | verify / floor | draft c | "
             "break-even accept len | accept len | best possible speed-up | speed-up |",
             "|" + "---|" * 15]
    for r in speculative_rows:
        lines.append("| " + " | ".join([
            r["checkpoint"], r["impl"], str(r.get("prompts") or "all"),
            _num(r.get("temperature"), "{:g}"), str(r["concurrency"]), str(r["k"]),
            r.get("mla_verify") or "on", _num(r["floor_ratio"]), _num(r.get("verify_cost_ratio")),
            _num(r.get("verify_over_floor")), _num(r.get("draft_cost_ratio")),
            _num(r.get("break_even_acceptance_length")), _num(r.get("mean_acceptance_length")),
            _num(r.get("payoff_bound"), "{:.2f}×"), _num(r.get("speedup"), "{:.2f}×")]) + " |")
    best = max(speculative_rows, key=lambda r: r["payoff_bound"])
    verdict = ("speculation can pay off on this machine" if best["payoff_bound"] > 1 else
               "speculation cannot pay off on this machine, whatever the drafter")
    lines += ["", f"{verdict}: at best {best['payoff_bound']:.2f}× (k = {best['k']}, "
                  f"c = {best['concurrency']}, with every draft accepted and verification at the "
                  f"floor); it breaks even where the acceptance length exceeds "
                  f"{best['break_even_acceptance_length']:.2f}."]
    return "\n".join(lines)


def interference_text(rows: list[dict], cpus: int) -> str:
    """A warning naming configurations during which other processes used more than
    ``interference.BUSY_SHARE`` of the CPUs."""
    from ..engine.interference import disturbed

    busy = []
    for r in rows:
        i = r.get("interference") or {}
        if disturbed(i, cpus):
            busy.append(f"{r['checkpoint']} {r['impl']} {r.get('prompts') or 'all'} "
                        f"T={r.get('temperature') or 0:g} k={r['k']} c={r['concurrency']} "
                        f"({i['other_cpu_s']:.0f} CPU s in {i['wall_s']:.0f} s)")
    if not busy:
        return ""
    return ("warning: other processes were busy during " + "; ".join(busy)
            + ": their timings are distorted; rerun on a quiet machine")


def implausible_text(rows: list[dict]) -> str:
    """A warning naming rows whose figures cannot be (``plausibility``): not to be published."""
    lines = [f"{r['checkpoint']} {r['impl']} {r.get('prompts') or 'all'} "
             f"T={r.get('temperature') or 0:g}: {problem}"
             for r in rows for problem in r.get("implausible") or []]
    if not lines:
        return ""
    return ("warning: impossible figures (a disturbed or mis-measured engine; rerun on a quiet "
            "machine with more --processes):\n  " + "\n  ".join(lines))


def cross_check_failed(rows: list[dict]) -> bool:
    """A cross-check fails only where the two runs must match exactly: concurrency 1."""
    return any(r.get("cross_check") and not r["cross_check"]["agree"] and r["concurrency"] == 1
               for r in rows)


def cross_check_text(rows: list[dict]) -> str:
    blocks = []
    for r in rows:
        cc = r.get("cross_check")
        if not cc:
            continue
        if cc["agree"]:
            verdict = "agree"
        elif r["concurrency"] == 1:
            verdict = "DISAGREE"
        else:  # two runs, batched differently: a greedy token may flip (see crosscheck.py)
            verdict = "differ slightly (separate runs at concurrency > 1, not comparable exactly)"
        lines = [f"cross-check {r['checkpoint']} {r['impl']} k={r['k']} c={r['concurrency']}: "
                 f"{verdict} with vllm bench serve"]
        for field, (ours, theirs) in cc["fields"].items():
            lines.append(f"  {field:<24} ours {ours!s:<22} vllm bench serve {theirs!s}")
        ours, theirs = cc["per_position_acceptance"]
        lines.append(f"  {'per_position_acceptance':<24} ours {ours} vllm bench serve {theirs}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def write_json(path: Path, settings: dict, rows: list[dict], environment: dict) -> Path:
    from ..provenance import portable

    record = {"settings": settings, "environment": environment, "results": rows}
    path.write_text(json.dumps(portable(json.loads(json.dumps(record, default=str))), indent=1))
    return path


_PREFIX = {"concurrency": "c=", "temperature": "T=", "mla_verify": "mla-verify=",
           "draft_sample_method": "draft=", "rejection_sample_method": "rejection="}
SERIES_FIELDS = ("checkpoint", "impl", "concurrency", "prompts", "temperature", "mla_verify",
                 "draft_sample_method", "rejection_sample_method")


def _series_label(r: dict, varying: list[str]) -> str:
    return " ".join(f"{_PREFIX.get(f, '')}{r.get(f)}" for f in varying) or r["impl"]


def _varying(rows: list[dict], fields=SERIES_FIELDS) -> list[str]:
    return [f for f in fields if len({r.get(f) for r in rows}) > 1]


def _save(plt, fig, ax, path: Path, integer_x: bool = True) -> Path:
    if integer_x:
        ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def implementations_picture(impls: list[str]) -> tuple[str, str]:
    """File name and title of the bar chart of output tokens/s per implementation: against vLLM's
    in-tree class, or whatever else the run compared (e.g. the plugin with and without adaptive
    k)."""
    if "in-tree" in impls and set(impls) <= {"plugin", "in-tree", "vllm"}:
        return "plugin_vs_in_tree.png", "Plugin vs vLLM's in-tree MTP"
    return "by_implementation.png", "Output tokens/s by implementation: " + ", ".join(impls)


def plot_all(rows: list[dict], out_dir: Path) -> list[Path]:
    """Write the three plots; returns their paths (none when there is nothing to show, or no
    matplotlib)."""
    from ..plotting import pyplot

    plt = pyplot(f"plots in {out_dir}")
    if plt is None:
        return []

    paths = []
    rows = [r for r in rows if not r.get("floor_only")]  # in the floor table, not the plots
    varying = _varying(rows)
    series: dict[str, list[dict]] = {}
    for r in rows:
        series.setdefault(_series_label(r, varying), []).append(r)

    spec_rows = [r for r in rows if r["k"] and r.get("per_position_acceptance")]
    if spec_rows:
        fig, ax = plt.subplots(figsize=(6.4, 4), dpi=100)
        for r in spec_rows:
            pos = range(1, len(r["per_position_acceptance"]) + 1)
            label = f"{_series_label(r, varying)} k={r['k']}"
            style = "-o" if r["impl"] != "in-tree" else "--x"
            ax.plot(list(pos), r["per_position_acceptance"], style, label=label)
        ax.set(xlabel="draft position", ylabel="accepted / drafts", ylim=(0, 1.05),
               title="Acceptance per draft position")
        paths.append(_save(plt, fig, ax, out_dir / "per_position_acceptance.png"))

    if any(r.get("speedup") is not None for r in rows):
        fig, ax = plt.subplots(figsize=(6.4, 4), dpi=100)
        for label, rs in series.items():
            rs = sorted((r for r in rs if r.get("speedup") is not None), key=lambda r: r["k"])
            if not rs:
                continue
            line, = ax.plot([r["k"] for r in rs], [r["speedup"] for r in rs], "-o", label=label)
            ideal = [(r["k"], r["ideal_speedup"]) for r in rs if r.get("ideal_speedup")]
            if ideal:
                ax.plot(*zip(*ideal), ":", color=line.get_color(), label=f"{label} (ideal)")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set(xlabel="num_speculative_tokens k", ylabel="tokens/s vs k=0",
               title="Speed-up against k = 0")
        paths.append(_save(plt, fig, ax, out_dir / "speedup_vs_k.png"))

    impls = list(dict.fromkeys(r["impl"] for r in rows))
    if len(impls) > 1:
        rest = _varying(rows, tuple(f for f in SERIES_FIELDS if f != "impl"))
        groups = sorted({(_series_label(r, rest) if rest else "", r["k"]) for r in rows},
                        key=lambda g: (g[0], g[1]))
        fig, ax = plt.subplots(figsize=(6.4, 4), dpi=100)
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            values = []
            for g in groups:
                match = [r for r in rows if r["impl"] == impl and r["k"] == g[1]
                         and (not rest or _series_label(r, rest) == g[0])]
                values.append(match[0]["output_tok_s"] if match else 0.0)
            ax.bar([j + i * width for j in range(len(groups))], values, width, label=impl)
        labels = [f"{g[0]} k={g[1]}".strip() for g in groups]
        # Long labels (several settings vary) slanted, so that neighbours do not overlap.
        slanted = max(map(len, labels)) * len(labels) > 60
        ax.set_xticks([j + width * (len(impls) - 1) / 2 for j in range(len(groups))], labels,
                      fontsize=7 if slanted else 8, rotation=40 if slanted else 0,
                      ha="right" if slanted else "center")
        if slanted:
            fig.set_size_inches(min(max(6.4, 0.5 * len(labels)), 24), 5.5)
        name, title = implementations_picture(impls)
        ax.set(ylabel="output tokens/s", title=title)
        paths.append(_save(plt, fig, ax, out_dir / name, integer_x=False))
    return paths
