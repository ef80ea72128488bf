"""Adaptive k's ``/metrics``: the engine core's state file, read by the API server's collector."""

import json

from prometheus_client import CollectorRegistry, generate_latest

from vllm_mtp_plugin.adaptive_k import state_file
from vllm_mtp_plugin.adaptive_k.controller import AdaptiveK, ControllerSettings, StepOutcome
from vllm_mtp_plugin.adaptive_k.metrics import AdaptiveKCollector
from vllm_mtp_plugin.tools.engine.metrics import parse_prometheus


def test_state_goes_from_the_engine_core_to_the_metrics_page(monkeypatch, tmp_path):
    monkeypatch.delenv(state_file.STATE_ENV, raising=False)
    assert state_file.read_state() is None
    state_file.write_state({"x": 1})  # no file named: nothing written, nothing raised
    monkeypatch.setenv(state_file.STATE_ENV, str(tmp_path / "state.json"))
    controller = AdaptiveK(ControllerSettings(2))
    for _ in range(20):
        k = controller.choose(3)
        controller.observe(StepOutcome(3, k, k, False, 0.01 * (1 + k), ((k, k),) if k else ()))
    state_file.write_state(controller.summary())
    assert json.loads((tmp_path / "state.json").read_text()) == json.loads(
        json.dumps(controller.summary()))
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no partial file left

    registry = CollectorRegistry()
    registry.register(AdaptiveKCollector())
    samples = parse_prometheus(generate_latest(registry).decode())
    steps = {dict(labels)["k"]: v for (name, labels), v in samples.items()
             if name == "vllm_mtp:adaptive_k_steps_total"}
    assert steps == {str(k): float(n) for k, n in controller.steps_at_k.items()}
    assert samples[("vllm_mtp:adaptive_k_chosen", (("batch_bucket", "4"),))] == \
        controller.buckets[4].k
    assert samples[("vllm_mtp:adaptive_k_step_seconds",
                    (("batch_bucket", "4"), ("k", "1")))] == controller.costs.median(4, 1)
    assert samples[("vllm_mtp:adaptive_k_acceptance", (("position", "1"),))] == round(
        controller.acceptance.rates()[0], 3)


def test_a_state_file_per_process_removed_at_exit(monkeypatch):
    monkeypatch.delenv(state_file.STATE_ENV, raising=False)
    path = state_file.name_state_file()
    assert str(path) == __import__("os").environ[state_file.STATE_ENV]
    assert state_file.name_state_file() == path  # named once
    assert path.parent.is_dir() and path.name == "state.json"
