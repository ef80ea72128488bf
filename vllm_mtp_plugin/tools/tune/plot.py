"""tune's two plots, tokens/s against concurrency per k: what ``vllm-mtp tune`` expects
(``tune.png``) and what a fixed-k benchmark sweep measured next to tune's pick
(``tune_vs_fixed.png``, ``check.py``)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from ..plotting import pyplot
from .results import TuneResult, Verdict


@contextmanager
def concurrency_axes(plt, path: Path, concurrencies: list[int], ylabel: str, title: str):
    """One figure: concurrency on a log-2 axis, saved to ``path`` when the block ends."""
    fig, ax = plt.subplots(figsize=(6.4, 4), dpi=100)
    yield ax
    ax.set_xscale("log", base=2)
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.set(xlabel="concurrency (requests in flight)", ylabel=ylabel, title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def expected(data: TuneResult, path: Path) -> Path | None:
    """Expected tokens/s, one line per k, tune's measured points as markers, the chosen k per
    concurrency as a thick line (None: no matplotlib)."""
    plt = pyplot(path)
    if plt is None:
        return None
    chosen = data.chosen
    cs = list(chosen.expected_tok_s)
    with concurrency_axes(plt, path, cs, "output tokens/s",
                          "Expected throughput per k (x: measured in tune's pass)") as ax:
        for k in data.ks_measured or range(data.settings["max_k"] + 1):
            ys = [chosen.expected_tok_s[c].get(k) for c in cs]
            line, = ax.plot(cs, ys, "-", label=f"k = {k}")
            seen = [(p["concurrency"], p["measured_tok_s"]) for p in data.measurements
                    if p["k"] == k and (not k or (p.get("draft_sample_method") or "greedy")
                                        == data.draft_sample_method)]
            ax.plot(*zip(*seen), "x", color=line.get_color())
        chosen_cs = [c for c in cs if c in chosen.best_fixed_k]
        best = [chosen.expected_tok_s[c][chosen.best_fixed_k[c]] for c in chosen_cs]
        ax.plot(chosen_cs, best, "-", color="black", linewidth=3, alpha=0.35, label="chosen")
    return path


def measured_against_pick(verdicts: list[Verdict], path: Path, title: str) -> Path | None:
    """Measured throughput per fixed k over no speculation's (bars: lowest to highest pass), and
    tune's pick, thick: a ratio keeps small and large concurrencies readable on one axis (None:
    no matplotlib)."""
    plt = pyplot(path)
    if plt is None:
        return None
    cs = [v.concurrency for v in verdicts]
    with concurrency_axes(plt, path, cs, "tokens/s over no speculation (measured)", title) as ax:
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
        for k in sorted({k for v in verdicts for k in v.tok_s}):
            points = [(v.concurrency, v.tok_s[k], v.tok_s[0]["median"])
                      for v in verdicts if k in v.tok_s]
            ys = [m["median"] / base for _, m, base in points]
            errors = [[(m["median"] - m["low"]) / base for _, m, base in points],
                      [(m["high"] - m["median"]) / base for _, m, base in points]]
            ax.errorbar([c for c, _, _ in points], ys, yerr=errors, marker="o", markersize=3,
                        capsize=2, label=f"k = {k}")
        tuned = [v.tuned_over_no_speculation for v in verdicts]
        ax.plot(cs, tuned, "-", color="black", linewidth=4, alpha=0.3, label="vllm-mtp tune's k")
    return path
