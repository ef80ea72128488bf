"""``vllm-mtp tune``'s arithmetic: acceptance lengths, expected throughput, best k, and a schedule
that vLLM's own validator and lookup accept and expand as intended."""

import json
from pathlib import Path

import pytest
from vllm.v1.spec_decode.dynamic.utils import (build_dynamic_sd_schedule_lookup,
                                               validate_and_normalize_dynamic_sd_schedule)

from vllm_mtp_plugin.tools.throughput import prediction
from vllm_mtp_plugin.tools.tune.cli import (draft_methods, engine_args, parse_args, result,
                                            summary_text)
from vllm_mtp_plugin.tools.throughput.measure import Measured, TuneRun, engine_config, passes
from vllm_mtp_plugin.tools.tune.results import TuneResult


def test_acceptance_lengths_from_the_max_k_counters():
    counters = {"num_drafts": 10, "accepted_per_position": [8, 5, 2]}
    assert prediction.acceptance_lengths(counters, 3) == pytest.approx([1.0, 1.8, 2.3, 2.5])
    assert prediction.acceptance_lengths({"num_drafts": 0}, 2) == [1.0, 1.0, 1.0]


def _points(step_ms: dict, prefill_ms: float = 0.0) -> list[dict]:
    return [{"k": k, "concurrency": c, "step_ms": ms, "outside_ms": 1.0, "prefill_ms": prefill_ms}
            for (c, k), ms in step_ms.items()]


def test_expected_throughput_best_k_and_schedule():
    taus = [1.0, 1.8, 2.3]
    # c = 1: drafting is cheap next to the step; c = 4: verification rows cost nearly linearly;
    # c = 16: no k pays
    steps = {(1, 0): 49.0, (1, 1): 59.0, (1, 2): 69.0,
             (4, 0): 99.0, (4, 1): 170.0, (4, 2): 229.0,
             (16, 0): 199.0, (16, 1): 399.0, (16, 2): 599.0}
    expected = prediction.predictions(_points(steps), taus, max_tokens=65)
    # c requests of N tokens: (N - 1) / tau decode steps of (step + outside) each
    assert expected[1][0] == pytest.approx(65 / (64 * 0.050))
    assert expected[1][2] == pytest.approx(65 / (64 / 2.3 * 0.070))
    assert expected[4][1] == pytest.approx(4 * 65 / (64 / 1.8 * 0.171))
    # a prompt's prefill is paid once per request: it weighs more on short outputs
    short = prediction.predictions(_points(steps, prefill_ms=100.0), taus, max_tokens=9)
    assert short[1][2] == pytest.approx(9 / (0.1 + 8 / 2.3 * 0.070))
    best = prediction.best_k(expected)
    assert best == {1: 2, 4: 1, 16: 0}
    ranges = prediction.schedule(best)
    assert ranges == [[1, 3, 2], [4, 15, 1], [16, 16, 0]]
    spec = prediction.speculative_config(ranges)
    assert spec == {"method": "mtp", "num_speculative_tokens": 2,
                    "num_speculative_tokens_per_batch_size": ranges}
    # vLLM's own validator and lookup: batch 1-3 -> 2, 4-15 -> 1, 16 and beyond -> 0
    assert validate_and_normalize_dynamic_sd_schedule(ranges) == [tuple(r) for r in ranges]
    lookup = build_dynamic_sd_schedule_lookup(ranges, vllm_max_batch_size=20,
                                              vllm_num_speculative_tokens=2)
    assert lookup[1:] == [2] * 3 + [1] * 12 + [0] * 5


def test_schedule_merges_and_says_when_mtp_never_pays():
    assert prediction.schedule({2: 3, 4: 3, 8: 1}) == [[1, 7, 3], [8, 8, 1]]
    assert prediction.speculative_config([[1, 8, 3]]) == {"method": "mtp", "num_speculative_tokens": 3}
    assert prediction.speculative_config([[1, 16, 0]]) is None
    assert prediction.best_k({1: {0: 10.0, 1: 10.0, 2: 9.0}}) == {1: 0}  # a tie keeps the smaller k


