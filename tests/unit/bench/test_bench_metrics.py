"""Benchmark arithmetic: Prometheus text -> counters -> rates, deltas, sums, speed-ups, the bound."""

import statistics
from types import SimpleNamespace

import pytest

from vllm_mtp_plugin.tools.engine import metrics
from vllm_mtp_plugin.tools.bench import analysis, crosscheck
from vllm_mtp_plugin.tools.engine import steptimer

# Lines as a vLLM 0.32 server exposes them (captured from a tiny checkpoint, k = 2).
PAGE = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="/m"} 4.0
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="/m"} 1.7959436494399629e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="/m"} 8.0
vllm:spec_decode_num_draft_tokens_created{engine="0",model_name="/m"} 1.7959436494399881e+09
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="/m"} 7.0
vllm:spec_decode_num_accepted_tokens_created{engine="0",model_name="/m"} 1.7959436494400032e+09
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/m",position="0"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/m",position="1"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="/m",position="0"} 1.79e+09
vllm:num_requests_running{engine="0",model_name="/m"} 0.0
"""


def test_prometheus_page_to_counters_and_rates():
    c = metrics.counters_from_prometheus(PAGE)
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (4, 8, 7)
    assert c.accepted_per_position == (4, 3)
    assert c.acceptance_rate == pytest.approx(7 / 8)
    assert c.mean_acceptance_length == pytest.approx(1 + 7 / 4)
    assert c.per_position_acceptance == pytest.approx([1.0, 0.75])


def test_parse_prometheus_labels_escapes_and_comments():
    samples = metrics.parse_prometheus(
        '# HELP x y\nfoo_total{a="1",b="say \\"hi\\""} 2.5\nbar 3\n\n')
    assert samples == {("foo_total", (("a", "1"), ("b", 'say \\"hi\\"'))): 2.5, ("bar", ()): 3.0}


def test_counters_sum_over_engines():
    two = PAGE + PAGE.replace('engine="0"', 'engine="1"')
    c = metrics.counters_from_prometheus(two)
    assert (c.num_drafts, c.num_accepted_tokens, c.accepted_per_position) == (8, 14, (8, 6))


def test_delta_between_two_scrapes():
    # Before any speculation the per-position series may be absent: the delta pads with zeros.
    before = metrics.counters_from_prometheus(
        "vllm:spec_decode_num_drafts_total 0\nvllm:spec_decode_num_draft_tokens_total 0\n"
        "vllm:spec_decode_num_accepted_tokens_total 0\n")
    after = metrics.counters_from_prometheus(PAGE)
    later = metrics.counters_from_prometheus(
        PAGE.replace("} 4.0", "} 10.0").replace("} 8.0", "} 20.0").replace("} 7.0", "} 13.0"))
    assert (after - before) == after
    delta = later - after  # drafts 10-4, draft tokens 20-8, accepted 13-7, positions (10-4, 3-3)
    assert (delta.num_drafts, delta.num_draft_tokens, delta.num_accepted_tokens) == (6, 12, 6)
    assert delta.accepted_per_position == (6, 0)
    assert delta.acceptance_rate == pytest.approx(0.5)
    assert delta.mean_acceptance_length == pytest.approx(2.0)
    assert delta.per_position_acceptance == pytest.approx([1.0, 0.0])


def test_no_drafts_gives_no_rates():
    s = metrics.SpecDecodeCounters().summary()
    assert s["acceptance_rate"] is None and s["mean_acceptance_length"] is None
    assert s["per_position_acceptance"] == []


def test_offline_metrics_objects():
    llm_metrics = [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=5),
                   SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=15),
                   SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=9),
                   SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos",
                                   values=[5, 3, 1]),
                   SimpleNamespace(name="vllm:num_requests_running", value=1)]
    c = metrics.counters_from_llm_metrics(llm_metrics)
    assert c.summary()["per_position_acceptance"] == pytest.approx([1.0, 0.6, 0.2])
    assert c.mean_acceptance_length == pytest.approx(1 + 9 / 5)


def test_summed_runs_are_a_ratio_of_sums():
    a = metrics.SpecDecodeCounters(10, 20, 20, (10, 10)).summary()
    b = metrics.SpecDecodeCounters(30, 60, 0, (0, 0)).summary()
    total = metrics.total_counters([a, None, b])
    assert total == metrics.SpecDecodeCounters(40, 80, 20, (10, 10))
    assert total.acceptance_rate == pytest.approx(0.25)  # a mean of the two rates would be 0.5
    assert metrics.counters_from_summary(a) == metrics.SpecDecodeCounters(10, 20, 20, (10, 10))


def test_latency_summary_and_medians():
    s = analysis.latency_summary([0.010, 0.020, 0.030, None])
    assert s["mean"] == pytest.approx(20.0) and s["p50"] == pytest.approx(20.0)
    assert s["p99"] == pytest.approx(29.8)  # linear interpolation, as numpy and vllm bench serve
    assert analysis.latency_summary([]) == {"mean": None, "p50": None, "p99": None}
    assert analysis.median_of([{"a": 1, "b": None}, {"a": 3, "b": 4}, None]) == {"a": 2, "b": 4}


def _row(impl, k, tok_s, tau=None, steps=None):
    return {"mode": "offline", "checkpoint": "c", "impl": impl, "k": k, "concurrency": 1,
            "output_tok_s": tok_s, "mean_acceptance_length": tau, "steps": steps or {}}


def test_speedup_ideal_bound_and_in_tree_ratio():
    rows = analysis.add_derived([
        _row("plugin", 0, 10.0, steps={"step_ms": 100.0, "draft_ms": 0.0, "target_ms": 100.0}),
        _row("plugin", 2, 18.0, 2.5, {"step_ms": 170.0, "draft_ms": 20.0, "target_ms": 150.0}),
        _row("in-tree", 0, 10.0, steps={"step_ms": 100.0}),
        _row("in-tree", 2, 15.0, 2.5, {"step_ms": 190.0, "draft_ms": 40.0, "target_ms": 150.0}),
    ])
    base, spec, _, tree = rows
    assert base["speedup"] == 1.0 and base["ideal_speedup"] == 1.0
    assert spec["speedup"] == pytest.approx(1.8)
    assert spec["draft_cost_ratio"] == pytest.approx(0.1)  # 20 ms / (2 drafts * 100 ms)
    assert spec["verify_cost_ratio"] == pytest.approx(1.5)
    assert spec["ideal_speedup"] == pytest.approx(2.5 / 1.2)
    assert spec["measured_over_ideal"] == pytest.approx(1.8 / (2.5 / 1.2))
    assert spec["vs_in_tree"] == pytest.approx(18 / 15) and tree["vs_in_tree"] is None
    assert tree["ideal_speedup"] == pytest.approx(2.5 / 1.4)
    assert analysis.ideal_speedup(1.0, 3, 0.0) == 1.0  # nothing accepted, free drafts: no gain


def test_k0_baseline_is_pooled_over_implementations():
    # k = 0 runs no drafter: both implementations' processes form one baseline.
    plugin0 = {**_row("plugin", 0, 33.0), "output_tok_s_processes": [32.0, 33.0, 34.0],
               "steps_processes": [{"step_ms": 30.0}, {"step_ms": 29.0}, {"step_ms": 31.0}]}
    tree0 = {**_row("in-tree", 0, 26.0), "output_tok_s_processes": [26.0, 26.0, 36.0],
             "steps_processes": [{"step_ms": 38.0}, {"step_ms": 38.0}, {"step_ms": 27.0}]}
    spec = _row("plugin", 3, 45.0, 3.0, {"draft_ms": 18.0, "target_ms": 50.0})
    rows = analysis.add_derived([plugin0, tree0, spec])
    base = rows[2]["baseline"]
    assert base == {"output_tok_s": 32.5, "step_ms": 30.5, "tokens_per_step": None,
                    "processes": 6, "impls": ["plugin", "in-tree"]}
    assert rows[0]["speedup"] == pytest.approx(33 / 32.5)  # off 1.0 by the noise only
    assert rows[1]["speedup"] == pytest.approx(26 / 32.5)
    assert rows[2]["speedup"] == pytest.approx(45 / 32.5)
    assert rows[2]["draft_cost_ratio"] == pytest.approx(18 / (3 * 30.5))


def test_speedup_needs_a_baseline():
    (row,) = analysis.add_derived([_row("plugin", 3, 12.0, 3.0, {"draft_ms": 5.0})])
    assert row["speedup"] is None and row["ideal_speedup"] is None


def test_finish_row_medians_over_repeats():
    runs = [{"output_tok_s": v, "spec_decode": metrics.SpecDecodeCounters(2, 4, a, (a,)).summary(),
             "ttft_ms": {"mean": v}, "tpot_ms": {"mean": 2 * v}} for v, a in ((5, 1), (9, 2), (7, 1))]
    row = analysis.finish_row({}, runs)
    assert row["output_tok_s"] == 7 and row["ttft_ms"] == {"mean": 7} and row["tpot_ms"] == {"mean": 14}
    assert row["acceptance_rate"] == pytest.approx(4 / 12)
    assert row["per_position_acceptance"] == pytest.approx([4 / 6])


def test_rates_are_a_median_over_engine_processes():
    # Process 0 ran slow (both repeats), processes 1 and 2 fast: the row takes the middle process.
    runs = [{"process": p, "output_tok_s": v, "steps": {"step_ms": 1000 / v}}
            for p, v in ((0, 25), (0, 26), (1, 37), (1, 36), (2, 30), (2, 31))]
    row = analysis.finish_row({}, runs)
    assert row["output_tok_s_processes"] == [25.5, 36.5, 30.5]
    assert row["output_tok_s"] == 30.5
    assert row["steps"]["step_ms"] == pytest.approx(statistics.median(
        [statistics.median([40, 1000 / 26]), statistics.median([1000 / 37, 1000 / 36]),
         statistics.median([1000 / 30, 1000 / 31])]))


def test_step_timer_summary_uses_decode_steps():
    steps = [{"tokens": 20, "new_requests": 1, "execute_model": 0.5, "sample_tokens": 0.1,
              "propose_draft_token_ids": 0.05, "_model_forward": 0.4},
             *({"tokens": 4, "new_requests": 0, "execute_model": e, "sample_tokens": 0.03,
                "propose_draft_token_ids": 0.02, "_model_forward": e - 0.01}
               for e in (0.10, 0.12, 0.30)),
             {"tokens": 0, "new_requests": 0}]
    s = steptimer.summarize(steps)
    assert (s["steps"], s["decode_steps"], s["tokens_per_step"]) == (5, 3, 4)
    assert s["step_ms"] == pytest.approx(150.0) and s["draft_ms"] == pytest.approx(20.0)
    assert s["target_ms"] == pytest.approx(130.0) and s["forward_ms"] == pytest.approx(110.0)


PRINTED = """\
============ Serving Benchmark Result ============
Successful requests:                     4
---------------Speculative Decoding---------------
Acceptance rate (%):                     48.53
Acceptance length:                       1.97
Drafts:                                  34
Per-position acceptance (%):
  Position 0:                            50.00
  Position 1:                            47.06
