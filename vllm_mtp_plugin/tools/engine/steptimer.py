"""Per-step timings inside an in-process vLLM worker, to measure what one draft step costs.

The ideal speed-up bound needs the cost of one draft step relative to one target step, and the
only honest source is the engine itself: this wraps four methods around the worker's model runner
(instance attributes only, nothing in vLLM's classes is changed) and records, for every engine
step, the wall time of

* ``execute_model``: input preparation + the target forward + logits,
* ``_model_forward``: the target forward alone,
* ``sample_tokens``: sampling + rejection + drafting (+ bookkeeping),
* ``propose_draft_token_ids``: drafting alone (k drafter forwards + their logits).

Those are the V1 runner's method names. Model Runner V2 has no ``_model_forward`` nor
``propose_draft_token_ids``: its ``execute_model`` calls the target model directly and its
``sample_tokens`` calls ``speculator.propose``, so there the target model's ``forward`` and the
speculator's ``propose`` are timed under the same labels. A method that is missing raises instead
of leaving a column empty.

A step is ``execute_model`` followed by ``sample_tokens``. CPU execution is synchronous, so wall
time is compute time. Used by ``offline.py``'s child when ``OfflineConfig.step_timings`` is set.
"""

from __future__ import annotations

import statistics
import time

from .worker_report import model_runner_kind

ATTR = "_mtp_bench_step_records"
WRAPPED = ("execute_model", "_model_forward", "sample_tokens", "propose_draft_token_ids")


def _timed_methods(runner) -> list[tuple[object, str, str]]:
    """(object, method, label) for each timed method of this runner; raises if one is missing."""
    kind = model_runner_kind(runner)
    if kind == "v1":
        methods = [(runner, name, name) for name in WRAPPED]
    elif kind == "v2":
        methods = [(runner, "execute_model", "execute_model"),
                   (runner.model, "forward", "_model_forward"),
                   (runner, "sample_tokens", "sample_tokens")]
        if runner.speculator is not None:
            methods.append((runner.speculator, "propose", "propose_draft_token_ids"))
    else:
        raise RuntimeError(f"steptimer knows vLLM's V1 and V2 model runners, not {kind}")
    missing = [f"{type(obj).__name__}.{name}" for obj, name, _ in methods if not hasattr(obj, name)]
    if missing:
        raise RuntimeError(f"steptimer: this vLLM's {kind} runner has no {', '.join(missing)}")
    return methods


def _wrap(obj, name: str, label: str, records: list[dict]) -> None:
    original = getattr(obj, name)

    def timed(*args, **kwargs):
        if label == "execute_model":
            sched = args[0] if args else kwargs.get("scheduler_output")
            records.append({
                "tokens": getattr(sched, "total_num_scheduled_tokens", 0),
                "new_requests": len(getattr(sched, "scheduled_new_reqs", ()) or ()),
                # the drafts this step proposes for the next (per-step k: adaptive k, a table)
                "drafted_k": getattr(sched, "num_spec_tokens_to_schedule", None),
            })
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            if records:
                step = records[-1]
                step[label] = step.get(label, 0.0) + time.perf_counter() - t0

    object.__setattr__(obj, name, timed)


def install(worker) -> bool:
    """Wrap the runner's methods once; later calls only clear the records. Runs in the worker."""
    runner = worker.model_runner
    if getattr(runner, ATTR, None) is None:
        records: list[dict] = []
        setattr(runner, ATTR, records)
        for obj, name, label in _timed_methods(runner):
            _wrap(obj, name, label, records)
    getattr(runner, ATTR).clear()
    return True


def collect(worker) -> list[dict]:
    """The steps recorded since ``install``. Runs in the worker."""
    return list(getattr(worker.model_runner, ATTR, None) or [])


def summarize(steps: list[dict]) -> dict:
    """Medians (ms) over decode steps: steps that start no new request and schedule tokens.

    ``step_ms`` is a whole engine step, ``draft_ms`` the drafting inside it, ``target_ms`` the step
    without drafting (for k > 0 that is the verification step), ``forward_ms`` the target forward.
    """
    decode = [s for s in steps if s.get("tokens") and not s.get("new_requests")]

    def median_ms(values: list[float]) -> float | None:
        return statistics.median(values) * 1e3 if values else None

    total = [s.get("execute_model", 0.0) + s.get("sample_tokens", 0.0) for s in decode]
    draft = [s.get("propose_draft_token_ids", 0.0) for s in decode]
    every = [s.get("execute_model", 0.0) + s.get("sample_tokens", 0.0) for s in steps]
    return {
        "steps": len(steps),
        "decode_steps": len(decode),
        # All steps, prefills included: against the pass's wall time this shows the time spent
        # outside the model runner (scheduling, output processing, other processes).
        "all_steps_s": sum(every),
        # Steps that start requests (their prompts' prefill, with whatever decodes share them).
        "prefill_s": sum(e for e, s in zip(every, steps) if s.get("new_requests")),
        "max_step_ms": max(every, default=0.0) * 1e3,
        "step_ms": median_ms(total),
        "draft_ms": median_ms(draft),
        "target_ms": median_ms([t - d for t, d in zip(total, draft)]),
        "forward_ms": median_ms([s.get("_model_forward", 0.0) for s in decode]),
        "tokens_per_step": statistics.median([s["tokens"] for s in decode]) if decode else None,
    }


def by_drafted_k(steps: list[dict]) -> dict[str, dict]:
    """Decode steps grouped by the k they drafted (as strings, JSON's keys): how many, and their
    median time (ms). Where k varies per step this shows what the engine chose and what each
    choice cost; a step's time includes verifying the drafts of the step before it."""
    groups: dict[int, list[float]] = {}
    for s in steps:
        if s.get("tokens") and not s.get("new_requests") and s.get("drafted_k") is not None:
            total = s.get("execute_model", 0.0) + s.get("sample_tokens", 0.0)
            groups.setdefault(int(s["drafted_k"]), []).append(total)
    return {str(k): {"steps": len(times), "step_ms": statistics.median(times) * 1e3}
            for k, times in sorted(groups.items())}