def test_result_has_vllms_key_at_the_top_and_a_ready_config():
    run = TuneRun(model="m", prompts=["a", "b"], concurrencies=[4, 1], max_k=2)
    points = [{**p, "measured_tok_s": 1.0} for p in _points(
        {(1, 0): 49.0, (1, 1): 59.0, (1, 2): 69.0, (4, 0): 99.0, (4, 1): 170.0, (4, 2): 229.0})]
    tuned = result(run, Measured(points=points, compilation=["DYNAMO_TRACE_ONCE"],
                                 counters={"greedy": {"num_drafts": 10,
                                                      "accepted_per_position": [8, 5]}}))
    assert tuned.chosen.best_fixed_k == {1: 2, 4: 1}  # ints in memory ...
    data = tuned.to_json()
    assert list(data)[0] == "num_speculative_tokens_per_batch_size"
    assert data["num_speculative_tokens_per_batch_size"] == [[1, 3, 2], [4, 4, 1]]
    assert data["best_fixed_k"] == {"1": 2, "4": 1}  # ... text in tune.json
    assert data["expected_speedup"]["1"]["0"] == 1.0
    assert data["acceptance"]["per_position"] == pytest.approx([0.8, 0.5])
    json.dumps(data)  # tune.json is plain JSON
    text = summary_text(tuned)
    assert "--speculative-config '" + json.dumps(data["speculative_config"]) + "'" in text
    assert "c = 1: k = 2, c = 4: k = 1" in text


def test_one_engine_per_k_one_pass_per_concurrency():
    run = TuneRun(model="m", prompts=["a", "b", "c"], concurrencies=[4, 1], max_k=2,
                  engine_args={"dtype": "float32", "max_model_len": 512}, temperature=0.5)
    assert run.concurrencies == [1, 4]
    ps = passes(run)
    assert [p["prompts"] for p in ps] == [["a"], ["a", "b", "c", "a"]]
    assert ps[0]["sampling"] == {"temperature": 0.5, "seed": 0}
    config = engine_config(run, 2)
    assert config.num_speculative_tokens == 2 and config.step_timings and config.eager is None
    assert config.llm_kwargs["max_num_seqs"] == 4 and config.llm_kwargs["dtype"] == "float32"
    assert config.max_model_len == 512
    with pytest.raises(ValueError, match="max-k"):
        TuneRun(model="m", prompts=["a"], concurrencies=[1], max_k=0)


def test_engine_arguments_pass_through_vllms_parser():
    assert engine_args([]) == {}
    assert engine_args(["--dtype", "float32", "--max-model-len", "512"]) == {
        "dtype": "float32", "max_model_len": 512}
    with pytest.raises(SystemExit, match="--speculative-config"):
        engine_args(["--speculative-config", '{"method": "mtp"}'])
    with pytest.raises(SystemExit):
        engine_args(["--no-such-engine-argument", "1"])


def test_a_point_from_the_engines_step_timings():
    """Medians over repeats; the time outside the runner per step; the prefill steps' sum."""
    from vllm_mtp_plugin.tools.throughput.measure import point

    runs = [{"seconds": 1.0, "output_tokens": 40, "spec_decode": {"num_drafts": 5},
             "steps": {"steps": 10, "all_steps_s": 0.8, "prefill_s": 0.2, "step_ms": 60.0,
                       "draft_ms": 10.0, "tokens_per_step": 4, "decode_steps": 9}},
            {"seconds": 2.0, "output_tokens": 40, "spec_decode": {"num_drafts": 6},
             "steps": {"steps": 10, "all_steps_s": 1.6, "prefill_s": 0.4, "step_ms": 80.0,
                       "draft_ms": 12.0, "tokens_per_step": 4, "decode_steps": 9}}]
    p = point(1, 2, runs)
    assert p["step_ms"] == 70.0 and p["draft_ms"] == 11.0 and p["prefill_ms"] == pytest.approx(300)
    assert p["mean_step_ms"] == pytest.approx(100.0)  # (0.8 - 0.2) / 9 and (1.6 - 0.4) / 9
    assert p["outside_ms"] == pytest.approx(30.0)  # (1.0 - 0.8) / 10 and (2.0 - 1.6) / 10
    assert p["measured_tok_s"] == 30.0 and p["tokens_per_step"] == 4
    assert p["spec_decode"] == {"num_drafts": 6}
    assert point(0, 1, runs)["draft_ms"] == 0.0 and point(0, 1, runs)["spec_decode"] is None


