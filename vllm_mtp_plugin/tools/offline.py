"""Run one offline vLLM engine configuration in a fresh process and report what it did, as JSON.

Each configuration gets its own process because vLLM loads plugins once per process: the in-tree
class is selected with ``VLLM_PLUGINS=""`` (vLLM's own switch), ours with the plugin loaded.
The child reports generated token ids, the spec-decode counters, the drafter's class, the parameter
bytes each model allocated for loading, and wall-clock timings. ``run_config`` is the API; ``python -m vllm_mtp_plugin.tools.offline`` the child.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

IMPLEMENTATIONS = ("plugin", "in-tree")


@dataclasses.dataclass
class OfflineConfig:
    model: str
    num_speculative_tokens: int = 0
    impl: str = "plugin"
    prompts: list[str] = dataclasses.field(default_factory=list)
    max_tokens: int = 32
    max_model_len: int = 1024
    ignore_eos: bool = True
    warmup_prompts: int = 0
    repeats: int = 1
    llm_kwargs: dict = dataclasses.field(default_factory=dict)
    # Record per-engine-step timings (``bench/steptimer.py``) into each run's ``steps``.
    step_timings: bool = False
    # vLLM's default process mode (engine core spawned, config pickled, default executor) instead
    # of the faster in-process engine. Allocated bytes are then measured in another process: None.
    default_process_mode: bool = False
    # Merged into the speculative config, e.g. {"method": "draft_model", "model": DIR}.
    speculative_overrides: dict = dataclasses.field(default_factory=dict)


def child_env(impl: str, base: dict[str, str] | None = None,
              default_process_mode: bool = False) -> dict[str, str]:
    """Environment for a child engine: ``in-tree`` disables every general plugin, ours included."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {impl!r}; choose one of {IMPLEMENTATIONS}")
    env = dict(os.environ if base is None else base)
    if default_process_mode:
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        # The drafter report sends a function to the workers (``collective_rpc``); across
        # processes vLLM serializes callables only with this switch. Nothing else uses it.
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    else:
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if impl == "in-tree":
        env["VLLM_PLUGINS"] = ""
    elif env.get("VLLM_PLUGINS") == "":
        del env["VLLM_PLUGINS"]
    return env


def run_config(config: OfflineConfig, timeout: float = 900.0, log_path: str | None = None) -> dict:
    """Run ``config`` in a child process; return its JSON report. Raises with the child's log tail."""
    with tempfile.TemporaryDirectory() as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request.write_text(json.dumps(dataclasses.asdict(config)))
        log = Path(log_path) if log_path else Path(tmp) / "child.log"
        with open(log, "w") as out:
            proc = subprocess.run(
                [sys.executable, "-m", "vllm_mtp_plugin.tools.offline", str(request), str(result)],
                stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                env=child_env(config.impl, default_process_mode=config.default_process_mode),
            )
        if proc.returncode != 0 or not result.exists():
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
            raise RuntimeError(f"offline run failed (exit {proc.returncode}):\n{tail}")
        return json.loads(result.read_text())


# ------------------------------------------------------------------------- the child process


def _record_allocated_bytes() -> dict:
    """Wrap vLLM's weight loading to measure each model's parameter bytes as allocated.

    A measurement hook of this tool only. It reads the sizes when loading starts: vLLM's proposer
    deletes a drafter's own embedding and head copies right after loading, and on CPU vLLM repacks
    linear weights after loading, so neither count is visible later.
    """
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    record: dict = {}
    original = DefaultModelLoader.load_weights

    def load_weights(self, model, model_config):
        name = f"{type(model).__module__}:{type(model).__name__}"
        record[name] = sum(p.numel() * p.element_size() for p in model.parameters())
        return original(self, model, model_config)

    DefaultModelLoader.load_weights = load_weights
    return record


def _drafter_report(llm) -> dict:
    def inspect(worker):
        runner = worker.model_runner
        drafter = getattr(getattr(runner, "drafter", None), "model", None)
        if drafter is None:
            return None
        return {"class": f"{type(drafter).__module__}:{type(drafter).__name__}"}

    return llm.collective_rpc(inspect)[0]


def _request_latency(output) -> dict:
    """TTFT and TPOT of one finished request from the engine's own timestamps (seconds).

    ``generate`` submits every prompt at once, so with fewer batch slots than prompts a request
    waits in the queue; TTFT counts from when it was first scheduled (like a client that sends a
    request when a slot frees up), ``queued`` is the wait. TPOT is (last token - first token) /
    (tokens - 1), as ``vllm bench serve`` defines it.
    """
    stats = getattr(output, "metrics", None)
    n = len(output.outputs[0].token_ids)
    ts = {k: getattr(stats, k, 0.0) or 0.0 for k in
          ("queued_ts", "scheduled_ts", "first_token_ts", "last_token_ts")}
    ttft = ts["first_token_ts"] - ts["scheduled_ts"] if ts["first_token_ts"] and ts[
        "scheduled_ts"] else None
    queued = ts["scheduled_ts"] - ts["queued_ts"] if ts["scheduled_ts"] and ts["queued_ts"] else None
    tpot = ((ts["last_token_ts"] - ts["first_token_ts"]) / (n - 1)
            if n > 1 and ts["first_token_ts"] and ts["last_token_ts"] else None)
    return {"output_tokens": n, "ttft": ttft, "tpot": tpot, "queued": queued}


def _child(request_path: str, result_path: str) -> None:
    from vllm import LLM, SamplingParams

    from .metrics import counters_from_llm_metrics

    config = OfflineConfig(**json.loads(Path(request_path).read_text()))
    allocated = _record_allocated_bytes()
    kwargs = dict(enforce_eager=True, max_model_len=config.max_model_len, disable_log_stats=False,
                  seed=0)
    if not config.default_process_mode:
        kwargs["distributed_executor_backend"] = "uni"
    kwargs.update(config.llm_kwargs)
    if config.num_speculative_tokens:
        kwargs["speculative_config"] = {"method": "mtp",
                                        "num_speculative_tokens": config.num_speculative_tokens,
                                        **config.speculative_overrides}
    t0 = time.perf_counter()
    llm = LLM(config.model, **kwargs)
    init_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=config.max_tokens,
                            ignore_eos=config.ignore_eos)
    if config.warmup_prompts:
        llm.generate(config.prompts[: config.warmup_prompts], params, use_tqdm=False)
    runs = []
    for _ in range(config.repeats):
        if config.step_timings:
            from .bench import steptimer

            llm.collective_rpc(steptimer.install)
        before = counters_from_llm_metrics(llm.get_metrics())
        t0 = time.perf_counter()
        outputs = llm.generate(config.prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        counters = counters_from_llm_metrics(llm.get_metrics()) - before
        runs.append({
            "seconds": elapsed,
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            "spec_decode": counters.summary(),
            "requests": [_request_latency(o) for o in outputs],
        })
        if config.step_timings:
            runs[-1]["steps"] = steptimer.summarize(llm.collective_rpc(steptimer.collect)[0])
    drafter = _drafter_report(llm) if config.num_speculative_tokens else None
    if drafter is not None:
        drafter["allocated_bytes"] = allocated.get(drafter["class"])
    result = {
        "config": dataclasses.asdict(config),
        "allocated_bytes": allocated,
        "init_seconds": init_s,
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "texts": [o.outputs[0].text for o in outputs],
        "runs": runs,
        "spec_decode": runs[-1]["spec_decode"],
        "drafter": drafter,
    }
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
