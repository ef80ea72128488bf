"""Per-step timings inside an in-process vLLM worker, to measure what one draft step costs.

The ideal speed-up bound needs the cost of one draft step relative to one target step, and the
only honest source is the engine itself: this wraps four methods of the worker's model runner
(instance attributes only, nothing in vLLM's classes is changed) and records, for every engine
step, the wall time of

* ``execute_model``: input preparation + the target forward + logits,
* ``_model_forward``: the target forward alone,
* ``sample_tokens``: sampling + rejection + drafting (+ bookkeeping),
* ``propose_draft_token_ids``: drafting alone (k drafter forwards + their logits).

A step is ``execute_model`` followed by ``sample_tokens``. CPU execution is synchronous, so wall
time is compute time. Used by ``offline.py``'s child when ``OfflineConfig.step_timings`` is set.
"""

from __future__ import annotations

import statistics
import time

ATTR = "_mtp_bench_step_records"
WRAPPED = ("execute_model", "_model_forward", "sample_tokens", "propose_draft_token_ids")


def _wrap(runner, name: str, records: list[dict]) -> None:
    original = getattr(runner, name)

    def timed(*args, **kwargs):
        if name == "execute_model":
            sched = args[0] if args else kwargs.get("scheduler_output")
            records.append({
                "tokens": getattr(sched, "total_num_scheduled_tokens", 0),
                "new_requests": len(getattr(sched, "scheduled_new_reqs", ()) or ()),
            })
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            if records:
                step = records[-1]
                step[name] = step.get(name, 0.0) + time.perf_counter() - t0

    setattr(runner, name, timed)


def install(worker) -> bool:
    """Wrap the runner's methods once; later calls only clear the records. Runs in the worker."""
    runner = worker.model_runner
    if getattr(runner, ATTR, None) is None:
        records: list[dict] = []
        setattr(runner, ATTR, records)
        for name in WRAPPED:
            if hasattr(runner, name):
                _wrap(runner, name, records)
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
        "max_step_ms": max(every, default=0.0) * 1e3,
        "step_ms": median_ms(total),
        "draft_ms": median_ms(draft),
        "target_ms": median_ms([t - d for t, d in zip(total, draft)]),
        "forward_ms": median_ms([s.get("_model_forward", 0.0) for s in decode]),
        "tokens_per_step": statistics.median([s["tokens"] for s in decode]) if decode else None,
    }
