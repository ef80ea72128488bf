"""The real vLLM engine (CPU build) with our drafter and with vLLM's in-tree one, greedy.

Each configuration runs in its own process (``offline.run_config``): vLLM loads plugins once per
process, and ``VLLM_PLUGINS=""`` is how a user gets the in-tree class back.
"""

import functools

import pytest

from vllm_mtp_plugin.tools.offline import OfflineConfig, run_config

OURS = "vllm_mtp_plugin.models.v3:DeepSeekMTP"
IN_TREE = "vllm.model_executor.models.deepseek_mtp:DeepSeekMTP"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def run(prompts):
    @functools.cache
    def cached(model, k=0, impl="plugin"):
        return run_config(OfflineConfig(str(model), k, impl, prompts, MAX_TOKENS))

    return cached


def assert_counters_consistent(result, k, prompts):
    spec = result["spec_decode"]
    assert spec["num_drafts"] > 0
    assert spec["num_draft_tokens"] == k * spec["num_drafts"]
    assert len(spec["accepted_per_position"]) == k
    assert sum(spec["accepted_per_position"]) == spec["num_accepted_tokens"]
    assert all(len(ids) == MAX_TOKENS for ids in result["token_ids"])


def test_plugin_class_runs_and_in_tree_class_comes_back_with_vllm_plugins_empty(checkpoints, run):
    noisy = checkpoints("noisy", acceptance=0.6)
    assert run(noisy, 2, "plugin")["drafter"]["class"] == OURS
    assert run(noisy, 2, "in-tree")["drafter"]["class"] == IN_TREE


@pytest.mark.parametrize("k", [1, 2, 3])
def test_oracle_drafts_are_all_accepted_and_output_is_unchanged(checkpoints, run, prompts, k):
    oracle = checkpoints("oracle")
    baseline = run(oracle, 0)
    result = run(oracle, k)
    assert result["token_ids"] == baseline["token_ids"]
    assert_counters_consistent(result, k, prompts)
    spec = result["spec_decode"]
    assert spec["num_accepted_tokens"] == spec["num_draft_tokens"]
    assert spec["accepted_per_position"] == [spec["num_drafts"]] * k
    assert spec["mean_acceptance_length"] == k + 1


@pytest.mark.parametrize("mode, kwargs", [("random", {}), ("noisy", {"acceptance": 0.6})])
def test_same_tokens_and_counters_as_in_tree(checkpoints, run, prompts, mode, kwargs):
    model = checkpoints(mode, **kwargs)
    ours, theirs = run(model, 2, "plugin"), run(model, 2, "in-tree")
    assert ours["token_ids"] == theirs["token_ids"]
    assert ours["spec_decode"] == theirs["spec_decode"]
    assert_counters_consistent(ours, 2, prompts)
    if mode == "noisy":  # built to be right 60 % of the time at the first position
        assert 0.3 < ours["spec_decode"]["per_position_acceptance"][0] < 0.9
        assert ours["spec_decode"]["num_accepted_tokens"] < ours["spec_decode"]["num_draft_tokens"]


def test_draft_allocates_no_vocab_sized_matrices(checkpoints, run):
    """The in-tree class allocates embed_tokens and shared_head.head (vocab x hidden each, bf16 on
    this CPU) and vLLM drops them after loading; ours never allocates them."""
    noisy = checkpoints("noisy", acceptance=0.6)
    ours = run(noisy, 2, "plugin")["drafter"]["allocated_bytes"]
    theirs = run(noisy, 2, "in-tree")["drafter"]["allocated_bytes"]
    vocab, hidden = 2048, 256
    assert theirs - ours == 2 * vocab * hidden * 2


def test_two_mtp_layers(checkpoints, run, prompts):
    oracle2 = checkpoints("oracle", num_nextn_predict_layers=2)
    result = run(oracle2, 2)
    assert result["token_ids"] == run(oracle2, 0)["token_ids"]
    assert result["spec_decode"]["num_accepted_tokens"] == result["spec_decode"]["num_draft_tokens"]
    noisy2 = checkpoints("noisy", acceptance=0.6, num_nextn_predict_layers=2)
    ours, theirs = run(noisy2, 2, "plugin"), run(noisy2, 2, "in-tree")
    assert ours["token_ids"] == theirs["token_ids"]
    assert ours["spec_decode"] == theirs["spec_decode"]
