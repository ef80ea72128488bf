"""The controller's view of vLLM's engine steps: each scheduled step's start, each finished
step's duration, batch, prefill and drafts, from the scheduler's own objects
(``SchedulerOutput``, ``ModelRunnerOutput``); and a log line now and then saying what it decided.

A step's cost is the interval between two finished steps while the engine stays busy (from the
previous step's ``update_from_output`` to its own): the rate the engine produces steps at, with
or without a batch queue (async scheduling). It holds what the engine does per step outside the
model runner too: the previous step's output update and the output processing of an in-process
``LLM``, which grow with the tokens a step emits, so they weigh more on a step that accepted
drafts; timed from its ``schedule`` alone, a step at k > 0 looked a few per cent cheaper than
it is. The first step after the engine went idle is timed from its ``schedule``.
"""

from __future__ import annotations

import json
import logging
import os
import time

from .controller import AdaptiveK, StepOutcome, settings_from_env
from .state_file import write_state

logger = logging.getLogger("vllm.vllm_mtp_plugin")

LOG_INTERVAL_ENV = "VLLM_MTP_ADAPTIVE_K_LOG_INTERVAL"
IN_FLIGHT_LIMIT = 16  # scheduled steps remembered until they finish (vLLM keeps 1-2 in flight)
STATE_INTERVAL = 1.0  # seconds between two writes of the state /metrics reads


def log_interval(environ=None) -> float:
    """Seconds between two summaries in the log (``LOG_INTERVAL_ENV``, default 30; 0: every
    step)."""
    environ = os.environ if environ is None else environ
    text = environ.get(LOG_INTERVAL_ENV, "30").strip() or "30"
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ValueError(f"{LOG_INTERVAL_ENV}={text!r}: give seconds, 0 or more")
    return seconds


class EngineSteps:
    """The controller of one scheduler, fed by its steps. A failure inside it is logged once and
    leaves the engine serving at the configured k (``failed``): it must never stop the engine."""

    def __init__(self, max_k: int, ks: tuple[int, ...] | None = None, clock=time.perf_counter):
        self.controller = AdaptiveK(settings_from_env(max_k, ks))
        self.fallback_k = max(self.controller.ks)
        self.failed = False
        self.clock = clock
        self.started: dict[int, float] = {}
        self.last_finished: float | None = None
        self.log_interval = log_interval()
        self.next_log = clock() + self.log_interval
        self.next_state = clock()
        logger.info("vllm-mtp-plugin: adaptive k on: each step drafts 0..%d tokens, the k that "
                    "measured acceptance and step cost say gives the most tokens per second "
                    "(choices %s; a summary every %.0f s)", max_k,
                    list(self.controller.ks), self.log_interval)

    def choose(self, batch_size: int) -> int:
        if not self.failed:
            try:
                return self.controller.choose(batch_size)
            except Exception as exc:  # noqa: BLE001 - the engine goes on at the configured k
                self._fail(exc)
        return self.fallback_k

    def _fail(self, exc: Exception) -> None:
        self.failed = True
        logger.warning("vllm-mtp-plugin: adaptive k stopped (%s: %s); every step drafts %d "
                       "tokens from now on", type(exc).__name__, exc, self.fallback_k)

    def scheduled(self, scheduler_output, started: float) -> None:
        if scheduler_output.total_num_scheduled_tokens <= 0:
            return
        if len(self.started) >= IN_FLIGHT_LIMIT:  # a step vLLM never finished (aborted engine)
            self.started.pop(next(iter(self.started)))
        self.started[id(scheduler_output)] = started

    def finished(self, scheduler_output, model_runner_output) -> None:
        if self.failed:
            return
        try:
            self._finished(scheduler_output, model_runner_output)
        except Exception as exc:  # noqa: BLE001 - the engine goes on at the configured k
            self._fail(exc)

    def idle(self) -> None:
        """Nothing left to schedule: publish the state now (traffic may not come back soon); the
        next step is timed from its own schedule (the wait for traffic is not a step's cost)."""
        self.last_finished = None
        if not self.failed:
            try:
                write_state(self.controller.summary())
            except Exception as exc:  # noqa: BLE001 - the engine goes on at the configured k
                self._fail(exc)
                return
            self.next_state = self.clock() + STATE_INTERVAL

    def _finished(self, scheduler_output, model_runner_output) -> None:
        now = self.clock()
        started = self.started.pop(id(scheduler_output), None)
        seconds = None
        if started is not None:
            begin = started if self.last_finished is None else self.last_finished
            seconds = now - begin
        self.last_finished = now
        if scheduler_output.total_num_scheduled_tokens <= 0:
            return
        self.controller.observe(step_outcome(scheduler_output, model_runner_output, seconds))
        if now >= self.next_log or now >= self.next_state:
            summary = self.controller.summary()
            if now >= self.next_state:
                self.next_state = now + STATE_INTERVAL
                write_state(summary)
            if now >= self.next_log:
                self.next_log = now + self.log_interval
                logger.info("vllm-mtp-plugin: adaptive k: %s",
                            json.dumps(summary, separators=(",", ":")))


def step_outcome(scheduler_output, model_runner_output, seconds: float | None) -> StepOutcome:
    """What the step verified and drafted, read from vLLM's objects: a request whose scheduled
    tokens exceed 1 + its drafts prefilled (part of) a prompt; the drafts it accepted are the
    tokens it sampled beyond the one every step samples."""
    scheduled = scheduler_output.num_scheduled_tokens
    spec = scheduler_output.scheduled_spec_decode_tokens or {}
    # every request runs at least 1 + its drafts, so the sums are equal only if none ran more
    prefill = sum(scheduled.values()) != len(scheduled) + sum(len(t) for t in spec.values())
    if not spec:  # nothing verified (every step at k = 0): no acceptance to read
        return StepOutcome(batch_size=len(scheduled), verified_k=0,
                           drafted_k=scheduler_output.num_spec_tokens_to_schedule,
                           prefill=prefill, seconds=seconds)
    sampled = getattr(model_runner_output, "sampled_token_ids", None) or []
    index = getattr(model_runner_output, "req_id_to_index", None) or {}
    drafts = []
    for req_id, tokens in spec.items():
        position = index.get(req_id)
        if not tokens or position is None or position >= len(sampled) or not sampled[position]:
            continue  # nothing sampled for it this step (vLLM's update skips it too)
        accepted = max(len(sampled[position]) - 1, 0)
        drafts.append((len(tokens), min(accepted, len(tokens))))
    return StepOutcome(batch_size=len(scheduled),
                       verified_k=max((len(t) for t in spec.values()), default=0),
                       drafted_k=scheduler_output.num_spec_tokens_to_schedule,
                       prefill=prefill, seconds=seconds, drafts=tuple(drafts))