def test_ks_vllm_accepts_and_engine_settings(tmp_path):
    from vllm_mtp_plugin.tools.throughput.measure import allowed_ks

    (tmp_path / "config.json").write_text(json.dumps({"num_nextn_predict_layers": 2}))
    assert allowed_ks(str(tmp_path), 5) == [0, 1, 2, 4]  # 3 and 5 are not multiples of 2
    assert allowed_ks(str(tmp_path / "missing"), 3) == [0, 1, 2, 3]
    run = TuneRun(model="m", prompts=["a"], concurrencies=[1], engine_args={"tensor_parallel_size": 2})
    config = engine_config(run, 1)
    assert config.default_process_mode and config.llm_kwargs["enable_prefix_caching"] is False
    assert config.max_model_len is None  # the model's own unless given
    assert not engine_config(TuneRun(model="m", prompts=["a"], concurrencies=[1]), 1).default_process_mode
    assert engine_config(TuneRun(model="m", prompts=["a"], concurrencies=[1], engine_args={
        "enable_prefix_caching": True}), 0).llm_kwargs["enable_prefix_caching"] is True
    with pytest.raises(ValueError, match="max-tokens"):
        TuneRun(model="m", prompts=["a"], concurrencies=[1], max_tokens=1)


def test_a_concurrency_without_a_k0_measurement_is_left_out():
    expected = {1: {0: 10.0, 1: 12.0}, 4: {1: 30.0, 2: 28.0}}
    assert prediction.best_k(expected) == {1: 1}


def _sweep(tmp_path, name, tok_s: dict) -> Path:
    """A results.json as ``vllm-mtp bench offline`` writes it: one row per (c, k), one run per pass
    (and a floor row, which a check must not read)."""
    rows = [{"mode": "offline", "concurrency": c, "k": k, "floor_only": False,
             "runs": [{"output_tok_s": v} for v in passes]} for (c, k), passes in tok_s.items()]
    # rows that measure something else than tune did: never read
    others = [{"floor_only": True}, {"impl": "in-tree"}, {"prompts": "code"},
              {"temperature": 1.0}, {"mla_verify": "off"}, {"mode": "serve"},
              {"checkpoint_path": str(tmp_path / "another-model")}]
    rows += [{"mode": "offline", "concurrency": c, "k": k, "runs": [{"output_tok_s": 1e9}],
              **other} for (c, k) in tok_s for other in others]
    path = tmp_path / name
    path.write_text(json.dumps({"results": rows}))
    return path


