"""The schedule ``vllm-mtp tune`` writes, passed to vLLM, changes the draft tokens per step with the
batch size: counted by vLLM's counters, on Model Runner V2 (the test harness) and on V1, compiled.

Schedule: one request in flight drafts 2 tokens, two draft 1, three or more draft none (k = 0 in
a schedule: speculation off at that batch size). The oracle checkpoint and ``ignore_eos`` keep the
requests of a pass in step, so every decode step of a pass has the pass's batch size.
"""

import pytest

from vllm_mtp_plugin.tools.engine.offline import OfflineConfig, run_config
from vllm_mtp_plugin.tools.throughput.prediction import schedule, speculative_config

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

SCHEDULE = schedule({1: 2, 2: 1, 3: 0})


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_schedule_sets_draft_tokens_per_batch_size(checkpoints, prompts, runner):
    assert SCHEDULE == [[1, 1, 2], [2, 2, 1], [3, 3, 0]]
    spec = speculative_config(SCHEDULE)
    passes = [{"label": {"batch": n}, "prompts": prompts[:n], "sampling": {}} for n in (1, 2, 3)]
    result = run_config(OfflineConfig(
        model=str(checkpoints("oracle")), num_speculative_tokens=spec["num_speculative_tokens"],
        speculative_overrides={"num_speculative_tokens_per_batch_size": SCHEDULE},
        passes=passes, prompts=prompts[:1], max_tokens=9, runner=runner,
        llm_kwargs={"dtype": "float32", "max_num_seqs": 4}), timeout=1200)
    assert result["runner"] == runner and result["compilation"] == "DYNAMO_TRACE_ONCE"
    counters = {run["pass"]["batch"]: run["spec_decode"] for run in result["runs"]}
    one, two, three = counters[1], counters[2], counters[3]
    assert one["num_drafts"] > 0 and one["num_draft_tokens"] == 2 * one["num_drafts"]
    assert two["num_drafts"] > 0 and two["num_draft_tokens"] == 1 * two["num_drafts"]
    assert three["num_drafts"] == three["num_draft_tokens"] == 0
    assert one["acceptance_rate"] == two["acceptance_rate"] == 1.0  # the oracle's drafts
    assert all(len(ids) == 9 for ids in result["token_ids"])
