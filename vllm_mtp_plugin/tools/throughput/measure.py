"""What ``vllm-mtp tune`` measures, through vLLM in its default compiled mode.

One engine per k = 0 .. max-k (vLLM fixes k per engine), each running one pass per concurrency c:
c requests at once (``max_num_seqs`` = the largest c), so every decode step holds c requests. Per
(k, c) the engine's own step timings (``engine/steptimer.py``) give the median decode step: with
k > 0 that is verifying c * (k + 1) tokens plus k draft forwards; the pass's wall time minus the
time inside the model runner gives what each step costs outside it (scheduling, output
processing). vLLM's counters of the k = max-k engine give the acceptance per draft position.

Sampled traffic (``--temperature`` > 0) measures every k > 0 once per draft method (vLLM's
``speculative_config.draft_sample_method``: greedy argmax drafts, or probabilistic drafts that
the rejection sampler weighs with the drafter's probabilities), since the method sets both the
acceptance and what a draft step costs; the points carry their method.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from ..engine.engine_args import DRAFT_SAMPLE_METHODS
from ..engine.offline import OfflineConfig, run_config


@dataclasses.dataclass
class TuneRun:
    model: str
    prompts: list
    concurrencies: list[int]
    max_k: int = 3
    max_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0
    warmup: int = 1
    repeats: int = 1
    # vLLM engine arguments given on the command line (non-default values only).
    engine_args: dict = dataclasses.field(default_factory=dict)
    timeout: float = 1800.0
    # speculative_config.draft_sample_method values to measure (k > 0 engines, one per method).
    draft_sample_methods: list[str] = dataclasses.field(default_factory=lambda: ["greedy"])

    def __post_init__(self):
        if self.max_k < 1:
            raise ValueError("--max-k must be at least 1")
        if self.max_tokens < 2:
            raise ValueError("--max-tokens must be at least 2 (decode steps are what is measured)")
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ValueError("concurrencies must be >= 1")
        self.concurrencies = sorted(set(self.concurrencies))
        unknown = sorted(set(self.draft_sample_methods) - set(DRAFT_SAMPLE_METHODS))
        if unknown or not self.draft_sample_methods:
            raise ValueError(f"draft sample methods must be some of {DRAFT_SAMPLE_METHODS}, "
                             f"not {unknown or 'none'}")
        # vLLM's order (greedy first): ties go to vLLM's default whatever order was given
        self.draft_sample_methods = sorted(set(self.draft_sample_methods),
                                           key=DRAFT_SAMPLE_METHODS.index)


@dataclasses.dataclass
class Measured:
    """What the engines measured: every (k, c) point (``point``), and per draft method the
    spec-decode counters of its k = max-k engine's largest pass."""

    points: list[dict]
    counters: dict[str, dict]  # {draft method: counters}, in the run's order of methods
    compilation: list[str]
    ks: list[int] | None = None  # the k vLLM accepts for the checkpoint (``allowed_ks``)
    logs: str | None = None  # where the engine logs are


def passes(run: TuneRun) -> list[dict]:
    """One pass per concurrency: the first c prompts (cycled), all in flight together."""
    sampling = {"temperature": run.temperature, **({"seed": run.seed} if run.temperature else {})}
    chat = bool(run.prompts) and isinstance(run.prompts[0], list)
    return [{"label": {"concurrency": c},
             "prompts": [run.prompts[i % len(run.prompts)] for i in range(c)],
             "sampling": sampling, "chat": chat} for c in run.concurrencies]


def engine_config(run: TuneRun, k: int, draft_sample_method: str | None = None) -> OfflineConfig:
    """Prefix caching off unless asked for: the passes share prompts, and a cached prompt would
    hide its prefill. Several ranks need vLLM's default process mode (the in-process engine runs
    one)."""
    llm_kwargs = {"max_num_seqs": max(run.concurrencies), "seed": run.seed,
                  "enable_prefix_caching": False, **run.engine_args}
    ranks = (run.engine_args.get("tensor_parallel_size") or 1) * (
        run.engine_args.get("pipeline_parallel_size") or 1) * (
        run.engine_args.get("data_parallel_size") or 1)
    per_concurrency = passes(run)
    return OfflineConfig(model=run.model, num_speculative_tokens=k, passes=per_concurrency,
                         prompts=per_concurrency[0]["prompts"], max_tokens=run.max_tokens,
                         ignore_eos=True, warmup_prompts=run.warmup, repeats=run.repeats,
                         llm_kwargs=llm_kwargs, step_timings=True, default_process_mode=ranks > 1,
                         max_model_len=run.engine_args.get("max_model_len"),
                         speculative_overrides={"draft_sample_method": draft_sample_method}
                         if k and draft_sample_method else {})


