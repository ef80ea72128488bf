"""Adaptive k under traffic that shifts: one engine per arm serves the same phases in turn
(one request at a time, then many, then one again; code greedy, then chat sampled), and each
arm's time per phase and over the whole run is compared.

    python benchmarks/adaptive_shift.py -m trained --processes 3 --requests 96
    python benchmarks/adaptive_shift.py -m bench:noisy:0.8 --tune-config CONFIG.json ...

Arms: every fixed k from 0 to ``--max-k``, adaptive k (``VLLM_MTP_ADAPTIVE_K=1`` up to
``--max-k``) and, with ``--tune-config``, the speculative config ``vllm-mtp tune`` printed (its
per-batch-size table). All speculative arms draft probabilistically (at T = 0 that is argmax).
Every arm does the same work (the same requests per phase, ``ignore_eos``), so times compare;
engine processes alternate between arms (``--processes`` rounds), and a process that other work
disturbed is run again, never pooled (``--disturbed-retries``). Writes
``OUT/shift.json`` (machine, commit, argv inside) and prints per phase and over the run each
arm's median seconds and adaptive's ratio to the best fixed arm.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from vllm_mtp_plugin.tools.engine.interference import Meter, disturbed  # noqa: E402
from vllm_mtp_plugin.tools.engine.offline import OfflineConfig, run_config  # noqa: E402
from vllm_mtp_plugin.tools.prompt_files import load_prompt_groups  # noqa: E402
from vllm_mtp_plugin.tools.provenance import environment, portable  # noqa: E402
from vllm_mtp_plugin.tools.tiny.presets import default_prompts, resolve  # noqa: E402

# Not results.json: that name is the bench's row format, which benchmarks/views/ read.
RESULTS_FILE = "shift.json"
# (label, prompt kind, temperature, concurrency): each phase favours another fixed choice.
PHASES = (("code T=0 c=1", "code", 0.0, 1), ("chat T=1 c=16", "chat", 1.0, 16),
          ("code T=0 c=1 again", "code", 0.0, 1), ("chat T=1 c=1", "chat", 1.0, 1))


def arms(max_k: int, tune_config: dict | None) -> dict[str, tuple[str, int, dict]]:
    """Arm name -> (implementation, k, speculative config overrides)."""
    probabilistic = {"draft_sample_method": "probabilistic"}
    out = {f"k={k}": ("plugin", k, probabilistic if k else {}) for k in range(max_k + 1)}
    out["adaptive"] = ("adaptive", max_k, probabilistic)
    if tune_config:
        table = tune_config.get("num_speculative_tokens_per_batch_size")
        out["tune"] = ("plugin", int(tune_config["num_speculative_tokens"]),
                       {**probabilistic, **({"num_speculative_tokens_per_batch_size": table}
                                            if table else {})})
    return out


def phase_passes(groups: dict[str, list], requests: int, seed: int,
                 concurrent_requests: int | None = None) -> list[dict]:
    """The measured passes: ``requests`` prompts of each phase's kind (cycled), or
    ``concurrent_requests`` in a phase of many requests at a time (None: ``requests``), seeded
    when sampled (request i: seed + i, the same streams for every arm)."""
    passes = []
    for label, kind, temperature, concurrency in PHASES:
        pool = groups.get(kind) or next(iter(groups.values()))
        count = requests if concurrency == 1 or not concurrent_requests else concurrent_requests
        prompts = [pool[i % len(pool)] for i in range(count)]
        passes.append({"label": label, "prompts": prompts, "chat": isinstance(prompts[0], list),
                       "concurrency": concurrency,
                       "sampling": {"temperature": temperature,
                                    **({"seed": seed} if temperature else {})}})
    return passes


def run_arm(model: str, arm: tuple, passes: list[dict], args, log: Path) -> dict:
    impl, k, overrides = arm
    config = OfflineConfig(model, k, impl, passes[0]["prompts"], args.max_tokens,
                           passes=passes, ignore_eos=True, warmup_prompts=2,
                           speculative_overrides=overrides,
                           llm_kwargs={"dtype": args.dtype, "seed": args.seed,
                                       "max_num_seqs": max(p[3] for p in PHASES)})
    for attempt in range(args.disturbed_retries + 1):
        with Meter() as meter:
            result = run_config(config, timeout=args.timeout, log_path=str(log))
        interference = meter.result()
        if not disturbed(interference) or attempt == args.disturbed_retries:
            break
    return {"phases": [{"label": r["pass"], "seconds": r["seconds"],
                        "output_tokens": r["output_tokens"], "spec_decode": r["spec_decode"]}
                       for r in result["runs"]],
            "interference": interference, "attempts": attempt + 1}


def summary(results: dict[str, list[dict]]) -> dict:
    """Per arm: median seconds per phase and over the run; adaptive's ratio (best fixed arm's
    time / adaptive's: above 1 is faster) per phase and over the run."""
    out = {}
    for name, runs in results.items():
        phases = [statistics.median(r["phases"][i]["seconds"] for r in runs)
                  for i in range(len(PHASES))]
        out[name] = {"phase_seconds": phases,
                     "total_seconds": statistics.median(sum(p["seconds"] for p in r["phases"])
                                                        for r in runs)}
    fixed = {n: s for n, s in out.items() if n != "adaptive"}
    if "adaptive" in out and fixed:
        best_total = min(s["total_seconds"] for s in fixed.values())
        out["adaptive"]["vs_best_fixed_total"] = best_total / out["adaptive"]["total_seconds"]
        out["adaptive"]["vs_best_fixed_phase"] = [
            min(s["phase_seconds"][i] for s in fixed.values())
            / out["adaptive"]["phase_seconds"][i] for i in range(len(PHASES))]
        if "k=0" in out:
            out["adaptive"]["vs_k0_total"] = (out["k=0"]["total_seconds"]
                                              / out["adaptive"]["total_seconds"])
    return out


