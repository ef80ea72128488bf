"""What the adaptive-k controller knows: how often each draft position is accepted, and what a step
costs at each k and batch size, both measured from the engine's own steps.

Acceptance is not enough on its own: it stays almost flat from one request to many while the right
k flips, because the cost of verifying k more tokens per request grows with the batch. So the
cost of a step is measured too, per batch-size bucket and k, as the median of its recent steps.
"""

from __future__ import annotations

import collections
import math
import statistics

# A shift in acceptance is tested on the last m steps that verified drafts, for each m here (the
# shortest catches a collapse within a few steps; the longest, a smaller move), whole steps pooled:
# the requests of one step come in the scheduler's order, so a window cut inside a step would
# compare some requests with the rest instead of now with before.
SHIFT_WINDOWS = (4, 16, 64)
# How unlikely a window's accepted count must be under the estimate (two-sided binomial tail) to
# count as a shift: at p = 0.9 one acceptance in 4 does not (0.0037), none in 16 does.
SHIFT_ALPHA = 1e-4
# A shift must persist this many further steps that verified drafts, each testing shifted the
# same way, before the estimate restarts: a regime shorter than that is averaged over, not
# followed (following one that ends soon after costs more than it gains).
SHIFT_PERSISTENCE = 64


def binomial_tail(accepted: int, n: int, p: float) -> float:
    """P(a count at least as far from n·p as ``accepted``, on its side) for Binomial(n, p),
    0 < p < 1, exact: the terms from ``accepted`` outwards, each from the one before, until they
    no longer add (a handful of standard deviations' worth, whatever n)."""
    log_term = (math.lgamma(n + 1) - math.lgamma(accepted + 1) - math.lgamma(n - accepted + 1)
                + accepted * math.log(p) + (n - accepted) * math.log1p(-p))
    term, total, x = math.exp(log_term), 0.0, accepted
    odds = p / (1.0 - p)
    upward = accepted >= n * p
    while term > 0.0 and term >= 1e-12 * total:
        total += term
        if upward:
            if x == n:
                break
            term *= (n - x) / (x + 1) * odds
            x += 1
        else:
            if x == 0:
                break
            term *= x / (n - x + 1) / odds
            x -= 1
    return min(1.0, total)


def batch_bucket(batch_size: int) -> int:
    """The bucket a batch size is costed in: the next power of two (1, 2, 4, 8, ...). A step's
    cost grows with its tokens; within a bucket it changes by at most 2x, and buckets keep the
    number of cells to measure logarithmic in the largest batch."""
    return 1 << max(0, batch_size - 1).bit_length()


class AcceptanceByPosition:
    """P(the first j drafts of a request's step are all accepted), for j = 1..max_k, as the
    product of conditional rates: ``a_j`` = P(draft j accepted | drafts 1..j-1 were).

    Counts decay with every engine step (``half_life`` steps), whether or not the step verified
    drafts, so the estimate follows traffic that shifts. A position seldom verified (k was below
    it) leans on the position before it: ``a_j`` has ``prior_weight`` pseudo-observations of
    ``a_(j-1)`` (drafts of neighbouring positions are accepted at similar rates; ``a_1``'s prior
    is ``first_prior``). So what position 1 shows of a shift reaches the positions the engine is
    not drafting at, and a k above the current one is judged on fresh numbers.

    Decay alone follows a shift in about a half-life, hundreds of steps at one request per step
    (code at T = 0, then chat at T = 1: all of it spent drafting what is rejected). So each step
    that verified drafts also tests whether position 1's verifications in the last m such steps
    (``SHIFT_WINDOWS``) could come from the current estimate: where their accepted count is less
    likely than ``shift_alpha`` (``binomial_tail``), the counts restart from the shortest such
    window (``shifts`` counts the restarts).
    """

    def __init__(self, max_k: int, half_life: float = 500.0, first_prior: float = 0.5,
                 prior_weight: float = 4.0, shift_alpha: float | None = SHIFT_ALPHA):
        self.max_k = max_k
        self.decay = 0.5 ** (1.0 / half_life)
        self.first_prior = first_prior
        self.prior_weight = prior_weight
        self.shift_alpha = shift_alpha  # None: no shift test (decay alone)
        self.reached = [0.0] * max_k   # verified draft j after accepting drafts 1..j-1
        self.accepted = [0.0] * max_k  # ... and accepted it
        # The counts of the last steps that verified drafts, (reached, accepted) per position,
        # for the shift test (bounded).
        self.recent: collections.deque = collections.deque(maxlen=max(SHIFT_WINDOWS))
        self._suspected: list[tuple[int, bool]] = []  # consecutive shifted tests, one way
        self.shifts = 0
        # Steps whose decay is not applied to the counts yet: a step without drafts (every step
        # at k = 0) only counts here; the decay is applied once when the counts are read.
        self._undecayed_steps = 0

    def _decayed(self) -> None:
        if self._undecayed_steps:
            factor = self.decay ** self._undecayed_steps
            self.reached = [n * factor for n in self.reached]
            self.accepted = [n * factor for n in self.accepted]
            self._undecayed_steps = 0

    def observe_step(self, drafts) -> None:
        """One engine step: per request that verified drafts, (drafts verified, the first how
        many of them accepted: vLLM's rejection sampler stops at the first rejection)."""
        self._undecayed_steps += 1
        if not drafts:
            return
        self._decayed()
        reached, accepted = [0] * self.max_k, [0] * self.max_k
        for num_drafted, num_accepted in drafts:
            for j in range(min(num_drafted, num_accepted + 1, self.max_k)):
                reached[j] += 1
                accepted[j] += 1 if j < num_accepted else 0
        if not reached[0]:
            return
        self.reached = [a + b for a, b in zip(self.reached, reached)]
        self.accepted = [a + b for a, b in zip(self.accepted, accepted)]
        self.recent.append((tuple(reached), tuple(accepted)))
        if self.shift_alpha is None:
            return
        shift = self.shifted_window()
        if shift is None or (self._suspected and shift[1] != self._suspected[0][1]):
            self._suspected = []
            return
        self._suspected.append(shift)
        if len(self._suspected) > SHIFT_PERSISTENCE:
            window = max(w for w, _ in self._suspected)
            self._restart_from(list(self.recent)[-window:])

    def shifted_window(self) -> tuple[int, bool] | None:
        """The shortest m of ``SHIFT_WINDOWS`` whose last m steps' position-1 count is less
        likely than ``shift_alpha`` under the estimate, and whether the count is above it (None:
        none is)."""
        p = min(max(self.conditional_rates()[0], 0.01), 0.99)
        steps = list(self.recent)
        for window in SHIFT_WINDOWS:
            if len(steps) < window:
                break
            n = sum(reached[0] for reached, _ in steps[-window:])
            accepted = sum(accepted[0] for _, accepted in steps[-window:])
            if binomial_tail(accepted, n, p) < self.shift_alpha:
                return window, accepted > n * p
        return None

    def _restart_from(self, steps: list[tuple[tuple, tuple]]) -> None:
        """Counts from ``steps`` only; the shift test starts from them too."""
        self.reached = [float(sum(r[j] for r, _ in steps)) for j in range(self.max_k)]
        self.accepted = [float(sum(a[j] for _, a in steps)) for j in range(self.max_k)]
        self.recent = collections.deque(steps, maxlen=self.recent.maxlen)
        self._suspected = []
        self._undecayed_steps = 0
        self.shifts += 1

    def observations(self, position: int) -> float:
        """How many (decayed) verifications position ``position`` (1-based) rests on."""
        self._decayed()
        return self.reached[position - 1]

    def conditional_rates(self) -> list[float]:
        self._decayed()
        out, prior = [], self.first_prior
        for j in range(self.max_k):
            weight = self.reached[j] + self.prior_weight
            if weight > 0:  # else nothing seen and no prior weight: the prior as it is
                prior = (self.accepted[j] + self.prior_weight * prior) / weight
            out.append(prior)
        return out

    def rates(self) -> list[float]:
        """P(drafts 1..j all accepted) for j = 1..max_k."""
        out, product = [], 1.0
        for rate in self.conditional_rates():
            product *= rate
            out.append(product)
        return out

    def expected_tokens_by_k(self) -> list[float]:
        """Tokens a request gains per step at k = 0 .. max_k drafts: the sampled one plus the
        accepted drafts (one pass over the rates for every k)."""
        out = [1.0]
        for rate in self.rates():
            out.append(out[-1] + rate)
        return out

    def expected_tokens(self, k: int) -> float:
        return self.expected_tokens_by_k()[k]