def allowed_ks(model: str, max_k: int) -> list[int]:
    """The k vLLM accepts for this checkpoint: with n MTP layers, k <= n or a multiple of n
    (``config/speculative.py``: layers are reused in turn)."""
    import json
    from pathlib import Path

    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    n = config.get("num_nextn_predict_layers") or 1
    return [k for k in range(max_k + 1) if k <= n or k % n == 0]


def point(k: int, c: int, runs: list[dict], draft_sample_method: str | None = None) -> dict:
    """The measurement of (k, c): medians over repeats of step time and outside-runner time."""
    from ..stats import median as med

    steps = [r["steps"] for r in runs]
    outside = [(r["seconds"] - s["all_steps_s"]) / s["steps"] for r, s in zip(runs, steps)
               if s.get("steps")]
    prefill = [s.get("prefill_s") for s in steps]  # the steps that start requests
    # The decode steps' mean next to their median: far apart when other work shared the machine.
    mean = [(s["all_steps_s"] - (s.get("prefill_s") or 0.0)) / s["decode_steps"] for s in steps
            if s.get("decode_steps") and s.get("all_steps_s") is not None]
    return {
        "k": k, "concurrency": c, "draft_sample_method": draft_sample_method if k else None,
        "step_ms": med(s.get("step_ms") for s in steps),
        "mean_step_ms": med(mean) * 1e3 if mean else None,
        "draft_ms": med(s.get("draft_ms") for s in steps) if k else 0.0,
        "outside_ms": med(outside) * 1e3 if outside else 0.0,
        "prefill_ms": (med(prefill) or 0.0) * 1e3,
        "tokens_per_step": med(s.get("tokens_per_step") for s in steps),
        "decode_steps": med(s.get("decode_steps") for s in steps),
        "measured_tok_s": med(r["output_tokens"] / r["seconds"] for r in runs),
        "spec_decode": runs[-1]["spec_decode"] if k else None,
    }


def measure(run: TuneRun, log_dir: Path, on_start: Callable[[str], None] = print,
            reverse: bool = False) -> Measured:
    """Every (k, c) point per draft method, the acceptance counters of each method's k = max-k
    engine, and the engines' compilation. ``reverse`` runs the engines from the largest k down: a
    re-measurement in the other order lets a drift of the machine's speed hit the k's the other
    way round."""
    from ..engine.metrics import total_counters

    points, compilation = [], set()
    at_max_k: dict[str, list[dict]] = {m: [] for m in run.draft_sample_methods}
    ks = allowed_ks(run.model, run.max_k)
    for k in sorted(set(range(run.max_k + 1)) - set(ks)):
        on_start(f"k = {k}: skipped (vLLM takes k <= the MTP layers or a multiple of them)")
    several = len(run.draft_sample_methods) > 1
    engines = [(0, None)] + [(k, m) for m in run.draft_sample_methods for k in ks if k]
    for k, method in (reversed(engines) if reverse else engines):
        name = f"k = {k}" + (f", {method} drafts" if several and k else "")
        on_start(f"{name}: one engine, concurrency {', '.join(map(str, run.concurrencies))}")
        log = f"tune-k{k}" + (f"-{method}" if several and k else "") + ".log"
        result = run_config(engine_config(run, k, method), timeout=run.timeout,
                            log_path=str(log_dir / log))
        compilation.add(str(result.get("compilation")))
        for c in run.concurrencies:
            runs = [r for r in result["runs"] if r.get("pass") == {"concurrency": c}]
            points.append(point(k, c, runs, method))
            if k == ks[-1] and c == run.concurrencies[-1]:  # the largest pass: no prompt twice
                at_max_k[method] += [r["spec_decode"] for r in runs]
    return Measured(points=points,
                    counters={m: total_counters(runs).summary() for m, runs in at_max_k.items()},
                    compilation=sorted(compilation), ks=ks)
