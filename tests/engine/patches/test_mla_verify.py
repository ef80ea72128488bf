"""``mla_verify_as_decode``: speculative verification through vLLM's CPU MLA decode kernel.

The kernel's rows and attention on their own: ``tests/unit/plugin/test_mla_verify_kernel.py``. Here:
fp32 ``CPU_MLA`` engines, compiled as vLLM does by default, with the patch and without it
(``VLLM_MTP_MLA_VERIFY=0``): greedy tokens equal each other and the non-speculative run; on two
MTP layers vLLM's own class (``MTP_PLUGIN=off``) gives the plugin's tokens and counters.
"""

import functools

import pytest

from support.checkpoint_edits import same_target
from support.hardware import needs_cpu
from vllm_mtp_plugin.tools.engine.offline import OfflineConfig, run_config

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

MAX_TOKENS = 40
ANNOUNCED = "mla_verify_as_decode: CPU_MLA verifies up to {} query tokens per request"


@functools.cache
def _engine(model, k, patched, prompts, tmp, dtype="float32", impl="plugin"):
    """Compiled, two requests at a time: the others wait and start prefilling while the first
    ones verify (mixed batches). fp32 runs CPU_MLA; bf16 runs AMX_MLA where the CPU has AMX."""
    log = f"{tmp}/engine-{abs(hash((model, k, patched, dtype, impl)))}.log"
    result = run_config(OfflineConfig(str(model), k, impl, list(prompts), MAX_TOKENS,
                                      llm_kwargs={"dtype": dtype, "max_num_seqs": 2}),
                        log_path=log, env={"VLLM_MTP_MLA_VERIFY": "1" if patched else "0"})
    assert result["compilation"] != "eager"
    text = open(log).read()
    backend = "AMX_MLA" if dtype == "bfloat16" else "CPU_MLA"
    assert f"Using {backend} backend" in text
    result["announced"] = [k for k in range(1, 5)
                           if ANNOUNCED.replace("CPU_MLA", backend).format(k + 1) in text]
    return result


@pytest.fixture(scope="module")
def engine(prompts, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mla-verify")
    return lambda model, k, patched=True, dtype="float32", impl="plugin": _engine(
        model, k, patched, tuple(prompts), tmp, dtype, impl)


def test_verification_through_the_decode_kernel_keeps_every_token(checkpoints, engine):
    """Greedy tokens equal the non-speculative run at k = 1, 3 (one MTP layer) and k = 2 (two MTP
    layers: the same target, so the same baseline), and the unpatched path at k = 3; contexts span
    several blocks (prompts + 40 tokens over 16-token blocks). Counters of the patched and
    unpatched paths may differ by fp32 summation order only: within one draft (k tokens)."""
    one = checkpoints("noisy", acceptance=0.6)
    two = checkpoints("noisy", acceptance=0.6, num_nextn_predict_layers=2)
    assert same_target(one, two)
    baseline = engine(one, 0)
    assert baseline["announced"] == []  # without speculation nothing changes
    for model, k in ((one, 1), (one, 3), (two, 2)):
        result = engine(model, k)
        assert result["announced"] == [k], k
        assert result["token_ids"] == baseline["token_ids"], k
        assert all(len(ids) == MAX_TOKENS for ids in result["token_ids"])
        assert result["spec_decode"]["num_accepted_tokens"] > 0
    ours, vllms = engine(one, 3), engine(one, 3, patched=False)
    assert vllms["announced"] == []
    assert ours["token_ids"] == vllms["token_ids"]
    a, b = ours["spec_decode"], vllms["spec_decode"]
    assert abs(a["num_drafts"] - b["num_drafts"]) <= 1, (a, b)
    assert abs(a["num_accepted_tokens"] - b["num_accepted_tokens"]) <= 3, (a, b)


def test_two_compiled_mtp_layers_give_vllms_tokens_and_counters(checkpoints, engine):
    """Plugin = in-tree (``MTP_PLUGIN=off``) on two MTP layers, k = 2, V1, vLLM's default
    compilation: the same tokens and every counter. V1 drafts both steps with layer L
    (``test_engine_v3.py`` counts it, eager); compiled, the plugin traces each layer on its own and
    vLLM's class as one module, which must come to the same drafts."""
    two = checkpoints("noisy", acceptance=0.6, num_nextn_predict_layers=2)
    ours, vllms = engine(two, 2), engine(two, 2, impl="in-tree")
    assert ours["drafter"]["class"].startswith("vllm_mtp_plugin.")
    assert vllms["drafter"]["class"].startswith("vllm.model_executor.models.")
    assert ours["runner"] == vllms["runner"] == "v1"
    assert ours["compilation"] == vllms["compilation"] == "DYNAMO_TRACE_ONCE"
    assert vllms["announced"] == ours["announced"] == [2]  # MTP_PLUGIN=off keeps the fixes
    assert ours["token_ids"] == vllms["token_ids"]
    assert ours["spec_decode"] == vllms["spec_decode"]
    assert 0 < ours["spec_decode"]["num_accepted_tokens"] < ours["spec_decode"]["num_draft_tokens"]


@needs_cpu("amx_tile", "amx_bf16", part="vLLM's AMX_MLA backend")
def test_amx_mla_verification_through_its_decode_kernel_keeps_every_token(checkpoints, engine):
    """bf16 engines on AMX_MLA: k = 3 through the decode kernel gives the tokens of k = 0."""
    one = checkpoints("noisy", acceptance=0.6)
    baseline = engine(one, 0, dtype="bfloat16")
    result = engine(one, 3, dtype="bfloat16")
    assert baseline["announced"] == [] and result["announced"] == [3]
    assert result["token_ids"] == baseline["token_ids"]
    assert result["spec_decode"]["num_accepted_tokens"] > 0
