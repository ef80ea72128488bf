"""The benchmark's verification floor and its before/after axis for ``mla_verify_as_decode``:
which configurations a sweep adds, how the floor figures are derived, and what the report says."""

import pytest
import torch

from vllm_mtp_plugin.patches.mla_verify_as_decode import SWITCH
from vllm_mtp_plugin.tools import cpu_features
from vllm_mtp_plugin.tools.bench import analysis, report
from vllm_mtp_plugin.tools.bench.offline_mode import filled
from vllm_mtp_plugin.tools.bench.serve_mode import server_env
from vllm_mtp_plugin.tools.bench.sweep import Config, Sweep


def test_floor_configs_follow_the_sweep():
    sweep = Sweep(ks=[0, 1, 3], impls=["plugin", "in-tree"], concurrencies=[1, 2],
                  mla_verify=["on", "off"], floor=True, num_prompts=4, checkpoints=["x"])
    configs = sweep.configs()
    # k = 0 once (the patch changes nothing without speculation), k > 0 with the patch on and off
    assert [c for c in configs if c.k == 0 and not c.fill] == [
        Config("x", impl, 0, c) for impl in ("plugin", "in-tree") for c in (1, 2)]
    assert len([c for c in configs if c.k]) == 2 * 2 * 2 * 2
    # floors: (k + 1) * c rows for k in {1, 3}, c in {1, 2}: 2, 4 and 8 rows; the sweep's own
    # k = 0 at c = 2 (4 prompts) is the 2-row floor, so 4 and 8 are added (8: prompts repeated)
    floors = [c for c in configs if c.fill]
    assert floors == [Config("x", "plugin", 0, 4, fill=True), Config("x", "plugin", 0, 8, fill=True)]
    assert Sweep(ks=[0, 2], floor=False, checkpoints=["x"]).configs() == [
        Config("x", impl, k, 1) for impl in ("plugin", "in-tree") for k in (0, 2)]
    with pytest.raises(ValueError, match="offline mode"):
        Sweep(mode="serve", floor=True)
    with pytest.raises(ValueError, match="mla_verify"):
        Sweep(mla_verify=["maybe"])


def test_floor_passes_fill_the_batch_and_the_switch_reaches_the_engine():
    passes = [{"label": {"prompts": "code"}, "prompts": ["a", "b"],
               "sampling": [{"seed": 0}, {"seed": 1}]},
              {"label": {"prompts": "prose"}, "prompts": ["p"], "sampling": {"temperature": 0}}]
    code, prose = filled(passes, 5)
    assert code["prompts"] == ["a", "b", "a", "b", "a"] and len(code["sampling"]) == 5
    assert prose["prompts"] == ["p"] * 5 and prose["sampling"] == {"temperature": 0}
    assert filled(passes, 1)[0]["prompts"] == ["a"]  # a third request would run alone
    off, on = Config("x", "plugin", 2, 1, "off"), Config("x", "plugin", 2, 1)
    assert off.verify_env() == {SWITCH: "0"} and on.verify_env() == {}
    assert server_env("plugin", verify_env=off.verify_env())[SWITCH] == "0"
    assert SWITCH not in server_env("in-tree", verify_env=on.verify_env())
    floor = Config("x", "plugin", 0, 3, "off", fill=True)
    assert (floor.log_suffix(), off.log_suffix(), on.log_suffix()) == ("-verify-off-floor",
                                                                       "-verify-off", "")


def _row(k, c, steps, tau=None, verify="on", floor_only=False):
    return {"mode": "offline", "checkpoint": "b", "impl": "plugin", "k": k, "concurrency": c,
            "output_tok_s": 10.0, "mean_acceptance_length": tau, "mla_verify": verify,
            "floor_only": floor_only, "steps": steps}


def test_floor_figures():
    rows = analysis.add_derived([
        _row(0, 1, {"step_ms": 100.0, "tokens_per_step": 1}),
        _row(0, 2, {"step_ms": 130.0, "tokens_per_step": 2}, floor_only=True),
        _row(0, 4, {"step_ms": 210.0, "tokens_per_step": 3}, floor_only=True),  # batch not full
        _row(1, 1, {"draft_ms": 20.0, "target_ms": 143.0}, tau=1.8),
        _row(1, 1, {"draft_ms": 20.0, "target_ms": 260.0}, tau=1.8, verify="off"),
        _row(3, 1, {"draft_ms": 60.0, "target_ms": 300.0}, tau=2.5),
    ])
    on, off, k3 = rows[3:]
    assert on["floor_rows"] == 2 and on["floor_ratio"] == pytest.approx(1.3)
    assert on["verify_over_floor"] == pytest.approx(1.1)
    assert off["verify_over_floor"] == pytest.approx(2.0) and off["floor_ratio"] == on["floor_ratio"]
    # speculation breaks even at tau = floor + k * c = 1.3 + 0.2; perfect drafts give 2 / 1.5
    assert on["break_even_acceptance_length"] == pytest.approx(1.5)
    assert on["payoff_bound"] == pytest.approx(2 / 1.5)
    # the 4-row floor ran 3 rows per step: no floor rather than a wrong one
    assert k3["floor_ratio"] is None and k3["verify_over_floor"] is None
    assert k3["verify_cost_ratio"] == pytest.approx(3.0)
    env = {"cpu": "Some CPU", "cpus": 2, "cpu_flags": ["avx2"], "cpu_flags_missing": ["avx512f"],
           "vllm_kernels": "_C_AVX2", "vllm": "0.32.0", "torch": "2.13.0+cpu"}
    text = report.floor_text(rows, env)
    assert text.startswith("machine: Some CPU, 2 CPUs; flags: avx2 (without avx512f); "
                           "vLLM kernels _C_AVX2")
    assert "| b | plugin | all | – | 1 | 1 | off | 1.30 | 2.60 | 2.00 | 0.20 | 1.50 | 1.80 | 1.33× |" in text
    assert text.rstrip().endswith("exceeds 1.50.") and "can pay off on this machine" in text
    slow = analysis.add_derived([_row(0, 1, {"step_ms": 100.0, "tokens_per_step": 1}),
                                 _row(0, 2, {"step_ms": 190.0, "tokens_per_step": 2}),
                                 _row(1, 1, {"draft_ms": 30.0, "target_ms": 200.0}, tau=1.9)])
    assert "cannot pay off on this machine, whatever the drafter" in report.floor_text(slow, env)
    assert report.floor_text(rows[:3], env) == ""  # no speculative row: nothing to say


