"""Offline mode: each configuration runs in fresh processes through ``offline.run_config``.

One process per run is what lets ``MTP_PLUGIN=off`` select vLLM's in-tree class (plugins load once
per process). Several processes per configuration, alternated (``process_order``), because on a
small VM the speed of an engine process is a lottery: the same configuration ran at 25 or 37 tokens/s
in different processes, steady within each (where the weights land in memory, presumably). The
row reports the median over processes of each process's median, and every run with its process
index. The child times every engine step (``steptimer``), which the ideal bound needs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..engine.offline import OfflineConfig, run_config
from .analysis import finish_row, latency_summary
from ..tiny.presets import Checkpoint
from ..engine.interference import Meter, disturbed
from .sweep import Config, Sweep


def filled(passes: list[dict], rows: int) -> list[dict]:
    """The passes with exactly ``rows`` requests (prompts and per-prompt sampling cycled or cut),
    so that every decode step of a floor configuration holds ``rows`` requests: a request more
    would run alone after the others."""
    def repeat(items):
        return [items[i % len(items)] for i in range(rows)]

    return [{**p, "prompts": repeat(p["prompts"]),
             **({"sampling": repeat(p["sampling"])} if isinstance(p.get("sampling"), list) else {})}
            for p in passes]


def warmup_prompts(warmup_batches: int, concurrency: int) -> int:
    """Warm-up requests before the measured passes: ``warmup_batches`` batches of the measured
    concurrency (the first pass's prompts, cycled), so that every configuration has run steps of
    the batch size it is measured at (its first kernels; adaptive k's first bursts and early
    re-measuring for that size) before the clock starts."""
    return warmup_batches * concurrency


def offline_config(sweep: Sweep, ckpt: Checkpoint, config: Config, passes: list[dict]):
    if config.fill:
        passes = filled(passes, config.concurrency)
    return OfflineConfig(
        model=str(ckpt.path), num_speculative_tokens=config.k, impl=config.impl,
        prompts=passes[0]["prompts"], passes=passes,
        max_tokens=sweep.max_tokens, max_model_len=sweep.max_model_len, ignore_eos=True,
        warmup_prompts=warmup_prompts(sweep.warmup, config.concurrency), repeats=sweep.repeats,
        llm_kwargs={"dtype": ckpt.engine["dtype"] or sweep.dtype,
                    "enforce_eager": sweep.eager or ckpt.engine["eager"],
                    "max_num_seqs": config.concurrency, "seed": sweep.seed},
        step_timings=True, runner=ckpt.engine["runner"],
        speculative_overrides=config.sample_methods(),
    )


def run_process(sweep: Sweep, ckpt: Checkpoint, config: Config, passes: list[dict],
                log_path: Path) -> dict:
    """One engine process for ``config``: its report plus the interference during it. A process
    during which other work used the machine (``interference.disturbed``) is run again, up to
    ``sweep.disturbed_retries`` times: a disturbed measurement is replaced, never pooled. The
    report keeps what each discarded attempt saw; if every attempt was disturbed, the last one
    stays and its row's "other CPU s" says so."""
    discarded = []
    for attempt in range(sweep.disturbed_retries + 1):
        with Meter() as meter:
            result = run_config(offline_config(sweep, ckpt, config, passes), timeout=sweep.timeout,
                                log_path=str(log_path), env=config.verify_env())
        result["interference"] = meter.result()
        if not disturbed(result["interference"]) or attempt == sweep.disturbed_retries:
            break
        discarded.append(result["interference"])
    result["discarded_disturbed"] = discarded
    result["log"] = str(log_path)
    return result


def make_row(sweep: Sweep, ckpt: Checkpoint, config: Config, measured: dict,
             results: list[dict]) -> dict:
    """The result row of one pass (``measured``) of a configuration, from its processes' reports."""
    runs = []
    prompts = measured["prompts"]
    for process, result in enumerate(results):
        for run in result["runs"]:
            if run.get("pass", measured["label"]) != measured["label"]:
                continue
            requests = run.get("requests") or []
            runs.append({
                "process": process,
                "seconds": run["seconds"],
                "output_tokens": run["output_tokens"],
                "output_tok_s": run["output_tokens"] / run["seconds"],
                "spec_decode": run["spec_decode"] if config.k else None,
                "ttft_ms": latency_summary(r["ttft"] for r in requests),
                "tpot_ms": latency_summary(r["tpot"] for r in requests),
                "steps": run.get("steps"),
                "by_drafted_k": run.get("by_drafted_k"),
                "token_ids": run.get("token_ids"),
            })
    drafter = results[0].get("drafter") or {}
    other = [r["interference"]["other_cpu_s"] for r in results]
    row = {
        "mode": "offline", "checkpoint": ckpt.label, "checkpoint_path": str(ckpt.path),
        "parameters": ckpt.parameters, "impl": config.impl, "k": config.k,
        "concurrency": config.concurrency, **measured["label"],
        "num_prompts": config.concurrency if config.fill else len(prompts),
        "mla_verify": config.mla_verify, **config.recorded_sample_methods(),
        "floor_only": config.fill,
        "compilation": sweep.compilation_for(ckpt),
        "max_tokens": sweep.max_tokens, "repeats": sweep.repeats, "processes": len(results),
        "init_seconds": [r.get("init_seconds") for r in results],
        "drafter_class": drafter.get("class"), "draft_bytes": drafter.get("allocated_bytes"),
        "plugin_registered": results[0].get("plugin_registered"),
        "logs": [r["log"] for r in results],
        "interference": {
            "other_cpu_s": None if None in other else sum(other),
            "wall_s": sum(r["interference"]["wall_s"] for r in results),
            "discarded_disturbed": [d for r in results for d in r.get("discarded_disturbed", [])],
        },
    }
    return finish_row(row, runs)


def process_order(configs: list[Config], processes: int, order: str) -> list[tuple[int, Config]]:
    """(round, configuration) of every engine process, in the order they run.

    ``grid``: round by round over the whole grid, so a configuration's processes are spread over
    the whole run. ``cell``: cell by cell (a checkpoint and concurrency: the configurations a cell
    compares), its rounds one after another, every other round reversed (A B C, C B A, A B C): the
    configurations a cell compares run minutes apart rather than a run's length apart, and a speed
    that drifts steadily during the cell weighs on each of them alike."""
    if order == "grid":
        return [(round_, c) for round_ in range(processes) for c in configs]
    cells: dict[tuple, list[Config]] = {}
    for c in configs:
        cells.setdefault((c.checkpoint, c.concurrency, c.fill), []).append(c)
    return [(round_, c) for cell in cells.values() for round_ in range(processes)
            for c in (cell if round_ % 2 == 0 else cell[::-1])]


def run_offline(sweep: Sweep, checkpoints: dict[str, Checkpoint], passes: list[dict],
                log_dir: Path, on_start: Callable[[str], None] = lambda label: None,
                on_done: Callable[[], None] = lambda: None) -> list[dict]:
    """Every configuration, ``sweep.processes`` processes in ``sweep.order``; one row per
    configuration and pass."""
    configs = sweep.configs()
    results: dict[Config, list[dict]] = {c: [] for c in configs}
    for round_, config in process_order(configs, sweep.processes, sweep.order):
        on_start(f"{config.label()} process {round_ + 1}/{sweep.processes}")
        ckpt = checkpoints[config.checkpoint]
        log_path = log_dir / (f"offline-{ckpt.label}-{config.impl}-k{config.k}"
                              f"-c{config.concurrency}{config.log_suffix()}-p{round_}.log")
        results[config].append(run_process(sweep, ckpt, config, passes, log_path))
        on_done()
    return [make_row(sweep, checkpoints[c.checkpoint], c, measured, results[c])
            for c in configs for measured in passes]