class StepCosts:
    """Seconds per step by (batch-size bucket, k): the median of each cell's last ``window``
    steady steps (the step verified as many drafts as it drafted, and prefilled nothing), those
    younger than ``max_age`` steps only: a cost measured long ago (other context lengths, other
    traffic) does not stand against one measured now."""

    def __init__(self, window: int = 16, max_age: int = 4096):
        self.window = window
        self.max_age = max_age
        self.cells: dict[tuple[int, int], collections.deque] = {}
        # (bucket, k) -> (median, the last step it holds at): asked at every step for every k,
        # a cell's median changes only when it gains a sample or one ages out
        self._medians: dict[tuple[int, int], tuple[float | None, int | None]] = {}
        self._expiring: dict[tuple[int, int], int] = {}  # (bucket, k) -> drop samples before

    def observe(self, bucket: int, k: int, seconds: float, step: int) -> None:
        cell = self.cells.setdefault((bucket, k), collections.deque(maxlen=self.window))
        before = self._expiring.pop((bucket, k), None)
        if before is not None:
            kept = [(s, v) for s, v in cell if s >= before]
            cell.clear()
            cell.extend(kept)
        cell.append((step, seconds))
        self._medians.pop((bucket, k), None)

    def expire(self, bucket: int, k: int, before: int) -> None:
        """Drop the cell's samples of steps before ``before`` once it gains a new sample (until
        then its cost stands as it is: a burst that falls on prefills leaves it measured)."""
        self._expiring[(bucket, k)] = before

    def samples(self, bucket: int, k: int, now: int | None = None) -> int:
        return len(self._fresh(bucket, k, now))

    def median(self, bucket: int, k: int, now: int | None = None) -> float | None:
        """The median of the fresh samples (all of them without ``now``); None without any."""
        if now is None:
            fresh = self._fresh(bucket, k, None)
            return statistics.median(fresh) if fresh else None
        cached = self._medians.get((bucket, k))
        if cached is not None and (cached[1] is None or now <= cached[1]):
            return cached[0]
        cell = self.cells.get((bucket, k), ())
        fresh = [(step, s) for step, s in cell if now - step <= self.max_age]
        value = statistics.median([s for _, s in fresh]) if fresh else None
        # valid until its oldest sample ages out (None: no sample to age out, until one comes)
        self._medians[(bucket, k)] = (value, fresh[0][0] + self.max_age if fresh else None)
        return value

    def _fresh(self, bucket: int, k: int, now: int | None) -> list[float]:
        cell = self.cells.get((bucket, k), ())
        return [s for step, s in cell if now is None or now - step <= self.max_age]
