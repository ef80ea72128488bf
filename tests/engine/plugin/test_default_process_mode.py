"""vLLM's default process mode, as a plain `LLM(...)` script runs it: the engine core is spawned
and the whole config, the draft model's ``hf_overrides`` included, is pickled into it.

The rest of the suite uses the faster in-process engine; these runs prove the shortcut hides nothing.
The plugin's drafter against vLLM's in this mode (tokens, every counter, lossless) is checked on
the engines of ``vllm-mtp doctor``'s self-test (``tests/engine/doctor/test_doctor_selftest.py``),
which runs in it; the drafter's start-up line through ``vllm-mtp serve`` (``test_server.py``).
"""

import functools

import pytest

from vllm_mtp_plugin.tools.engine.offline import OfflineConfig, run_config

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

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
