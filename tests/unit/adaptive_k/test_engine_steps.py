"""What the adaptive-k patch reads from vLLM's own objects and hands to vLLM, without an engine:
the schedule table it stands behind, a step's outcome from a real ``SchedulerOutput`` and
``ModelRunnerOutput``, and a step's cost with one step in flight and with two."""

import pytest
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

from vllm_mtp_plugin.adaptive_k.engine_steps import EngineSteps, step_outcome
from vllm_mtp_plugin.patches import adaptive_k_in_scheduler as patch
from vllm_mtp_plugin.patches.framework import NotFound


def test_the_table_names_every_k_and_passes_vllms_checks():
    table = patch.schedule_table(3)
    assert build_dynamic_sd_schedule_lookup(table, vllm_max_batch_size=8,
                                            vllm_num_speculative_tokens=3)[1:] == [0, 1, 2, 3, 3,
                                                                                   3, 3, 3]
    # fewer sequences than k + 1: vLLM keeps the rows that fit
    assert build_dynamic_sd_schedule_lookup(table, 2, 3)[1:] == [0, 1]
    assert patch.is_adaptive_table([list(row) for row in table], 3)  # after a JSON trip
    assert not patch.is_adaptive_table(table, 2) and not patch.is_adaptive_table([(1, 9, 1)], 3)
    assert not patch.is_adaptive_table(None, 3)


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("0", False), ("", False),
                                      (None, False)])
