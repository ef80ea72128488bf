"""Does ``vllm-mtp tune``'s pick hold? Its best k per concurrency against a benchmark sweep of fixed
k (``vllm-mtp bench offline -k 0 1 2 3 --impl plugin --no-split-kinds --concurrency C``) on the same
model and machine.

``python -m vllm_mtp_plugin.tools.tune.check tune.json results.json [...] --out DIR`` writes
``check.md`` (the table), ``check.json`` and ``tune_vs_fixed.png`` (measured throughput over no
speculation per fixed k, and the tuned choice). The noise of a configuration is the range of its
measured passes (every engine process and repeat): a pick is "within noise" of the measured best
when the two ranges overlap, and "slower than no speculation" only when its whole range lies
below k = 0's. Only the sweep's rows that measure what tune measured count: the plugin, one prompt
set, tune's temperature, the same checkpoint, vLLM's verification patch as shipped, the draft
method tune chose, standard rejection sampling.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..stats import median
from ..provenance import local_path
from ..cli_help import HelpFormatter, examples
from .plot import measured_against_pick
from .results import Verdict, int_keys


def comparable(row: dict, settings: dict) -> bool:
    """A sweep row measured as tune measures: offline, not a floor row, the plugin, all prompts as
    one set, tune's temperature, the checkpoint tune ran (where both name one), tune's draft
    method and standard verification (k > 0; tune measures no other)."""
    same_model = (not row.get("checkpoint_path") or not settings.get("model")
                  or local_path(row["checkpoint_path"]).resolve()
                  == local_path(settings["model"]).resolve())
    return (row.get("mode") == "offline" and not row.get("floor_only") and bool(row.get("runs"))
            and row.get("impl", "plugin") == "plugin" and row.get("prompts", "all") == "all"
            and float(row.get("temperature") or 0.0) == float(settings.get("temperature") or 0.0)
            and row.get("mla_verify", "on") == "on" and same_model
            and (not row.get("k") or (
                (row.get("draft_sample_method") or "greedy")
                == (settings.get("draft_sample_method") or "greedy")
                and (row.get("rejection_sample_method") or "standard") == "standard")))


def measured(results_files: list[Path], settings: dict | None = None) -> dict[int, dict[int, dict]]:
    """{concurrency: {k: {"median", "low", "high", "passes"}}} over the sweeps' comparable rows;
    two rows for one (concurrency, k) are refused (which one would count?)."""
    table: dict[int, dict[int, dict]] = {}
    seen: dict[tuple[int, int], Path] = {}
    for path in results_files:
        for row in json.loads(Path(path).read_text())["results"]:
            if not comparable(row, settings or {}):
                continue
            key = (row["concurrency"], row["k"])
            if key in seen:
                raise ValueError(f"{path} and {seen[key]} both measure concurrency {key[0]}, "
                                 f"k = {key[1]}: give each (concurrency, k) once")
            seen[key] = Path(path)
            passes = [run["output_tok_s"] for run in row["runs"]]
            table.setdefault(row["concurrency"], {})[row["k"]] = {
                "median": median(passes), "low": min(passes), "high": max(passes),
                "passes": len(passes)}
    return table


def compare(best_fixed_k: dict[int, int], table: dict[int, dict[int, dict]],
            log=print) -> list[Verdict]:
    """One verdict per concurrency that both tune (its best fixed k per concurrency) and the
    sweep measured (k = 0 included); the others are named with the reason."""
    verdicts = []
    for c, tuned_k in best_fixed_k.items():
        by_k = table.get(c)
        missing = ("no comparable sweep rows" if not by_k else
                   f"the sweep has no k = {tuned_k}" if tuned_k not in by_k else
                   "the sweep has no k = 0" if 0 not in by_k else None)
        if missing:
            log(f"concurrency {c}: left out ({missing})")
            continue
        best_k = max(by_k, key=lambda k: (by_k[k]["median"], -k))
        tuned, best, none = by_k[tuned_k], by_k[best_k], by_k[0]
        verdicts.append(Verdict(
            concurrency=c, tuned_k=tuned_k, measured_best_k=best_k,
            tok_s=dict(sorted(by_k.items())),
            tuned_over_best=tuned["median"] / best["median"],
            tuned_over_no_speculation=tuned["median"] / none["median"],
            pick="best" if tuned_k == best_k else (
                "within noise" if tuned["high"] >= best["low"] else "missed"),
            slower_than_no_speculation=tuned["high"] < none["low"],
            single_pass=min(tuned["passes"], best["passes"], none["passes"]) < 2))
    return verdicts


def text(verdicts: list[Verdict], machine: str = "") -> str:
    ks = sorted({k for v in verdicts for k in v.tok_s})
    lines = ([machine, ""] if machine else []) + [
        "measured tokens/s per fixed k: median [lowest – highest pass]; tune's pick against the "
        "measured best", "",
        "| concurrency | " + " | ".join(f"k = {k}" for k in ks)
        + " | tune's k | best k | tuned / best | tuned / k = 0 | verdict |",
        "|---|" + "---|" * (len(ks) + 5)]
    for v in verdicts:
        cells = []
        for k in ks:
            m = v.tok_s.get(k)
            cells.append("–" if m is None
                         else f"{m['median']:.1f} [{m['low']:.1f}–{m['high']:.1f}]")
        verdict = v.pick + ("; slower than k = 0" if v.slower_than_no_speculation else "") + (
            "; one pass: no noise range" if v.single_pass else "")
        lines.append(f"| {v.concurrency} | " + " | ".join(cells)
                     + f" | {v.tuned_k} | {v.measured_best_k} | {v.tuned_over_best:.2f}"
                     f" | {v.tuned_over_no_speculation:.2f} | {verdict} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m vllm_mtp_plugin.tools.tune.check", description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter, epilog=examples(
            "python -m vllm_mtp_plugin.tools.tune.check tune.json sweep-c1/results.json "
            "sweep-c4/results.json --out check/"))
    p.add_argument("tune", type=Path, help="tune.json of vllm-mtp tune")
    p.add_argument("results", type=Path, nargs="+", help="results.json of vllm-mtp bench offline")
    p.add_argument("--out", type=Path, required=True,
                   help="directory for check.md, check.json and tune_vs_fixed.png")
    args = p.parse_args(argv)
    tune = json.loads(args.tune.read_text())
    try:
        table = measured(args.results, {**(tune.get("settings") or {}),
                                        "draft_sample_method": tune.get("draft_sample_method")})
    except ValueError as exc:
        raise SystemExit(f"tune check: {exc}") from None
    verdicts = compare(int_keys(tune["best_fixed_k"]), table)
    if not verdicts:
        raise SystemExit("tune check: no concurrency was measured both by tune and by an offline "
                         "sweep of the plugin on the same checkpoint, prompts as one set, tune's "
                         "temperature (with k = 0 and tune's k): nothing to compare")
    from ..provenance import machine_line

    machine = machine_line(tune["machine"]) if tune.get("machine") else ""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "check.md").write_text(text(verdicts, machine) + "\n")
    from ..provenance import machine as this_machine, portable, run_record

    record = {"run": {**run_record(), **this_machine()}, "tune_machine": tune.get("machine"),
              "verdicts": [v.to_json() for v in verdicts]}
    (args.out / "check.json").write_text(json.dumps(portable(record), indent=1))
    measured_against_pick(verdicts, args.out / "tune_vs_fixed.png",
                          f"{Path(tune['settings']['model']).name}: fixed k against tune's pick")
    print(text(verdicts, machine))
    return 0 if all(v.pick != "missed" and not v.slower_than_no_speculation
                    for v in verdicts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
