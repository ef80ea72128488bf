"""The statistics of the sampling tests (``tests/engine/plugin/test_sampling.py``; their own
tests, no engine: ``tests/unit/suite/test_sampling_statistics.py``): two samples of token ids
compared by a two-proportion z-test on the most likely token and a chi-square test of
homogeneity, each at ALPHA / 2, with the sample sizes that give POWER against SHIFT.

Sizes (the engine test's docstring derives them): V1, 4,600 samples per setting in each arm,
detects a 5-point shift of the most likely token's probability with power >= 0.9; V2's 200
against V1's 4,600, a 17-point shift.
"""

import collections
import math
import random
from statistics import NormalDist

from scipy.stats import chi2_contingency

NORMAL = NormalDist()

# False alarms per comparison (one setting, one position), both statistics together.
ALPHA = 1e-3
# The power each comparison has against SHIFT: a change of the most likely token's probability.
POWER = 0.9
SHIFT = 0.05
# Seeded requests per setting and arm (the engine test's docstring: how these sizes were computed).
SAMPLES = {"v1": 4600, "v2": 200}
# The shift V2's comparisons detect with POWER, to a point (asserted from the sizes above).
V2_DETECTABLE_SHIFT = 0.17


def _pooled_table(counts_a: collections.Counter, counts_b: collections.Counter) -> list[list[int]]:
    """Two rows of counts, one column per token with 5 or more expected draws in the smaller
    sample, the others pooled into a last column."""
    n_a, n_b = sum(counts_a.values()), sum(counts_b.values())
    share = min(n_a, n_b) / (n_a + n_b)
    rows, pooled = [[], []], [0, 0]
    for token in sorted(set(counts_a) | set(counts_b)):
        if (counts_a[token] + counts_b[token]) * share < 5:
            pooled[0] += counts_a[token]
            pooled[1] += counts_b[token]
            continue
        rows[0].append(counts_a[token])
        rows[1].append(counts_b[token])
    if not rows[0]:
        raise AssertionError("no token has 5 expected draws in each sample: too spread for a test "
                             "with power")
    if sum(pooled):
        rows[0].append(pooled[0])
        rows[1].append(pooled[1])
    return rows


def chi_square_p_value(counts_a: collections.Counter, counts_b: collections.Counter) -> float:
    rows = _pooled_table(counts_a, counts_b)
    if len(rows[0]) < 2:  # one token only: both samples drew it every time
        return 1.0
    return float(chi2_contingency(rows).pvalue)


def homogeneity_p_value(a: list[int], b: list[int]) -> float:
    """Chi-square test of homogeneity of two samples of token ids (tokens pooled as above)."""
    return chi_square_p_value(collections.Counter(a), collections.Counter(b))


def top_token_p_value(counts_a: collections.Counter, counts_b: collections.Counter) -> float:
    """Two-sided p-value of the two-proportion z-test (pooled variance) on the frequency of the
    token most drawn in both samples together."""
    n_a, n_b = sum(counts_a.values()), sum(counts_b.values())
    token = (counts_a + counts_b).most_common(1)[0][0]
    pooled = (counts_a[token] + counts_b[token]) / (n_a + n_b)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n_a + 1 / n_b))
    if se == 0:  # both samples drew only that token
        return 1.0
    z = (counts_a[token] / n_a - counts_b[token] / n_b) / se
    return 2 * NORMAL.cdf(-abs(z))


def differs(a: list[int], b: list[int]) -> tuple[bool, str]:
    """The comparison of one setting and position: (failed, the two p-values)."""
    return counts_differ(collections.Counter(a), collections.Counter(b))


def counts_differ(counts_a: collections.Counter, counts_b: collections.Counter) -> tuple[bool, str]:
    top, chi2 = top_token_p_value(counts_a, counts_b), chi_square_p_value(counts_a, counts_b)
    return min(top, chi2) < ALPHA / 2, f"p = {top:.2g} (most likely token), {chi2:.2g} (chi-square)"


def top_token_power(n_a: int, n_b: int, p: float, shift: float, alpha: float = ALPHA / 2) -> float:
    """Power of the two-proportion z-test at two-sided level ``alpha`` when the token's
    probability is ``p`` in sample a and ``p + shift`` in sample b (normal approximation)."""
    p_b = p + shift
    pooled = (n_a * p + n_b * p_b) / (n_a + n_b)
    se_null = math.sqrt(pooled * (1 - pooled) * (1 / n_a + 1 / n_b))
    se = math.sqrt(p * (1 - p) / n_a + p_b * (1 - p_b) / n_b)
    z = NORMAL.inv_cdf(1 - alpha / 2)
    return (NORMAL.cdf((abs(shift) - z * se_null) / se)
            + NORMAL.cdf((-abs(shift) - z * se_null) / se))


def worst_case_power(n_a: int, n_b: int, shift: float, alpha: float = ALPHA / 2) -> float:
    """The least power over the token's probability (steps of 0.001) and the shift's direction."""
    grid = [i / 1000 for i in range(1, 1000)]
    return min(min(top_token_power(n_a, n_b, p, shift, alpha),
                   top_token_power(n_b, n_a, p, shift, alpha))
               for p in grid if p + shift < 1)


def required_samples(shift: float = SHIFT, alpha: float = ALPHA / 2, power: float = POWER) -> int:
    """Samples per arm (equal arms) for ``power`` against ``shift`` at the worst probability
    (p1 and p2 around 0.5): the closed form of the engine test's docstring."""
    p1, p2 = 0.5 - shift / 2, 0.5 + shift / 2
    root = (NORMAL.inv_cdf(1 - alpha / 2) * math.sqrt(2 * 0.25)
            + NORMAL.inv_cdf(power) * math.sqrt(p1 * (1 - p1) + p2 * (1 - p2)))
    return math.ceil(root ** 2 / shift ** 2)


def detectable_shift(n_a: int, n_b: int, alpha: float = ALPHA / 2, power: float = POWER) -> float:
    """The smallest shift of the most likely token's probability detected with ``power`` at the
    worst probability (to 0.0001)."""
    low, high = 0.0, 1.0
    while high - low > 1e-4:
        middle = (low + high) / 2
        if worst_case_power(n_a, n_b, middle, alpha) >= power:
            high = middle
        else:
            low = middle
    return high


def shifted(tokens: list[int], shift: float, seed: int) -> list[int]:
    """``tokens`` with the most frequent one's probability raised by ``shift``: each other token
    replaced by it with probability shift / (1 - its frequency) (a fault for the statistics)."""
    top, count = collections.Counter(tokens).most_common(1)[0]
    rng = random.Random(seed)
    chance = shift / (1 - count / len(tokens))
    return [top if t != top and rng.random() < chance else t for t in tokens]