def test_the_switch(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(patch.SWITCH, raising=False)
    else:
        monkeypatch.setenv(patch.SWITCH, value)
    assert patch.switched_on() is on
    assert patch.probe() is None  # the scheduler's hook goes in everywhere; the table needs it


def speculative_config(table=None, k=3, method="mtp"):
    import types

    return types.SimpleNamespace(method=method, num_speculative_tokens=k,
                                 num_speculative_tokens_per_batch_size=table)


@pytest.fixture
def vllms_config(monkeypatch):
    """What vLLM's ``create_speculative_config`` returns, without building a model's config."""
    made = {}
    monkeypatch.setattr(patch, "_vllm_create_speculative_config",
                        lambda self, *a, **k: made["config"])
    return made


def test_the_table_is_written_where_the_switch_is_on(monkeypatch, vllms_config):
    from vllm_mtp_plugin.adaptive_k import state_file

    monkeypatch.delenv(state_file.STATE_ENV, raising=False)
    monkeypatch.setenv(patch.SWITCH, "1")
    vllms_config["config"] = speculative_config()
    config = patch.create_speculative_config_with_adaptive_k(None)
    assert config.num_speculative_tokens_per_batch_size == patch.schedule_table(3)
    assert state_file.STATE_ENV in __import__("os").environ  # the engine core's state file
    for off in (speculative_config(method="ngram"), speculative_config(k=0)):
        vllms_config["config"] = off
        assert patch.create_speculative_config_with_adaptive_k(None).\
            num_speculative_tokens_per_batch_size is None
    monkeypatch.setenv(patch.SWITCH, "0")
    vllms_config["config"] = speculative_config()
    assert patch.create_speculative_config_with_adaptive_k(None).\
        num_speculative_tokens_per_batch_size is None


def test_a_users_table_wins_and_a_bad_setting_is_named(monkeypatch, vllms_config, plugin_log):
    monkeypatch.setenv(patch.SWITCH, "1")
    vllms_config["config"] = speculative_config(table=[(1, 8, 2)])
    assert patch.create_speculative_config_with_adaptive_k(None).\
        num_speculative_tokens_per_batch_size == [(1, 8, 2)]
    assert "that table chooses k, adaptive k stays off" in plugin_log.text
    vllms_config["config"] = speculative_config()
    monkeypatch.setenv("VLLM_MTP_ADAPTIVE_K_EXPLORE_EVERY", "often")
    with pytest.raises(ValueError, match="VLLM_MTP_ADAPTIVE_K_EXPLORE_EVERY='often'"):
        patch.create_speculative_config_with_adaptive_k(None)
    monkeypatch.delenv("VLLM_MTP_ADAPTIVE_K_EXPLORE_EVERY")
    monkeypatch.setenv("VLLM_MTP_ADAPTIVE_K_LOG_INTERVAL", "-1")
    with pytest.raises(ValueError, match="VLLM_MTP_ADAPTIVE_K_LOG_INTERVAL='-1'"):
        patch.create_speculative_config_with_adaptive_k(None)


def scheduler_output(scheduled, spec, k):
    output = SchedulerOutput.make_empty()
    output.num_scheduled_tokens = scheduled
    output.total_num_scheduled_tokens = sum(scheduled.values())
    output.scheduled_spec_decode_tokens = spec
    output.num_spec_tokens_to_schedule = k
    return output


def test_a_step_outcome_from_vllms_objects():
    out = scheduler_output({"a": 3, "b": 3, "c": 17, "d": 3}, {"a": [5, 6], "b": [7, 8],
                                                                "d": [1, 2]}, 1)
    ran = ModelRunnerOutput(req_ids=["a", "b", "c", "d"],
                            req_id_to_index={"a": 0, "b": 1, "c": 2, "d": 3},
                            sampled_token_ids=[[1, 2, 3], [4], [9], []])
    outcome = step_outcome(out, ran, 0.25)
    # d sampled nothing this step (vLLM's update skips it): not an observation
    assert outcome.drafts == ((2, 2), (2, 0))
    assert (outcome.batch_size, outcome.verified_k, outcome.drafted_k) == (4, 2, 1)
    assert outcome.prefill and outcome.seconds == 0.25
    decode = scheduler_output({"a": 3}, {"a": [5, 6]}, 2)
    assert not step_outcome(decode, ModelRunnerOutput(["a"], {"a": 0}, [[1]]), None).prefill


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_steps_cost_is_the_interval_between_finished_steps_while_the_engine_is_busy():
    """One step in flight or a batch queue: a step costs from the previous step's end (its output
    update and what the engine did after it included), the first after idling from its own
    schedule (the wait for traffic is no step's cost)."""
    clock = Clock()
    steps = EngineSteps(2, clock=clock)
    ran = ModelRunnerOutput(["a"], {"a": 0}, [[1, 2, 3]])
    first, second, third, fourth, fifth = (scheduler_output({"a": 3}, {"a": [5, 6]}, 2)
                                           for _ in range(5))
    steps.scheduled(first, 1.0)
    clock.now = 1.5
    steps.finished(first, ran)       # the engine's first step: schedule .. update
    steps.scheduled(second, 1.6)     # one in flight: 0.1 s outside the runner after first
    clock.now = 2.0
    steps.finished(second, ran)      # 1.5 .. 2.0, not 1.6 .. 2.0
    steps.scheduled(third, 2.05)
    steps.scheduled(fourth, 2.1)     # a batch queue: fourth scheduled before third finished
    clock.now = 2.4
    steps.finished(third, ran)
    clock.now = 2.6
    steps.finished(fourth, ran)      # from third's end, not from its own schedule
    steps.idle()
    steps.scheduled(fifth, 9.0)      # traffic again after a pause
    clock.now = 9.2
    steps.finished(fifth, ran)
    assert [s for _, s in steps.controller.costs.cells[(1, 2)]] == pytest.approx(
        [0.5, 0.5, 0.4, 0.2, 0.2])
    assert steps.controller.acceptance.observations(1) > 2.9
    assert not steps.started


def test_steps_never_finished_are_forgotten():
    steps = EngineSteps(1, clock=Clock())
    for _ in range(100):
        steps.scheduled(scheduler_output({"a": 2}, {"a": [5]}, 1), 0.0)
    assert len(steps.started) <= 16


def test_a_vllm_without_the_per_step_count_is_named(monkeypatch):
    """A vLLM whose speculative config has no per-batch-size table (0.31): the probe says what is
    missing (a warning with its consequence) and nothing is patched."""
    from vllm.config.speculative import SpeculativeConfig

    monkeypatch.setenv(patch.SWITCH, "1")
    fields = dict(SpeculativeConfig.__dataclass_fields__)
    fields.pop("num_speculative_tokens_per_batch_size")
    monkeypatch.setattr(SpeculativeConfig, "__dataclass_fields__", fields)
    reason = patch.probe()
    assert isinstance(reason, NotFound) and "num_speculative_tokens_per_batch_size" in reason
    monkeypatch.setenv(patch.SWITCH, "0")  # not asked for: not a warning
    assert patch.probe() and not isinstance(patch.probe(), NotFound)


def test_a_scheduler_without_the_lookup_is_left_alone(plugin_log, monkeypatch):
    """Where vLLM's ``Scheduler.schedule`` no longer reads ``dynamic_sd_lookup``, the scheduler
    keeps its own methods and the log says why."""
    import types

    class Scheduler:
        def __init__(self):
            pass

        def schedule(self):
            return None

        def update_from_output(self, *args):
            return None

    monkeypatch.setenv(patch.SWITCH, "1")
    module = types.SimpleNamespace(Scheduler=Scheduler)
    kept = (Scheduler.__init__, Scheduler.schedule, Scheduler.update_from_output)
    patch._patch_scheduler(module)
    assert (Scheduler.__init__, Scheduler.schedule, Scheduler.update_from_output) == kept
    assert "adaptive_k_in_scheduler not applied" in plugin_log.text
    assert "Speculative decoding runs with the configured num_speculative_tokens" in plugin_log.text


def test_vllms_scheduler_has_what_the_patch_reads():
    """The shape ``_patch_scheduler`` checks holds for the installed vLLM (when this fails, vLLM
    changed how it picks k per step: read the patch again)."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler

    assert patch.scheduler_shape_problem(Scheduler) is None
    schedule = Scheduler.schedule
    if schedule is patch.schedule_timed:  # an earlier test of this process applied the patch
        schedule = patch._vllm_schedule
    source = inspect.getsource(schedule)
    assert "self.dynamic_sd_lookup is None" in source  # padding to 1 + k only without a lookup


def test_a_failing_controller_leaves_the_engine_at_the_configured_k(plugin_log):
    steps = EngineSteps(3, (0, 1, 3), clock=Clock())
    steps.controller.choose = lambda batch_size: 1 / 0
    assert steps.choose(4) == 3 and steps.failed
    assert "adaptive k stopped (ZeroDivisionError" in plugin_log.text
    steps.finished(scheduler_output({"a": 2}, {"a": [5]}, 1), None)  # ignored, no raise
    assert steps.choose(1) == 3


def test_the_state_is_published_when_the_engine_goes_idle(monkeypatch, tmp_path):
    from vllm_mtp_plugin.adaptive_k import state_file

    monkeypatch.setenv(state_file.STATE_ENV, str(tmp_path / "state.json"))
    clock = Clock()
    steps = EngineSteps(2, clock=clock)
    out = scheduler_output({"a": 3}, {"a": [5, 6]}, 2)
    steps.scheduled(out, 0.0)
    clock.now = 0.1
    steps.finished(out, ModelRunnerOutput(["a"], {"a": 0}, [[1, 2, 3]]))  # written (first)
    out = scheduler_output({"a": 3}, {"a": [5, 6]}, 2)
    steps.controller.choose(1)
    steps.scheduled(out, 0.1)
    clock.now = 0.2
    steps.finished(out, ModelRunnerOutput(["a"], {"a": 0}, [[1, 2, 3]]))  # < 1 s: not written
    assert state_file.read_state()["steps_at_k"] == {}
    steps.idle()
    assert state_file.read_state()["steps_at_k"] == {"2": 1}


def test_measuring_engines_keep_their_k_when_the_operator_exported_the_switch():
    """tune, doctor and bench start engines of a given k: an exported VLLM_MTP_ADAPTIVE_K=1
    does not reach them (a caller's explicit env can still ask for it)."""
    from vllm_mtp_plugin.tools.bench.serve_mode import server_env
    from vllm_mtp_plugin.tools.engine.offline import child_env

    exported = {"VLLM_MTP_ADAPTIVE_K": "1", "VLLM_MTP_ADAPTIVE_K_STATE": "/tmp/x", "PATH": "/bin"}
    env = child_env("plugin", exported)
    assert "VLLM_MTP_ADAPTIVE_K" not in env and "VLLM_MTP_ADAPTIVE_K_STATE" not in env
    assert env["PATH"] == "/bin"
    assert server_env("plugin")["VLLM_MTP_ADAPTIVE_K"] == "0"


def test_every_k_is_choosable_unless_v2_captures_graphs_per_k():
    """With one sequence at a time vLLM's dense lookup names k = 0 only; the V1 runner and any
    runner without CUDA graphs (every CPU) still run any k, so the controller gets them all.
    Model Runner V2 with CUDA graphs captures a decode graph per k of that lookup only."""
    import types

    table = patch.schedule_table(3)
    one_seq = build_dynamic_sd_schedule_lookup(table, 1, 3)
    assert one_seq[1:] == [0]

    def config(v2, mode):
        return types.SimpleNamespace(use_v2_model_runner=v2, compilation_config=types.SimpleNamespace(
            cudagraph_mode=None if mode is None else types.SimpleNamespace(name=mode)))

    assert patch.choosable_ks(config(False, "FULL_AND_PIECEWISE"), one_seq, 3) == (0, 1, 2, 3)
    assert patch.choosable_ks(config(True, "NONE"), one_seq, 3) == (0, 1, 2, 3)
    assert patch.choosable_ks(config(True, None), one_seq, 3) == (0, 1, 2, 3)
    assert patch.choosable_ks(config(True, "FULL_AND_PIECEWISE"), one_seq, 3) == (0,)
    two_seqs = build_dynamic_sd_schedule_lookup(table, 2, 3)
    assert patch.choosable_ks(config(True, "FULL"), two_seqs, 3) == (0, 1)


class _Executor:
    def __init__(self):
        self.fetches = 0

    def take_draft_token_ids(self):
        self.fetches += 1
        return None


@pytest.mark.parametrize("drafted_k, batch_queue, fetched", [
    (0, None, 0),     # k = 0: nothing to fetch, no round trip to the workers
    (2, None, 1),     # drafts to fetch
    (None, None, 1),  # a scheduler the patch did not reach: vLLM's behaviour
    (0, [], 1),       # a batch queue: the step fetched for is not the one last scheduled
])
def test_a_step_at_k0_skips_vllms_fetch_of_its_drafts(drafted_k, batch_queue, fetched):
    """vLLM's own ``EngineCore.post_step`` behind the patch's wrapper, on a stand-in engine."""
    import types

    from vllm.v1.engine import core

    patch._patch_engine_core(core)  # as in a process where vLLM imported its engine core
    assert core.EngineCore.post_step is patch.post_step_without_empty_fetch
    scheduler = types.SimpleNamespace(update_draft_token_ids=lambda drafts: None)
    if drafted_k is not None:
        setattr(scheduler, patch.DRAFTED_K, drafted_k)
    executor = _Executor()
    engine = types.SimpleNamespace(check_for_draft_tokens=True, async_scheduling=False,
                                   batch_queue=batch_queue, model_executor=executor,
                                   scheduler=scheduler)
    core.EngineCore.post_step(engine, True)
    assert executor.fetches == fetched


@pytest.mark.parametrize("method, noted", [("mtp", 0), ("draft_model", None)])
def test_the_scheduler_notes_the_k_it_asked_for_mtp(method, noted):
    """Only MTP's: a custom drafter may return drafts whatever k the step asked for."""
    import types

    output = types.SimpleNamespace(num_spec_tokens_to_schedule=0)
    config = types.SimpleNamespace(speculative_config=types.SimpleNamespace(method=method))
    scheduler = types.SimpleNamespace(_mtp_adaptive_steps=None, vllm_config=config)
    patch._vllm_schedule, saved = (lambda self: output), patch._vllm_schedule
    try:
        assert patch.schedule_timed(scheduler) is output
    finally:
        patch._vllm_schedule = saved
    assert getattr(scheduler, patch.DRAFTED_K, None) == noted
