"""``vllm-mtp tune``'s results keep one shape: concurrencies and k are ints in memory, text only in
``tune.json``, and every draft method's figures are a ``MethodChoice``; the stored results read
back and write out byte for byte."""

import json

import pytest

from support import paths
from vllm_mtp_plugin.tools.tune.cli import result, summary_text
from vllm_mtp_plugin.tools.throughput.measure import Measured, TuneRun
from vllm_mtp_plugin.tools.tune.results import TuneResult, Verdict

ROOT = paths.REPO
STORED = sorted(ROOT.glob("benchmarks/results/tune-*/tune.json"))


def _measured(methods=("greedy",)) -> Measured:
    steps = {(1, 0): 49.0, (1, 1): 59.0, (1, 2): 69.0, (4, 0): 99.0, (4, 1): 170.0,
             (4, 2): 229.0, (8, 1): 300.0}  # c = 8 without k = 0: expected, never chosen
    points = [{"k": k, "concurrency": c, "step_ms": ms, "outside_ms": 1.0, "prefill_ms": 0.0,
               "measured_tok_s": 1.0, "draft_sample_method": method if k else None}
              for (c, k), ms in steps.items() for method in (methods if k else [None])]
    counters = {m: {"num_drafts": 100, "accepted_per_position": [60 + 10 * i, 30]}
                for i, m in enumerate(methods)}
    return Measured(points=points, counters=counters, compilation=["x"], ks=[0, 1, 2])


@pytest.mark.parametrize("methods", [("greedy",), ("greedy", "probabilistic")])
def test_int_keys_survive_a_json_round_trip_as_ints(methods):
    run = TuneRun(model="m", prompts=["a"], concurrencies=[1, 4, 8], max_k=2, temperature=1.0,
                  draft_sample_methods=list(methods))
    tuned = result(run, _measured(methods))
    for choice in tuned.choices.values():
        assert all(isinstance(c, int) for c in choice.best_fixed_k)
        assert all(isinstance(k, int) for by_k in choice.expected_tok_s.values() for k in by_k)
    assert 8 in tuned.chosen.expected_tok_s and 8 not in tuned.chosen.best_fixed_k
    stored = json.loads(json.dumps(tuned.to_json()))
    assert set(stored["best_fixed_k"]) <= {"1", "4", "8"}  # text in the file only
    back = TuneResult.from_json(stored)
    assert back.choices.keys() == tuned.choices.keys()
    for method, choice in tuned.choices.items():
        assert back.choices[method].best_fixed_k == choice.best_fixed_k
        assert back.choices[method].expected_tok_s == choice.expected_tok_s
        assert back.choices[method].expected_speedup == choice.expected_speedup
    assert back.to_json() == stored
    assert summary_text(back) == summary_text(tuned)
    assert summary_text(tuned).splitlines()[-1] == (
        "or let the engine choose k (0 included) at every step from what it measures while it "
        "serves: VLLM_MTP_ADAPTIVE_K=1 with --speculative-config "
        "'{\"method\": \"mtp\", \"num_speculative_tokens\": 2}' (docs/adaptive-k.md)")


@pytest.mark.parametrize("path", STORED, ids=[p.parent.name for p in STORED])
def test_stored_results_read_back_and_write_out_byte_for_byte(path):
    text = path.read_text()
    tuned = TuneResult.from_json(json.loads(text))
    assert json.dumps(tuned.to_json(), indent=1) == text
    assert all(isinstance(c, int) for c in tuned.chosen.best_fixed_k)


def test_stored_results_exist():
    assert {p.parent.name for p in STORED} >= {"tune-bench", "tune-trained", "tune-sampled"}


def test_a_verdict_writes_its_ks_as_text():
    verdict = Verdict(concurrency=4, tuned_k=1, measured_best_k=0,
                      tok_s={0: {"median": 2.0}, 1: {"median": 1.0}}, tuned_over_best=0.5,
                      tuned_over_no_speculation=0.5, pick="missed",
                      slower_than_no_speculation=True, single_pass=False)
    stored = verdict.to_json()
    assert list(stored) == ["concurrency", "tuned_k", "measured_best_k", "tok_s",
                            "tuned_over_best", "tuned_over_no_speculation", "pick",
                            "slower_than_no_speculation", "single_pass"]
    assert stored["tok_s"] == {"0": {"median": 2.0}, "1": {"median": 1.0}}
    assert verdict.tok_s[0] == {"median": 2.0}  # the verdict itself is untouched
