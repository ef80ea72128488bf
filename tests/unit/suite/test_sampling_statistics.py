"""The sampling tests' statistics (``support/sampling_statistics.py``) at the sizes they use: the
sample sizes give the stated detectable shifts, a shift of that size is detected on simulated
samples about as often as computed, equal distributions fail at most at ALPHA, and what the CPU
bug produced is told apart. The engines: ``tests/engine/plugin/test_sampling.py``."""

import collections

from support.sampling_statistics import (
    ALPHA,
    POWER,
    SAMPLES,
    SHIFT,
    V2_DETECTABLE_SHIFT,
    counts_differ,
    detectable_shift,
    differs,
    homogeneity_p_value,
    required_samples,
    top_token_power,
    worst_case_power,
)


def test_sample_sizes_give_the_stated_detectable_shift():
    """The sizes of the engine test's docstring: 4,533 samples per arm detect a 5-point shift
    with power 0.9 at level 0.0005 (each statistic's half of ALPHA); V1's 4,600 do, V2's 200
    against 4,600 detect 17 points; the old 200 per arm only 24 (400: 17, both at ALPHA)."""
    assert required_samples() == 4533
    assert SAMPLES["v1"] >= required_samples()
    assert worst_case_power(SAMPLES["v1"], SAMPLES["v1"], SHIFT) >= POWER
    assert worst_case_power(SAMPLES["v1"] - 100, SAMPLES["v1"] - 100, SHIFT) < POWER
    assert detectable_shift(SAMPLES["v1"], SAMPLES["v1"]) <= SHIFT
    assert round(detectable_shift(SAMPLES["v2"], SAMPLES["v1"]), 2) == V2_DETECTABLE_SHIFT
    assert detectable_shift(200, 200) > 0.23 and detectable_shift(400, 400, ALPHA) > 0.16


def _rejections(rng, n_a: int, n_b: int, probs_a: list[float], probs_b: list[float],
                replicates: int) -> float:
    """Share of ``replicates`` pairs of multinomial samples that the comparison fails."""
    failed = 0
    for _ in range(replicates):
        counts = [collections.Counter({token: int(c) for token, c
                                       in enumerate(rng.multinomial(n, probs)) if c})
                  for n, probs in ((n_a, probs_a), (n_b, probs_b))]
        failed += counts_differ(*counts)[0]
    return failed / replicates


def _distribution(top: float, tail: int) -> list[float]:
    return [top] + [(1 - top) / tail] * tail


def _top_shifted(probs: list[float], shift: float) -> list[float]:
    """The most likely token's probability moved by ``shift``, the others scaled to make room."""
    rest = (1 - probs[0] - shift) / (1 - probs[0])
    return [probs[0] + shift] + [p * rest for p in probs[1:]]


def test_a_shift_of_the_stated_size_is_detected():
    """The comparison at the chosen sizes, on simulated samples (no engine): a 5-point shift of
    the most likely token's probability fails it about as often as ``top_token_power`` says (0.91
    at the worst probability, 0.5; also at a measured shape: 0.17 then ~1,700 tokens), in both
    directions; the same distribution in both arms fails it at most at ALPHA; V2's sizes detect
    their 17 points."""
    import numpy

    rng = numpy.random.default_rng(51)
    n = SAMPLES["v1"]
    worst = _distribution(0.5, 50)
    for shift in (SHIFT, -SHIFT):
        rate = _rejections(rng, n, n, worst, _top_shifted(worst, shift), 400)
        assert rate >= 0.85 and abs(rate - top_token_power(n, n, 0.5, shift)) < 0.05, (shift, rate)
    measured = _distribution(0.17, 1700)
    assert top_token_power(n, n, 0.17, SHIFT) > 0.99
    assert _rejections(rng, n, n, measured, _top_shifted(measured, SHIFT), 100) >= 0.97
    false_alarms = round(1000 * (_rejections(rng, n, n, worst, worst, 1000)
                                 + _rejections(rng, n, n, measured, measured, 1000)))
    assert false_alarms <= 8  # 2,000 comparisons at ALPHA: 2 expected, 9 or more once in 4,000
    rate = _rejections(rng, SAMPLES["v2"], n, worst, _top_shifted(worst, V2_DETECTABLE_SHIFT), 400)
    assert rate >= 0.85, rate


def test_the_test_detects_a_different_distribution():
    """The statistics reject what the CPU bug produced (measured: token 1287 in 398/400 samples
    without MTP, 19-26/400 with it) and accept two samples of one distribution."""
    assert homogeneity_p_value([1287] * 398 + [5, 6], [1287] * 26 + [1562] * 360 + [7] * 14) < ALPHA
    assert differs([1287] * 398 + [5, 6], [1287] * 26 + [1562] * 360 + [7] * 14)[0]
    a = [t % 7 for t in range(400)]
    assert homogeneity_p_value(a, list(reversed(a))) > 0.5 and not differs(a, list(reversed(a)))[0]