def test_check_against_a_fixed_k_sweep(tmp_path):
    from vllm_mtp_plugin.tools.tune import check

    one = _sweep(tmp_path, "c1.json", {(1, 0): [100, 104], (1, 1): [150, 160], (1, 2): [170, 175]})
    many = _sweep(tmp_path, "c4.json", {(4, 0): [300, 330], (4, 1): [320, 340], (4, 2): [200, 210],
                                        (16, 0): [600, 610], (16, 1): [500, 520]})
    table = check.measured([one, many], {"model": str(tmp_path / "model"), "temperature": 0.0})
    assert table[1][2] == {"median": 172.5, "low": 170, "high": 175, "passes": 2}
    assert max(m["high"] for by_k in table.values() for m in by_k.values()) < 1e9
    with pytest.raises(ValueError, match="both measure concurrency 1, k = 0"):
        check.measured([one, one])
    tune = {"best_fixed_k": {"1": 2, "4": 0, "16": 1, "64": 0}}
    left_out = []
    by_c = {v.concurrency: v for v in check.compare({1: 2, 4: 0, 16: 1, 64: 0}, table,
                                                    log=left_out.append)}
    assert set(by_c) == {1, 4, 16}  # c = 64 was not in the sweep, and says so
    assert left_out == ["concurrency 64: left out (no comparable sweep rows)"]
    assert by_c[1].pick == "best" and by_c[1].tuned_over_no_speculation == 172.5 / 102
    # k = 0 picked at c = 4 where k = 1 measured 330 vs 315: the ranges overlap
    assert (by_c[4].measured_best_k, by_c[4].pick) == (1, "within noise")
    assert not by_c[4].slower_than_no_speculation
    assert by_c[16].pick == "missed" and by_c[16].slower_than_no_speculation
    assert by_c[16].tuned_over_best == pytest.approx(510 / 605)
    text = check.text(list(by_c.values()))
    assert "| 16 | 605.0 [600.0–610.0] | 510.0 [500.0–520.0] | – |" in text
    assert "missed; slower than k = 0" in text and "one pass" not in text
    single = _sweep(tmp_path, "one-pass.json", {(8, 0): [100], (8, 1): [99]})
    (verdict,) = check.compare({8: 1},
                               check.measured([single], {"model": str(tmp_path / "model")}))
    assert verdict.pick == "missed" and verdict.single_pass
    assert "missed; slower than k = 0; one pass: no noise range" in check.text([verdict])
    tune_json = tmp_path / "tune.json"
    tune_json.write_text(json.dumps({**tune, "settings": {"model": "m"}}))
    assert check.main([str(tune_json), str(one), "--out", str(tmp_path)]) == 0  # c = 1 holds
    assert (tmp_path / "tune_vs_fixed.png").stat().st_size > 0
    assert json.loads((tmp_path / "check.json").read_text())["verdicts"][0]["tuned_k"] == 2
    assert check.main([str(tune_json), str(one), str(many), "--out", str(tmp_path)]) == 1


def _two_method_result(probabilistic_accepted: list[int]) -> dict:
    """tune's result when greedy and probabilistic drafts were measured at k = 0..2, c = 1 and 4:
    the same step costs (probabilistic a little dearer), the acceptance as given."""
    run = TuneRun(model="m", prompts=["a"], concurrencies=[1, 4], max_k=2, temperature=1.0,
                  draft_sample_methods=["greedy", "probabilistic"])
    steps = {(1, 0): 49.0, (1, 1): 59.0, (1, 2): 69.0, (4, 0): 99.0, (4, 1): 170.0, (4, 2): 229.0}
    points = []
    for p in _points(steps):
        for method in (["greedy", "probabilistic"] if p["k"] else [None]):
            extra = 2.0 if method == "probabilistic" else 0.0
            points.append({**p, "step_ms": p["step_ms"] + extra, "measured_tok_s": 1.0,
                           "draft_sample_method": method})
    by_method = {"greedy": {"num_drafts": 100, "accepted_per_position": [30, 9]},
                 "probabilistic": {"num_drafts": 100,
                                   "accepted_per_position": probabilistic_accepted}}
    tuned = result(run, Measured(points=points, compilation=["x"], counters=by_method))
    assert summary_text(TuneResult.from_json(tuned.to_json())) == summary_text(tuned)
    return tuned.to_json()


