"""``vllm-mtp doctor`` without a model (``benchmarks/results/doctor``): its checks as they ran, and
how long the whole run took."""

from __future__ import annotations

from .common import load, source_line, table

SELFTEST = "benchmarks/results/doctor/selftest.json"


def selftest_table() -> str:
    """Each check, its status and its line, then the engines' mode and the wall time."""
    data = load(SELFTEST)
    rows = [[f"`{c['name']}`", c["status"], c["summary"].replace("|", "/")] for c in data["checks"]]
    engines = data["engines"]
    modes = sorted({f"runner {e['runner']}, {e['compilation']}" for e in engines.values()
                    if e.get("runner")})
    failed = sum(c["status"] == "fail" for c in data["checks"])
    return "\n".join([
        table(["check", "status", "what it measured"], rows), "",
        f"{len(data['checks'])} checks, {failed} failed; {len(engines)} engines ({'; '.join(modes)}, "
        f"engine core in its own process), {data['seconds'] / 60:.1f} min in all, the first run "
        f"with an empty vLLM cache. {source_line(SELFTEST)}"])


def selftest_minutes() -> str:
    return f"{load(SELFTEST)['seconds'] / 60:.1f} min"


TRAINED = "benchmarks/results/doctor/trained.json"


def trained_report() -> str:
    """``vllm-mtp doctor MODEL`` on the trained tiny DeepSeek: its checks, verdict and advice,
    as printed."""
    data = load(TRAINED)
    rows = [[f"`{c['name']}`", c["status"], c["summary"].replace("|", "/")] for c in data["checks"]]
    lines = [f"- {title}: {line}" for title in ("reasons", "advice")
             for line in data.get(title) or []]
    return "\n".join([
        table(["check", "status", "what it measured"], rows), "",
        f"Verdict: `{data['verdict']}`, {data['seconds'] / 60:.1f} min in all.", "",
        *[line.replace("|", "/") for line in lines], "", source_line(TRAINED)])


def trained_batch_sizes() -> str:
    """Where k = 1 lands against no speculation per batch size, by tune's model and as measured,
    each named gain, even or loss by the band doctor uses (``doctor/batch.py``)."""
    from vllm_mtp_plugin.tools.doctor.batch import EVEN

    rows = load(TRAINED)["batch_sizes"]["rows"]

    def side(value: float) -> str:
        return "gain" if value > 1 + EVEN else "loss" if value < 1 - EVEN else "even"

    cells = [f"batch {r['batch_size']}: {r['modelled_speedup']:.2f}× by tune's model "
             f"({side(r['modelled_speedup'])}), {r['measured_speedup']:.2f}× measured "
             f"({side(r['measured_speedup'])})" for r in rows]
    return "; ".join(cells) + f" (even: within {100 * EVEN:g} % of 1)"