def table(result: dict) -> str:
    lines = ["| arm | " + " | ".join(p[0] for p in PHASES) + " | whole run |",
             "|---|" + "---|" * (len(PHASES) + 1)]
    for name, s in result["summary"].items():
        lines.append(f"| {name} | " + " | ".join(f"{t:.1f} s" for t in s["phase_seconds"])
                     + f" | {s['total_seconds']:.1f} s |")
    adaptive = result["summary"].get("adaptive", {})
    if "vs_best_fixed_total" in adaptive:
        lines.append("\nadaptive vs the best fixed arm (its time / adaptive's): "
                     + ", ".join(f"{r:.2f}x" for r in adaptive["vs_best_fixed_phase"])
                     + f"; whole run {adaptive['vs_best_fixed_total']:.2f}x")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("-m", "--model", default="trained", help="a checkpoint or a tiny preset spec")
    p.add_argument("--max-k", type=int, default=3)
    p.add_argument("--tune-config", type=Path, help="vllm-mtp tune's results file (tune.json), or "
                   "a JSON file holding the speculative config it printed (adds the arm 'tune')")
    p.add_argument("--requests", type=int, default=96,
                   help="requests per phase of one request at a time")
    p.add_argument("--concurrent-requests", type=int, default=None,
                   help="requests per phase of many at a time (default: --requests); a phase "
                        "of 16 at a time runs its requests several times faster")
    p.add_argument("--arms", nargs="+", default=None,
                   help="only these arms (names as printed: k=0 .. k=MAX_K, adaptive, tune)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--processes", type=int, default=3, help="engine processes per arm, alternated")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--disturbed-retries", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "adaptive-shift")
    p.add_argument("--log-dir", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    run = environment()
    ckpt = resolve(args.model)
    groups = load_prompt_groups(default_prompts([args.model]))
    passes = phase_passes(groups, args.requests, args.seed, args.concurrent_requests)
    tune = json.loads(args.tune_config.read_text()) if args.tune_config else None
    tune = (tune or {}).get("speculative_config", tune)  # tune's results file, or the config
    plan = arms(args.max_k, tune)
    unknown = sorted(set(args.arms or ()) - set(plan))
    if unknown:
        raise SystemExit(f"--arms {' '.join(unknown)}: no such arm; the arms are "
                         f"{', '.join(plan)}")
    plan = {name: arm for name, arm in plan.items() if not args.arms or name in args.arms}
    log_dir = args.log_dir or args.out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {name: [] for name in plan}
    for process in range(args.processes):
        for name, arm in plan.items():
            print(f"process {process + 1}/{args.processes}: {name}", flush=True)
            log = log_dir / f"{name.replace('=', '')}-p{process}.log"
            results[name].append(run_arm(str(ckpt.path), arm, passes, args, log))
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result = {"environment": run, "settings": {**settings, "phases": PHASES},
              "arms": {n: list(a) for n, a in plan.items()}, "results": results,
              "summary": summary(results)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / RESULTS_FILE).write_text(json.dumps(portable(result), indent=1))
    print(table(result))
    print(f"results: {args.out / RESULTS_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