def test_sampled_traffic_recommends_the_draft_method_that_pays():
    data = _two_method_result([60, 29])
    assert data["draft_sample_method"] == "probabilistic"
    assert data["speculative_config"]["draft_sample_method"] == "probabilistic"
    methods = data["draft_methods"]
    assert methods["probabilistic"]["acceptance"]["per_position"] == pytest.approx([0.6, 0.29])
    assert methods["greedy"]["acceptance"]["per_position"] == pytest.approx([0.3, 0.09])
    # the top level is the chosen method's, computed from its own step costs
    assert data["expected_tok_s"] == methods["probabilistic"]["expected_tok_s"]
    # c = 1, k = 1: N = 64 tokens in 63 / tau_1 steps of (59 + 2) ms + 1 ms outside
    assert data["expected_tok_s"]["1"]["1"] == pytest.approx(64 / (63 / 1.6 * 0.062))
    assert methods["probabilistic"]["mean_best_speedup"] > methods["greedy"]["mean_best_speedup"]
    text = summary_text(TuneResult.from_json(data))
    assert "acceptance per draft position at k = 2, probabilistic drafts: 0.60 0.29" in text
    assert "draft method: probabilistic (mean over concurrencies of the best k's speed-up " in text
    assert '"draft_sample_method": "probabilistic"' in text
    # no better acceptance for a dearer step: greedy stays, and the config names no method
    data = _two_method_result([30, 9])
    assert data["draft_sample_method"] == "greedy"
    assert "draft_sample_method" not in (data["speculative_config"] or {})


def test_when_no_k_pays_the_method_to_speculate_with_is_still_named():
    """Both methods' best k is 0 (speed-up 1.0 each): the tie goes to the method whose best
    k > 0 comes closest, and no speculation is recommended."""
    assert prediction.preferred_draft_method({"greedy": (1.0, 0.8), "probabilistic": (1.0, 0.9)}) == \
        "probabilistic"
    assert prediction.preferred_draft_method({"greedy": (1.0, 0.9), "probabilistic": (1.0, 0.9)}) == \
        "greedy"
    expected = {1: {0: 100.0, 1: 80.0, 2: 90.0}, 4: {0: 300.0, 1: 240.0, 2: 210.0}}
    best = prediction.best_k(expected)
    assert best == {1: 0, 4: 0}
    assert prediction.mean_best_speedup(expected, best) == 1.0
    assert prediction.mean_best_speedup(expected, best, speculating=True) == pytest.approx(0.85)


def test_draft_methods_measured_by_default_and_their_engines():
    assert draft_methods(parse_args(["m", "--temperature", "0.6"])[0]) == ["greedy",
                                                                           "probabilistic"]
    assert draft_methods(parse_args(["m"])[0]) == ["greedy"]
    assert draft_methods(parse_args(["m", "--temperature", "1", "--draft-sample-method",
                                     "probabilistic"])[0]) == ["probabilistic"]
    run = TuneRun(model="m", prompts=["a"], concurrencies=[1], temperature=1.0,
                  draft_sample_methods=["greedy", "probabilistic"])
    assert engine_config(run, 2, "probabilistic").speculative_overrides == {
        "draft_sample_method": "probabilistic"}
    assert engine_config(run, 0, None).speculative_overrides == {}
    with pytest.raises(ValueError, match="draft sample methods must be some of"):
        TuneRun(model="m", prompts=["a"], concurrencies=[1], draft_sample_methods=["top"])
    assert TuneRun(model="m", prompts=["a"], concurrencies=[1],
                   draft_sample_methods=["probabilistic", "greedy"]).draft_sample_methods == [
        "greedy", "probabilistic"]  # vLLM's order: a tie goes to greedy however given


def test_check_compares_only_the_chosen_draft_method_and_standard_verification(tmp_path):
    from vllm_mtp_plugin.tools.tune import check

    rows = [{"mode": "offline", "concurrency": 1, "k": k, "runs": [{"output_tok_s": v}],
             "draft_sample_method": method}
            for k, method, v in ((0, None, 100.0), (1, "greedy", 110.0),
                                 (1, "probabilistic", 150.0))]
    # block verification: not what tune measured (it never sets it), never compared
    rows.append({"mode": "offline", "concurrency": 1, "k": 1, "runs": [{"output_tok_s": 1e9}],
                 "draft_sample_method": "greedy", "rejection_sample_method": "block"})
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"results": rows}))
    for method, k1 in (("greedy", 110.0), ("probabilistic", 150.0)):
        table = check.measured([path], {"temperature": 0.0, "draft_sample_method": method})
        assert (table[1][0]["median"], table[1][1]["median"]) == (100.0, k1)
