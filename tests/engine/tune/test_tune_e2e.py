"""``vllm-mtp tune`` end to end on a tiny checkpoint: real engines (vLLM's default compilation), a
tune.json that vLLM's validator accepts, measurements that add up, the printed configuration."""

import json

import pytest

from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

from vllm_mtp_plugin.tools.cli import main
from vllm_mtp_plugin.tools.tune.cli import BUSY_RATIO

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

MAX_TOKENS = 10


def test_tune_measures_every_k_and_concurrency_and_writes_vllms_schedule(checkpoints, tmp_path,
                                                                          capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (
        "def parse(path):", "The weather today is", "Django models define")))
    out = tmp_path / "tune.json"
    # fp32, 2 sequences, 1024 tokens: test_mla_verify's engine settings, so the two files' compiled
    # engines on this checkpoint share vLLM's compile cache
    code = main(["tune", str(checkpoints("noisy", acceptance=0.6)), "--prompts", str(prompts),
                 "--concurrency", "1", "2", "--max-k", "1", "--max-tokens", str(MAX_TOKENS),
                 "--out", str(out), "--dtype", "float32", "--max-model-len", "1024",
                 "--remeasure", "0"])
    data = json.loads(out.read_text())
    printed = capsys.readouterr().out
    # The suite's other worker shares the machine: tune may find its steps disturbed; then it
    # must say so and recommend nothing (exit 3), else recommend from plausible figures (exit 0).
    found = data["plausibility"]["problems"]
    assert data["plausibility"]["measurements"] == 1
    assert code == (3 if found else 0), (code, found)
    assert all(line in printed for line in found)
    assert list(data)[0] == "num_speculative_tokens_per_batch_size"
    ranges = data["num_speculative_tokens_per_batch_size"]
    assert ranges is None if found else (
        validate_and_normalize_dynamic_sd_schedule(ranges) == [tuple(r) for r in ranges])
    assert data["compilation"] == ["DYNAMO_TRACE_ONCE"]
    assert data["settings"]["engine_args"] == {"dtype": "float32", "max_model_len": 1024}
    points = {(p["k"], p["concurrency"]): p for p in data["measurements"]}
    assert sorted(points) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    for (k, c), p in points.items():
        assert p["tokens_per_step"] == c * (k + 1), (k, c)
        assert p["step_ms"] > 0 and p["measured_tok_s"] > 0 and p["decode_steps"] > 0
        assert p["prefill_ms"] > 0 and p["outside_ms"] >= 0
        # units: the expectation's formula, fed the pass's mean decode step instead of its median,
        # gives back the pass's measured tokens/s (apart from how many drafts that pass accepted),
        # however busy the machine was (the median alone would not: other work shares the CPUs)
        assert p["mean_step_ms"] > 0
        tau = data["acceptance"]["acceptance_lengths"][k]
        decode_s = (MAX_TOKENS - 1) / tau * (p["mean_step_ms"] + p["outside_ms"]) / 1e3
        ratio = c * MAX_TOKENS / (p["prefill_ms"] / 1e3 + decode_s) / p["measured_tok_s"]
        assert 1 / 1.5 < ratio < 1.5, (k, c, ratio)
    (rate,) = data["acceptance"]["per_position"]
    counters = data["acceptance"]["counters_at_max_k"]
    assert 0 < rate < 1
    assert rate == pytest.approx(counters["accepted_per_position"][0] / counters["num_drafts"])
    assert sorted(data["best_fixed_k"]) == ["1", "2"]
    busy = any(p["mean_step_ms"] > BUSY_RATIO * p["step_ms"] for p in data["measurements"])
    assert busy == any("other work shared the machine" in line for line in found)
    assert "machine: " in printed
    if found:
        assert data["speculative_config"] is None and "no recommendation" in printed
        return
    assert "expected tokens/s" in printed
    spec = data["speculative_config"]
    assert (f"--speculative-config '{json.dumps(spec)}'" in printed if spec else
            "serve without --speculative-config" in printed)
    assert out.with_suffix(".png").stat().st_size > 0