==================================================
"""


def test_cross_check_parsing_and_comparison():
    block = crosscheck.speculative_section(PRINTED)
    assert block.splitlines()[0].strip("-") == "Speculative Decoding"
    assert block.splitlines()[-1].strip() == "Position 1:                            47.06"
    ours = metrics.SpecDecodeCounters(34, 68, 33, (17, 16)).summary()
    theirs = {"num_drafts": 34, "num_draft_tokens": 68, "num_accepted_tokens": 33,
              "acceptance_rate": 0.4852941176470588, "mean_acceptance_length": 1 + 33 / 34,
              "per_position_acceptance": [0.5, 16 / 34]}
    assert crosscheck.compare(ours, theirs)["agree"]
    assert not crosscheck.compare(ours, {**theirs, "num_accepted_tokens": 32})["agree"]
    assert not crosscheck.compare(ours, {**theirs, "per_position_acceptance": [0.5]})["agree"]


def test_interference_meter_reads_proc():
    import os

    from vllm_mtp_plugin.tools.engine import interference

    parent, _ = interference._stat(os.getpid())
    assert parent == os.getppid()
    own = interference._stat(os.getpid())[1]  # read first: CPU time only grows afterwards
    assert interference.tree_seconds(os.getpid()) >= own
    with interference.Meter() as meter:
        sum(range(10_000))
    result = meter.result()
    assert result["wall_s"] > 0 and result["other_cpu_s"] >= 0


def test_cross_check_fails_only_where_runs_must_match():
    from vllm_mtp_plugin.tools.bench import report

    differ = {"agree": False, "fields": {}, "per_position_acceptance": ([], [])}
    row = {"checkpoint": "c", "impl": "plugin", "k": 3}
    assert not report.cross_check_failed([{**row, "concurrency": 4, "cross_check": differ}])
    assert report.cross_check_failed([{**row, "concurrency": 1, "cross_check": differ}])
    assert "differ slightly" in report.cross_check_text([{**row, "concurrency": 4,
                                                          "cross_check": differ}])


def test_baselines_and_in_tree_ratios_are_per_prompt_kind_and_temperature():
    def row(impl, k, tok_s, kind, temperature):
        return {**_row(impl, k, tok_s, 2.0 if k else None), "prompts": kind,
                "temperature": temperature}

    rows = analysis.add_derived([
        row("plugin", 0, 10.0, "code", 0.0), row("plugin", 0, 20.0, "prose", 0.0),
        row("plugin", 0, 40.0, "prose", 1.0), row("plugin", 2, 15.0, "code", 0.0),
        row("plugin", 2, 30.0, "prose", 0.0), row("plugin", 2, 30.0, "prose", 1.0),
        row("in-tree", 2, 12.0, "prose", 0.0),
    ])
    code, prose, prose_t1 = rows[3:6]
    assert code["speedup"] == pytest.approx(1.5) and prose["speedup"] == pytest.approx(1.5)
    assert prose_t1["speedup"] == pytest.approx(0.75)
    assert prose["vs_in_tree"] == pytest.approx(2.5) and code["vs_in_tree"] is None
    assert rows[6]["speedup"] == pytest.approx(0.6)
