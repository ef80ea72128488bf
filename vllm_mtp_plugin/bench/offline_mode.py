"""Offline mode: each configuration runs in its own process through ``offline.run_config``.

One process per configuration is what lets ``VLLM_PLUGINS=""`` select vLLM's in-tree class (plugins
load once per process) and keeps one engine's warm caches from favouring the next. The child times
every engine step (``steptimer``), which the ideal bound needs.
"""

from __future__ import annotations

from pathlib import Path

from ..offline import OfflineConfig, run_config
from .analysis import finish_row, latency_summary
from .checkpoints import Checkpoint
from .interference import Meter
from .sweep import Config, Sweep


def offline_config(sweep: Sweep, ckpt: Checkpoint, config: Config, prompts: list[str]):
    return OfflineConfig(
        model=str(ckpt.path), num_speculative_tokens=config.k, impl=config.impl, prompts=prompts,
        max_tokens=sweep.max_tokens, max_model_len=sweep.max_model_len, ignore_eos=True,
        warmup_prompts=sweep.warmup, repeats=sweep.repeats,
        llm_kwargs={"dtype": sweep.dtype, "max_num_seqs": config.concurrency, "seed": sweep.seed},
        step_timings=True,
    )


def run_offline(sweep: Sweep, ckpt: Checkpoint, config: Config, prompts: list[str],
                log_path: Path) -> dict:
    """Measure one configuration; return its result row (see ``analysis.finish_row``)."""
    with Meter() as meter:
        result = run_config(offline_config(sweep, ckpt, config, prompts), timeout=sweep.timeout,
                            log_path=str(log_path))
    runs = []
    for run in result["runs"]:
        requests = run.get("requests") or []
        runs.append({
            "seconds": run["seconds"],
            "output_tokens": run["output_tokens"],
            "output_tok_s": run["output_tokens"] / run["seconds"],
            "spec_decode": run["spec_decode"] if config.k else None,
            "ttft_ms": latency_summary(r["ttft"] for r in requests),
            "tpot_ms": latency_summary(r["tpot"] for r in requests),
            "steps": run.get("steps"),
        })
    drafter = result.get("drafter") or {}
    row = {
        "mode": "offline", "checkpoint": ckpt.label, "checkpoint_path": str(ckpt.path),
        "parameters": ckpt.parameters, "impl": config.impl, "k": config.k,
        "concurrency": config.concurrency, "num_prompts": len(prompts),
        "max_tokens": sweep.max_tokens, "repeats": sweep.repeats,
        "init_seconds": result.get("init_seconds"),
        "drafter_class": drafter.get("class"), "draft_bytes": drafter.get("allocated_bytes"),
        "log": str(log_path), "interference": meter.result(),
    }
    return finish_row(row, runs)
