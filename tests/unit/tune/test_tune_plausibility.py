"""``vllm-mtp tune`` recommends nothing from impossible measurements: a step with drafts cheaper
than a plain step of the same batch, a speed-up beyond the acceptance length over the floor, a
busy machine. It measures again (engines in the other order), then refuses with exit 3."""

import dataclasses
import json

import pytest

from vllm_mtp_plugin.tools.throughput.plausibility import (beyond_acceptance, cheaper_than_plain,
                                                      row_problems, tune_problems)
from vllm_mtp_plugin.tools.tune import cli as tune_cli
from vllm_mtp_plugin.tools.throughput.measure import Measured


def _points(steps: dict, mean: dict | None = None) -> list[dict]:
    mean = mean or {}
    return [{"k": k, "concurrency": c, "step_ms": ms, "mean_step_ms": mean.get((k, c), ms),
             "outside_ms": 0.5, "prefill_ms": 5.0, "measured_tok_s": 1.0, "draft_ms": 1.0 * k,
             "tokens_per_step": c * (k + 1), "decode_steps": 10, "spec_decode": None}
            for (k, c), ms in steps.items()]


def test_the_impossible_run_seen_is_refused():
    """The run that printed 3.9x at k = 2, c = 4 on a drafter accepting 0.13 / 0.05 / 0.02: its
    k = 0 pass measured a 19.1 ms step, its k = 1 pass 10.1 ms."""
    taus = [1.0, 1.13, 1.18, 1.20]
    points = _points({(0, 4): 19.1, (1, 4): 10.1, (2, 4): 6.0})
    found = tune_problems(points, taus, {4: {0: 1.0, 1: 2.13, 2: 3.9}})
    assert any("k = 1, c = 4: a decode step with 1 draft(s) per request took 10.1 ms, less than "
               "a plain decode step of the same batch (19.1 ms)" in f for f in found)
    assert any("k = 2, c = 4: expected speed-up 3.90× exceeds what acceptance length 1.18 allows"
               in f for f in found)
    assert len(found) == 4  # two steps cheaper than plain, two speed-ups beyond tau


def test_possible_runs_pass_and_the_floor_tightens_the_bound():
    points = _points({(0, 1): 10.0, (1, 1): 10.2, (2, 1): 11.0})
    assert tune_problems(points, [1.0, 1.8, 2.4], {1: {0: 1.0, 1: 1.6, 2: 2.0}}) == []
    assert cheaper_than_plain(1, 1, 9.7, 10.0) is None  # within the timer's tolerance
    assert beyond_acceptance(3, 1, 1.9, 2.0) is None
    assert "over the floor 1.20 (at most 1.67×)" in beyond_acceptance(3, 1, 1.9, 2.0, 1.2)


def test_a_bench_row_with_verification_cheaper_than_a_plain_step_is_named():
    row = {"k": 1, "concurrency": 1, "baseline": {"step_ms": 94.2}, "speedup": 1.4,
           "steps": {"target_ms": 87.9}, "mean_acceptance_length": 1.78}
    (problem,) = row_problems(row)
    assert "verifying 1 draft(s) per request took 87.9 ms" in problem
    assert row_problems({**row, "steps": {"target_ms": 99.0}}) == []
    # adaptive k's row names the largest k it may choose, not what each step verified
    (problem,) = row_problems({**row, "k": 3, "impl": "adaptive", "speedup": 0.9})
    assert "a step of adaptive k (0 to 3 drafts per request) took 87.9 ms, less than" in problem


def _tune(tmp_path, monkeypatch, measurements: list[dict], remeasure: int = 1):
    """tune's main with ``measure`` (the engines) answering from ``measurements`` in turn."""
    (tmp_path / "model").mkdir()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a"}) + "\n")
    calls = []

    def measure(run, logs, reverse=False):
        calls.append(reverse)
        return dataclasses.replace(measurements[len(calls) - 1])
    monkeypatch.setattr(tune_cli, "measure", measure)
    monkeypatch.setattr(tune_cli.tune_plot, "expected", lambda data, path: path)
    out = tmp_path / "tune.json"
    code = tune_cli.main([str(tmp_path / "model"), "--prompts", str(prompts), "--concurrency",
                          "4", "--max-k", "1", "--out", str(out), "--remeasure", str(remeasure)])
    return code, json.loads(out.read_text()), calls


COUNTERS = {"greedy": {"num_drafts": 100, "accepted_per_position": [13]}}
IMPOSSIBLE = Measured(points=_points({(0, 4): 19.1, (1, 4): 10.1}), compilation=["x"],
                      counters=COUNTERS)
BUSY = Measured(points=_points({(0, 4): 10.0, (1, 4): 12.0}, mean={(1, 4): 40.0}),
                compilation=["x"], counters=COUNTERS)
POSSIBLE = Measured(points=_points({(0, 4): 10.0, (1, 4): 12.0}), compilation=["x"],
                    counters=COUNTERS)


def test_tune_measures_again_in_the_other_order_and_then_recommends(tmp_path, monkeypatch, capsys):
    code, data, calls = _tune(tmp_path, monkeypatch, [IMPOSSIBLE, POSSIBLE])
    assert code == 0 and calls == [False, True]
    assert data["plausibility"] == {"measurements": 2, "problems": []}
    assert "cannot be right" in capsys.readouterr().out and "refused" not in data


@pytest.mark.parametrize("measured", [IMPOSSIBLE, BUSY], ids=["impossible", "busy"])
def test_tune_refuses_to_recommend_from_what_stays_wrong(tmp_path, monkeypatch, capsys, measured):
    code, data, calls = _tune(tmp_path, monkeypatch, [measured, measured])
    printed = capsys.readouterr().out
    assert code == tune_cli.REFUSED_EXIT == 3 and len(calls) == 2
    assert data["speculative_config"] is None and data["refused"] == data["plausibility"]["problems"]
    assert "no recommendation after 2 measurement(s)" in printed
    assert "--speculative-config" not in printed
    reason = "less than a plain decode step" if measured is IMPOSSIBLE else "other work shared"
    assert any(reason in line for line in data["refused"])
