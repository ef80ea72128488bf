"""The adaptive-k controller: for every engine step, the number of drafts (0 .. the configured
``num_speculative_tokens``) expected to give the most output tokens per second.

A step of ``b`` decoding requests at ``k`` drafts gains ``b * E(k)`` tokens, ``E(k) = 1 + sum of
P(first j drafts accepted), j <= k``, and costs ``cost(b, k)`` seconds; ``b`` is the same for every
k of a step, so the controller picks ``argmax_k E(k) / cost(bucket(b), k)``. Both factors are
measured (``estimates.py``): acceptance from the verifier's results, the cost from the steps'
times. Each batch-size bucket first runs every k for a short burst; later bursts re-measure, in
turn, the k not chosen (their acceptance and cost move with the traffic), ``first_explore``
steps apart at first, doubling up to ``explore_every``, then spaced by what a burst costs
(``explore_overhead``); a k's first-burst costs, measured on a
cold engine, are dropped when it is measured again. A switch needs a gain above ``hysteresis`` and ``min_dwell`` steps at the
current k, so k does not flap on noise.

The k chosen at a step is the number of drafts proposed after it; the next step verifies them.
A step's cost is therefore charged to k only when it verified as many drafts as it drafted.

A machine's speed drifts (other work, frequency, memory): the k served is measured at every
step, the others only in bursts, possibly while the machine ran faster or slower than now. So a
burst's steps are also kept as the ratio of two costs measured side by side: the burst's step to
the served k's cost at that time, pooled per pair of k whichever of the two was served
(``ratios``, as logarithms). One relative cost per k is fitted to all pairs (least squares:
pairs measured at different times need not agree, and three of them could each prefer another
k in a circle), and another k's cost is the served k's cost now times their relative costs.
Two k then compare the same way whichever is served, and a comparison moves with new bursts,
not with every step's noise.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os

import numpy as np

from .estimates import AcceptanceByPosition, StepCosts, batch_bucket


@dataclasses.dataclass(frozen=True)
class ControllerSettings:
    max_k: int
    burst: int = 4            # steps per measuring burst; its first step is a transition
    explore_every: int = 256  # steps of a bucket between two bursts at a k not chosen, at least
    first_explore: int = 16   # ... at first, doubling at every burst up to explore_every
    hysteresis: float = 0.03  # a switch must promise this much more throughput
    min_dwell: int = 16       # steps at a k before switching away from it (bursts aside)
    cost_window: int = 16     # steady steps per (bucket, k) whose median is the cost
    max_sample_age: int = 4096  # steps after which a cost sample no longer counts
    acceptance_half_life: float = 200.0  # engine steps
    # At k = 0 nothing is verified, so nothing shows acceptance coming back: one step in a while
    # drafts the smallest k, as often as costs this fraction of k = 0's time (``_probe_every``).
    probe_overhead: float = 0.01
    probe_every_unmeasured: int = 32  # steps between probes while a cost is not measured yet
    # Bursts at a k not chosen, once the first ones are done, no more often than costs this
    # fraction of the served k's time (``_explore_interval``), nor less often than every k
    # measured within ``max_sample_age``.
    explore_overhead: float = 0.02
    # The k it may choose (None: 0 .. max_k); vLLM prepares for the k its table names only.
    ks: tuple[int, ...] | None = None

    def choices(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.ks))) if self.ks else tuple(range(self.max_k + 1))


# Operators' overrides of ControllerSettings fields (integers), e.g. for faster exploration.
SETTING_ENV = {"burst": "VLLM_MTP_ADAPTIVE_K_BURST",
               "explore_every": "VLLM_MTP_ADAPTIVE_K_EXPLORE_EVERY",
               "min_dwell": "VLLM_MTP_ADAPTIVE_K_MIN_DWELL"}


def settings_from_env(max_k: int, ks: tuple[int, ...] | None = None, environ=None
                      ) -> ControllerSettings:
    """The defaults, with the ``SETTING_ENV`` variables that are set (whole numbers >= 1;
    anything else is an error naming the variable)."""
    environ = os.environ if environ is None else environ
    given = {}
    for field, name in SETTING_ENV.items():
        text = environ.get(name, "").strip()
        if not text:
            continue
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"{name}={text!r}: give a whole number of engine steps >= 1")
        given[field] = int(text)
    return ControllerSettings(max_k=max_k, ks=ks, **given)


@dataclasses.dataclass
class BucketState:
    """One batch-size bucket: the k it serves, and the bursts still to run (k per step)."""

    k: int
    plan: collections.deque
    dwell: int = 0
    since_burst: int = 0
    since_probe: int = 0
    explored: int = 0  # bursts at a k not chosen so far (counted up to the longest interval)
    first_bursts_end: int = 0  # the step after the bucket's first bursts
    switches: int = 0
    decision_due: bool = False
    # (k, seconds) of the step that drafted after k = 0 steps, until the step returning to k = 0
    entering: tuple[int, float] | None = None
    switched_at: int = -2  # the controller's step count at the last switch


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """What one finished engine step tells the controller.

    ``drafts``: per request that verified drafts, (drafts verified, drafts accepted).
    ``verified_k``: the most drafts a request verified (the k drafted a step earlier);
    ``drafted_k``: the k this step drafted; ``prefill``: the step also ran prompt tokens (its cost
    is not a decode step's); ``seconds``: the interval from the previous step's end (while the
    engine was busy) to this step's end."""

    batch_size: int
    verified_k: int
    drafted_k: int
    prefill: bool
    seconds: float | None
    drafts: tuple[tuple[int, int], ...] = ()


class AdaptiveK:
    """Chooses k per step (``choose``), learns from each finished step (``observe``)."""

    def __init__(self, settings: ControllerSettings):
        if settings.max_k < 1:
            raise ValueError(f"adaptive k needs num_speculative_tokens >= 1, got {settings.max_k}")
        self.settings = settings
        self.ks = settings.choices()
        self.acceptance = AcceptanceByPosition(settings.max_k, settings.acceptance_half_life)
        self.costs = StepCosts(settings.cost_window, settings.max_sample_age)
        # ((bucket, lower k), higher k) -> log(cost of the higher / cost of the lower), from
        # burst steps against the served k's cost at that time
        self.ratios = StepCosts(settings.cost_window, settings.max_sample_age)
        self._ratio_samples = 0  # ratios measured so far (a fit is redone when this moves)
        self._fits: dict[tuple[int, int], tuple[int, int, dict[int, float]]] = {}
        # (bucket, k) -> seconds that leaving k = 0 for k and coming back cost (the step drafting
        # k after k = 0 and the step returning) beyond two k = 0 steps
        self.leaving_zero = StepCosts(settings.cost_window, settings.max_sample_age)
        self.burst_at: dict[tuple[int, int], int] = {}  # (bucket, k) -> step its last burst began
        self.remeasured: set[tuple[int, int]] = set()  # (bucket, k) burst at again since its first
        self.buckets: dict[int, BucketState] = {}
        self.step = 0
        self.steps_at_k: collections.Counter = collections.Counter()

    # ------------------------------------------------------------------------------- choosing

    def choose(self, batch_size: int) -> int:
        """The k for a step of ``batch_size`` scheduled requests (called once per step)."""
        self.step += 1
        bucket = batch_bucket(batch_size)
        state = self.buckets.get(bucket)
        if state is None:
            plan = self._first_bursts(bucket)
            state = self.buckets[bucket] = BucketState(k=max(self.ks), plan=plan,
                                                       first_bursts_end=self.step + len(plan))
        if not state.plan:
            state.since_burst += 1
            # Decide once a burst has ended (with one step in flight its last step is observed
            # by now; with two, all but that one), then at every step once the dwell is served.
            if state.decision_due or state.dwell >= self.settings.min_dwell:
                state.decision_due = False
                self._decide(bucket, state)
            # (the interval's costs are read only once a burst may be due)
            if len(self.ks) > 1 and state.since_burst >= min(self._ramp(state),
                                                             self.settings.explore_every) and \
                    state.since_burst >= self._explore_interval(bucket, state):
                state.since_burst = 0
                if self.settings.first_explore << state.explored < self.settings.explore_every:
                    state.explored += 1
                other = self._stalest_other_k(bucket, state.k)
                self.burst_at[(bucket, other)] = self.step
                if (bucket, other) not in self.remeasured:  # the first burst ran on a cold engine
                    self.remeasured.add((bucket, other))
                    self.costs.expire(bucket, other, before=state.first_bursts_end)
                state.plan.extend([other] * self.settings.burst)
            elif state.k == 0 and not state.plan and max(self.ks) > 0:
                state.since_probe += 1
                if state.since_probe >= self._probe_every(bucket):
                    state.since_probe = 0
                    state.plan.append(min(k for k in self.ks if k > 0))
        if state.plan:
            k = state.plan.popleft()
            state.decision_due = not state.plan
        else:
            state.dwell += 1
            k = state.k
        self.steps_at_k[k] += 1
        return k

    def _explore_interval(self, bucket: int, state: BucketState) -> int:
        """Steps between two bursts at a k not chosen: ``first_explore`` after the first bursts,
        doubling at every burst up to ``explore_every``. The first samples of a k are few and may
        fall on a new engine's first steps (kernels met for the first time) or on a slow stretch
        of the machine; each k is measured again within some tens of steps, not hundreds. Then
        as far apart as keeps the next burst within ``explore_overhead`` of the served k's time
        (a burst of k = 3 beside k = 0 costs several steps' worth), and close enough that every
        k is measured again before its samples age out."""
        ramp = self._ramp(state)
        if ramp < self.settings.explore_every:
            return ramp
        seconds = self.step_seconds(bucket)
        other = self._stalest_other_k(bucket, state.k) if len(self.ks) > 1 else state.k
        served, burst_k = seconds.get(state.k), seconds.get(other)
        if not served or burst_k is None:
            return self.settings.explore_every
        # beside k = 0 the burst's first step and the step returning are measured together
        # (``leaving_zero``); its other steps cost their k's extra
        leaving = self.leaving_zero.median(bucket, other, self.step) if state.k == 0 else None
        steps = self.settings.burst - (1 if leaving is not None else 0)
        cost = steps * max(burst_k - served, 0.0) + max(leaving or 0.0, 0.0)
        longest = self._longest_interval()
        wanted = math.ceil(cost / (self.settings.explore_overhead * served))
        return min(longest, max(self.settings.explore_every, wanted))

    def _ramp(self, state: BucketState) -> int:
        return max(1, self.settings.first_explore) << state.explored

    def _probe_every(self, bucket: int) -> int:
        """Steps at k = 0 between two probes: a probe (a step at the smallest k, then the step
        that verifies it) costs what leaving k = 0 for the smallest k measured (``leaving_zero``:
        the draft, and the first pass of the steps k = 0 deferred, ``deferred_first_pass_at_k0``),
        or ``cost(k) - cost(0)`` before that is measured, spent once per that many steps of
        ``cost(0)`` it stays within ``probe_overhead`` of k = 0's time. Probes show acceptance
        only: neither step is steady, so no step cost is charged from them."""
        smallest = min(k for k in self.ks if k > 0)
        seconds = self.step_seconds(bucket)
        at_zero, at_smallest = seconds[0], seconds[smallest]
        if not at_zero or not at_smallest:
            return self.settings.probe_every_unmeasured
        measured = self.leaving_zero.median(bucket, smallest, self.step)
        extra = measured if measured is not None else max(at_smallest - at_zero, 0.0)
        # at least two bursts' length apart: k = 0 keeps its own steady steps (its cost) even
        # where noisy medians make a probe look free; at most as far apart as bursts may be (a
        # probe's catch-up grows with the steps deferred since the layer last ran)
        wanted = math.ceil(max(extra, 0.0) / (self.settings.probe_overhead * at_zero))
        return min(self._longest_interval(), max(2 * self.settings.burst, wanted))

    def _longest_interval(self) -> int:
        """The most steps between two bursts (or probes): every k measured again before its
        samples age out (counted in this bucket's steps; a bucket that gets few of the engine's
        steps is measured more often than it needs, never less)."""
        return max(self.settings.explore_every, self.settings.max_sample_age // len(self.ks))

    def _first_bursts(self, bucket: int) -> collections.deque:
        """Every k it may choose, the largest first, one burst each."""
        for k in self.ks:
            self.burst_at[(bucket, k)] = self.step
        return collections.deque(k for k in sorted(self.ks, reverse=True)
                                 for _ in range(self.settings.burst))

    def _stalest_other_k(self, bucket: int, current: int) -> int:
        """The k other than ``current`` whose last burst in this bucket began longest ago (by
        attempts, not by samples: a k whose bursts keep falling on steps that prefilled still
        takes its turn, and the others theirs)."""
        others = [k for k in self.ks if k != current]
        return min(others, key=lambda k: (self.burst_at.get((bucket, k), -1), k))

    def _decide(self, bucket: int, state: BucketState) -> None:
        """Switch to the best-scoring k if it beats the current one by the hysteresis (or the
        current one has no cost measured yet); k not measured yet are not candidates."""
        scores = self.scores(bucket)
        if not scores:
            return
        best = max(scores, key=scores.get)
        current = scores.get(state.k)
        if best != state.k and (current is None
                                or scores[best] > current * (1.0 + self.settings.hysteresis)):
            state.k, state.dwell, state.since_probe = best, 0, 0
            state.switches += 1
            state.switched_at, state.entering = self.step, None

    def scores(self, bucket: int) -> dict[int, float]:
        """Expected tokens per request per second, by k, for this bucket (k with a cost only)."""
        expected = self.acceptance.expected_tokens_by_k()  # once per decision, not once per k
        out = {}
        for k, seconds in self.step_seconds(bucket).items():
            if seconds is not None and seconds > 0:
                out[k] = expected[k] / seconds
        return out

    def step_seconds(self, bucket: int) -> dict[int, float | None]:
        """Each k's cost now: the served k's median; another k's that median times their
        relative cost (``relative_log_costs``), or its own median where no ratio links it."""
        state = self.buckets.get(bucket)
        served = state.k if state is not None else None
        now = self.costs.median(bucket, served, self.step) if served is not None else None
        relative = self._relative_cached(bucket, served) if now else {}
        return {k: now * math.exp(relative[k]) if k in relative
                else self.costs.median(bucket, k, self.step) for k in self.ks}

    def _relative_cached(self, bucket: int, served: int) -> dict[int, float]:
        """``relative_log_costs``, refitted when a ratio was measured since (or, for samples
        ageing out, ``cost_window`` steps later): decisions come at every step."""
        key = (bucket, served)
        cached = self._fits.get(key)
        if cached is None or cached[0] != self._ratio_samples or \
                self.step - cached[1] >= self.settings.cost_window:
            cached = self._fits[key] = (self._ratio_samples, self.step,
                                        self.relative_log_costs(bucket, served))
        return cached[2]

    def relative_log_costs(self, bucket: int, served: int) -> dict[int, float]:
        """log(cost of k / cost of ``served``) for every k linked to ``served`` by measured pairs:
        the least-squares fit of the pairs' median log ratios, each weighted by its samples
        (its normal equations solved exactly: a handful of k)."""
        pairs = []
        for low in self.ks:
            for high in self.ks:
                if low < high:
                    median = self.ratios.median((bucket, low), high, self.step)
                    if median is not None:
                        pairs.append((low, high, median,
                                      self.ratios.samples((bucket, low), high, self.step)))
        linked, grew = {served}, True
        while grew:
            grew = False
            for low, high, _, _ in pairs:
                if (low in linked) != (high in linked):
                    linked |= {low, high}
                    grew = True
        unknown = sorted(linked - {served})
        if not unknown:
            return {}
        index = {k: i for i, k in enumerate(unknown)}
        # one weighted equation x[high] - x[low] = m per pair, x[served] = 0
        pairs = [p for p in pairs if p[0] in linked]
        rows = np.zeros((len(pairs), len(unknown)))
        for row, (low, high, _, _) in zip(rows, pairs):
            for k, sign in ((high, 1.0), (low, -1.0)):
                if k in index:
                    row[index[k]] = sign
        weights = np.sqrt([w for *_, w in pairs])
        medians = np.array([m for _, _, m, _ in pairs])
        fit = np.linalg.lstsq(rows * weights[:, None], medians * weights, rcond=None)[0]
        return dict(zip(unknown, fit.tolist()))

    # ------------------------------------------------------------------------------- learning

    def observe(self, outcome: StepOutcome) -> None:
        self.acceptance.observe_step(outcome.drafts)
        self._observe_leaving_zero(outcome)
        steady = outcome.verified_k == outcome.drafted_k
        if outcome.seconds is not None and steady and not outcome.prefill:
            bucket = batch_bucket(outcome.batch_size)
            state = self.buckets.get(bucket)
            # a burst's step beside the served k; not one observed just after a switch (with a
            # batch queue the step before it, at the k served until then), nor the first
            # bursts' last (observed one step late there)
            if state is not None and outcome.drafted_k != state.k and \
                    self.step > state.first_bursts_end and self.step - state.switched_at > 2:
                served = self.costs.median(bucket, state.k, self.step)
                if served and outcome.seconds > 0:
                    k, log_ratio = outcome.drafted_k, math.log(outcome.seconds / served)
                    self.ratios.observe((bucket, min(k, state.k)), max(k, state.k),
                                        log_ratio if k > state.k else -log_ratio, self.step)
                    self._ratio_samples += 1
            self.costs.observe(bucket, outcome.drafted_k, outcome.seconds, self.step)

    def _observe_leaving_zero(self, outcome: StepOutcome) -> None:
        """While a bucket serves k = 0: the step that drafts after k = 0 steps (a probe, a
        burst's first) and the one that returns to k = 0 (verifying drafts, drafting none) cost
        this much more than two k = 0 steps; the steps between, if any, are charged as usual."""
        bucket = batch_bucket(outcome.batch_size)
        state = self.buckets.get(bucket)
        if state is None or state.k != 0 or outcome.prefill or outcome.seconds is None:
            if state is not None:
                state.entering = None
            return
        if outcome.verified_k == 0 and outcome.drafted_k > 0:
            state.entering = (outcome.drafted_k, outcome.seconds)
        elif state.entering is not None and outcome.verified_k == state.entering[0] and \
                outcome.drafted_k == 0:
            zero = self.costs.median(bucket, 0, self.step)
            if zero:
                k, seconds = state.entering
                self.leaving_zero.observe(bucket, k, seconds + outcome.seconds - 2 * zero,
                                          self.step)
            state.entering = None
        elif state.entering is not None and not (
                outcome.verified_k == outcome.drafted_k == state.entering[0]):
            state.entering = None  # the return was not seen here (another bucket, a prefill)

    # ------------------------------------------------------------------------------- reporting

    def summary(self) -> dict:
        """What it decided and why: per bucket the k served and each k's score (tokens per
        request per second) and cost; the acceptance per position and how often it restarted on
        a shift; steps per k so far."""
        buckets = {}
        for bucket, state in sorted(self.buckets.items()):
            medians = self.step_seconds(bucket)
            buckets[bucket] = {
                "k": state.k, "switches": state.switches,
                "tokens_per_s_per_request": {k: round(v, 2) for k, v in self.scores(bucket).items()},
                "step_ms": {k: round(1000 * m, 3) for k, m in medians.items() if m is not None}}
        return {"buckets": buckets,
                "acceptance": [round(r, 3) for r in self.acceptance.rates()],
                "acceptance_shifts": self.acceptance.shifts,
                "steps_at_k": dict(sorted(self.steps_at_k.items()))}
