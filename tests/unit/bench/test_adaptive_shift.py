"""``benchmarks/adaptive_shift.py``: the arms, the phases every arm serves alike, and the ratios
it prints (no engine)."""

import sys

import pytest
from support import paths

sys.path.insert(0, str(paths.REPO / "benchmarks"))

import adaptive_shift  # noqa: E402  (benchmarks/adaptive_shift.py)


def test_arms_fixed_k_adaptive_and_tunes_table():
    tune = {"method": "mtp", "num_speculative_tokens": 2,
            "num_speculative_tokens_per_batch_size": [[1, 4, 2], [5, 16, 0]]}
    arms = adaptive_shift.arms(2, tune)
    assert list(arms) == ["k=0", "k=1", "k=2", "adaptive", "tune"]
    assert arms["k=0"] == ("plugin", 0, {})
    assert arms["adaptive"] == ("adaptive", 2, {"draft_sample_method": "probabilistic"})
    assert arms["tune"][2]["num_speculative_tokens_per_batch_size"] == [[1, 4, 2], [5, 16, 0]]
    assert "tune" not in adaptive_shift.arms(2, None)


def test_every_arm_gets_the_same_phases():
    groups = {"code": ["def f(", "class A:"], "chat": ["Hi", "Tell me"], "prose": ["Once"]}
    passes = adaptive_shift.phase_passes(groups, 5, seed=7)
    assert [p["concurrency"] for p in passes] == [1, 16, 1, 1]
    assert passes[0]["prompts"] == ["def f(", "class A:", "def f(", "class A:", "def f("]
    assert passes[1]["sampling"] == {"temperature": 1.0, "seed": 7}
    assert passes[0]["sampling"] == {"temperature": 0.0}
    sized = adaptive_shift.phase_passes(groups, 5, seed=7, concurrent_requests=12)
    assert [len(p["prompts"]) for p in sized] == [5, 12, 5, 5]


def run(*phase_seconds):
    return {"phases": [{"seconds": s} for s in phase_seconds]}


def test_ratios_against_the_best_fixed_arm_per_phase_and_whole_run():
    results = {"k=0": [run(4, 2, 4, 4), run(6, 2, 4, 4)],   # medians 5, 2, 4, 4; totals 14, 16
               "k=3": [run(2, 8, 2, 3)],
               "adaptive": [run(2.5, 2.5, 2, 3)]}
    summary = adaptive_shift.summary(results)
    assert summary["k=0"]["phase_seconds"] == [5, 2, 4, 4]
    assert summary["k=0"]["total_seconds"] == 15.0  # the median of the runs' totals
    adaptive = summary["adaptive"]
    assert adaptive["vs_best_fixed_phase"] == pytest.approx([2 / 2.5, 2 / 2.5, 1.0, 1.0])
    assert adaptive["vs_best_fixed_total"] == pytest.approx(15 / 10)
    assert adaptive["vs_k0_total"] == pytest.approx(15 / 10)
    assert "whole run 1.50x" in adaptive_shift.table({"summary": summary})
