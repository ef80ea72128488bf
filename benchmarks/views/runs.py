"""Every stored run of one setup side by side: a figure quoted from one run alone hides how far
this machine's runs of the same command spread (engine processes differ in speed from one
another), so the docs quote them all, with the drafter they ran on."""

from __future__ import annotations

import statistics
from collections import Counter

from .common import ROOT, RESULTS, load, rate, source_line, table
from .quiet import quiet_rows

# The setup: offline, one request at a time, greedy decoding and drafts, the plugin with its
# verification patch, not a floor row.
SETUP = {"mode": "offline", "impl": "plugin", "concurrency": 1, "temperature": 0.0,
         "mla_verify": "on", "draft_sample_method": "greedy",
         "rejection_sample_method": "standard", "compilation": "vLLM default (compiled)"}
LABEL = {"bench-noisy-0.8": "The `bench` preset", "trained": "The trained tiny DeepSeek"}


def _machine(env: dict) -> tuple:
    return (env.get("cpu"), env.get("cpus"), tuple(env.get("cpu_flags") or ()),
            env.get("vllm_kernels"), bool(env.get("avx512_hidden")))


def machine_label(env: dict) -> str:
    """"Intel(R) Xeon(R) Processor with AMX": what a reader needs to tell two machines apart."""
    flags = env.get("cpu_flags") or ()
    extra = (" with AVX-512 hidden (AVX2 kernels)" if env.get("avx512_hidden") else
             " with AMX" if "amx_tile" in flags else
             " with AVX-512" if "avx512f" in flags else "")
    return f"{env.get('cpu') or 'an unnamed CPU'}{extra}"


def files() -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / RESULTS).glob("**/results.json"))


def setup_runs(checkpoint: str, k: int) -> list[tuple[str, dict, dict]]:
    """(results file, k row, its k = 0 row) of every stored run of the setup at ``k``, grouped
    by machine kind (CPU, flags, vLLM's kernels: the kind most runs ran on first), oldest first
    within each: runs on different machines are shown apart, never pooled."""
    found = []
    for relative in files():
        rows = quiet_rows(relative)[0]
        for row in rows:
            if row.get("checkpoint") != checkpoint or row.get("k") != k or any(
                    (row.get(f) if row.get(f) is not None else v) != v
                    for f, v in SETUP.items()) or row.get("floor_only"):
                continue
            base = next(r for r in rows if r["k"] == 0 and not r.get("floor_only")
                        and r["impl"] == "plugin" and r.get("prompts") == row.get("prompts")
                        and r.get("temperature") == row.get("temperature")
                        and r.get("concurrency") == row.get("concurrency"))
            found.append((relative, row, base))
    machines = Counter(_machine(load(f)["environment"]) for f, _, _ in found)
    order = {m: i for i, (m, _) in enumerate(machines.most_common())}
    return sorted(found, key=lambda run: (order[_machine(load(run[0])["environment"])],
                                          load(run[0])["environment"]["date"]))


def by_machine(checkpoint: str, k: int) -> list[tuple[str, list[tuple[str, dict, dict]]]]:
    """``setup_runs`` in groups, one per machine kind: (its label, its runs)."""
    groups: dict[tuple, list] = {}
    for run in setup_runs(checkpoint, k):
        groups.setdefault(_machine(load(run[0])["environment"]), []).append(run)
    return [(machine_label(load(runs[0][0])["environment"]), runs) for runs in groups.values()]


def drafter(checkpoint: str) -> str:
    """What the drafter is: constructed (``PRESET-noisy-P``, ``PRESET-oracle``) or trained."""
    preset, _, rest = checkpoint.partition("-")
    mode, _, acceptance = rest.partition("-")
    if mode == "noisy" and acceptance:
        return (f"`{preset}:noisy:{acceptance}`, a drafter constructed to be right "
                f"{100 * float(acceptance):g} % of the time at the first position")
    if mode == "oracle":
        return f"`{preset}:oracle`, a drafter constructed to be right every time"
    return f"`{checkpoint}`, a drafter trained with its target: acceptance measured, not constructed"


def speedups(checkpoint: str, k: int) -> str:
    """"1.32× and 1.40× of no speculation in the 2 stored runs on AMD EPYC with AVX-512, median
    1.36×; 1.86× in the one on Intel(R) Xeon(R) Processor with AMX", one part per machine."""
    return "; ".join(_machine_speedups(label, runs) for label, runs in by_machine(checkpoint, k))


def _machine_speedups(label: str, found: list) -> str:
    values = sorted(row["speedup"] for _, row, _ in found)
    runs = len({f for f, _, _ in found})
    if len(values) == 1:
        return f"{values[0]:.2f}× of no speculation in the one stored run on {label}"
    listed = ", ".join(f"{v:.2f}×" for v in values[:-1]) + f" and {values[-1]:.2f}×"
    where = (f"in the {len(values)} stored runs" if runs == len(values) else
             f"in {len(values)} stored rows from {runs} runs (one run has a row per prompt kind)")
    return (f"{listed} of no speculation {where} on {label}, median "
            f"{statistics.median(values):.2f}×")


def runs_table(checkpoint: str, k: int) -> str:
    """One line per stored run of the setup: when, how many engine processes and passes, the
    tokens/s of k = 0 and k, the speed-up, the acceptance, and the other work meanwhile."""
    lines, files = [], []
    for relative, row, base in setup_runs(checkpoint, k):
        files.append(relative)
        first = row.get("per_position_acceptance") or [None]
        other = " / ".join(rate((r.get("interference") or {}).get("other_cpu_s"), 1)
                           for r in (base, row))
        lines.append([f"`{relative.removeprefix(RESULTS + '/')}`",
                      machine_label(load(relative)["environment"]),
                      load(relative)["environment"]["date"][:10],
                      str(row.get("prompts") or "all"),
                      f"{row.get('processes')} × {row.get('repeats')}",
                      rate(row["baseline"]["output_tok_s"], 1), rate(row["output_tok_s"], 1),
                      f"{row['speedup']:.2f}×", rate(first[0]), other])
    text = table(["results file", "machine", "date", "prompts", "engine processes × passes",
                  "k = 0 tok/s (baseline)", f"k = {k} tok/s", "speed-up",
                  "first-position acceptance", "other CPU s, k = 0 / k"], lines)
    return (f"{text}\n\n{LABEL.get(checkpoint, checkpoint)}, {drafter(checkpoint)}; plugin, "
            f"k = {k}, one request at a time, greedy, offline, compiled; tokens/s the median "
            f"over engine processes, the baseline pooled over the run's quiet k = 0 rows. "
            f"{source_line(*dict.fromkeys(files))}")


def parameters(checkpoint: str) -> str:
    """"457 M": the checkpoint's parameters (MTP layer included) as its rows record them."""
    counts = {r["parameters"] for relative in files() for r in load(relative)["results"]
              if r.get("checkpoint") == checkpoint and r.get("parameters")}
    (count,) = counts
    return f"{count / 1e6:.0f} M"