def test_machine_summary_names_the_kernels_vllm_loads():
    summary = cpu_features.machine_summary()
    assert set(summary["cpu_flags"]) | set(summary["cpu_flags_missing"]) == set(
        cpu_features.SPEED_FLAGS)
    expected = ("_C_AVX2" if not torch.cpu._is_avx512_supported() else
                "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512")
    assert summary["vllm_kernels"] == expected
    assert ("avx512f" in summary["cpu_flags"]) == torch.cpu._is_avx512_supported()


def test_a_floor_row_is_never_a_baseline_and_a_partial_batch_never_a_floor():
    """--concurrency 1 2 with 3 prompts: the sweep's own k = 0 at c = 2 runs 2 + 1 requests (not
    full), so a floor engine runs exactly 2 at once. Speed-ups at c = 2 read the sweep's row; the
    floor of k = 1 at c = 1 reads the full one."""
    own = {**_row(0, 2, {"step_ms": 120.0, "tokens_per_step": 1.5}), "output_tok_s": 12.0}
    floor = {**_row(0, 2, {"step_ms": 130.0, "tokens_per_step": 2}, floor_only=True),
             "output_tok_s": 16.0}
    spec2 = {**_row(1, 2, {"draft_ms": 30.0, "target_ms": 200.0}, tau=1.8), "output_tok_s": 18.0}
    rows = analysis.add_derived([_row(0, 1, {"step_ms": 100.0, "tokens_per_step": 1}), own,
                                 floor, _row(1, 1, {"draft_ms": 20.0, "target_ms": 143.0}, tau=1.8),
                                 spec2])
    assert rows[1]["baseline"]["output_tok_s"] == 12.0 and rows[4]["speedup"] == 1.5
    assert rows[4]["baseline"]["processes"] == 1  # the floor row was not pooled in
    assert rows[3]["floor_ratio"] == pytest.approx(1.3)  # the full 2-row step, not 120 ms
    assert rows[2]["speedup"] == 1.0  # a floor row's speed-up is against itself


def test_vllm_alone_loads_no_plugin_and_keeps_its_own_baseline():
    """``--impl vllm`` is vLLM with no plugin at all; without the plugin's patches its k = 0 runs
    other code, so it is not pooled into the plugin's and the in-tree class's baseline."""
    from vllm_mtp_plugin.tools.bench.analysis import baselines
    from vllm_mtp_plugin.tools.engine.offline import child_env

    assert child_env("vllm", base={})["VLLM_PLUGINS"] == ""
    assert server_env("vllm")["VLLM_PLUGINS"] == ""
    assert "VLLM_PLUGINS" not in child_env("in-tree", base={"VLLM_PLUGINS": ""})
    row = {"mode": "offline", "checkpoint": "c", "concurrency": 1, "prompts": "all",
           "temperature": 0.0, "k": 0}
    rows = [{**row, "impl": impl, "output_tok_s": tok_s, "steps": {"step_ms": 1.0}}
            for impl, tok_s in (("plugin", 10.0), ("in-tree", 12.0), ("vllm", 30.0))]
    assert sorted(b["output_tok_s"] for b in baselines(rows).values()) == [11.0, 30.0]


def test_an_engine_in_its_own_process_may_receive_the_benchmarks_functions():
    """The bench sends functions to the workers (step timer, drafter report): across processes
    vLLM needs its serialization switch for that - vLLM's default process mode, and a caller who
    exported VLLM_ENABLE_V1_MULTIPROCESSING=1 (``vllm-mtp bench offline`` failed there with
    "Object of type function is not serializable")."""
    from vllm_mtp_plugin.tools.engine.offline import child_env

    switch = "VLLM_ALLOW_INSECURE_SERIALIZATION"
    assert switch not in child_env("plugin", base={})  # in-process: not needed
    assert child_env("plugin", base={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})[switch] == "1"
    spawned = child_env("plugin", base={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                        default_process_mode=True)
    assert spawned[switch] == "1" and "VLLM_ENABLE_V1_MULTIPROCESSING" not in spawned


def test_a_row_keeps_the_generated_tokens_once_and_whether_replays_agreed():
    from vllm_mtp_plugin.tools.bench.analysis import finish_row

    def run(process, tokens):
        return {"process": process, "output_tok_s": 1.0, "spec_decode": None, "token_ids": tokens}
    row = finish_row({}, [run(0, [[1, 2]]), run(1, [[1, 2]])])
    assert row["token_ids"] == [[1, 2]] and row["replays_agree"] is True
    assert all("token_ids" not in r for r in row["runs"])
    assert finish_row({}, [run(0, [[1, 2]]), run(1, [[1, 3]])])["replays_agree"] is False
    assert "token_ids" not in finish_row({}, [run(0, None)])  # serve mode: no ids from the server
