"""``plain_inputs_without_drafts``: which steps vLLM's V1 runner prepares as without
speculation, the speculative config hidden from that one call only and restored (also when it
raises), models with Mamba-type state left to vLLM, and the warning when vLLM's ``_prepare_inputs``
changes shape. In the engine: adaptive k's V1 test counts such steps and checks the tokens
(``tests/engine/adaptive_k/test_adaptive_k.py``); every speculative engine test runs through it."""

import types

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec  # noqa: E402
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

from vllm_mtp_plugin.patches import plain_inputs_without_drafts as patch  # noqa: E402

VLLM_PREPARE = getattr(GPUModelRunner._prepare_inputs, "__wrapped__",
                       GPUModelRunner._prepare_inputs)


def output(**drafts):
    return types.SimpleNamespace(scheduled_spec_decode_tokens=drafts)


def test_a_step_verifies_no_draft_when_every_request_has_none():
    assert patch.verifies_no_draft(output())
    assert patch.verifies_no_draft(output(a=[], b=[]))
    assert not patch.verifies_no_draft(output(a=[], b=[7]))
    assert not patch.verifies_no_draft(output(a=[-1, -1]))  # async placeholders count


def groups(*specs):
    return types.SimpleNamespace(kv_cache_groups=[types.SimpleNamespace(kv_cache_spec=s)
                                                  for s in specs])


def test_mamba_state_is_found_in_the_runners_kv_cache_groups():
    attention = object.__new__(FullAttentionSpec)
    mamba = object.__new__(MambaSpec)
    assert not patch.has_mamba_state(types.SimpleNamespace(kv_cache_config=groups(attention)))
    assert patch.has_mamba_state(types.SimpleNamespace(kv_cache_config=groups(attention, mamba)))
    # no KV-cache config yet (a profiling run before allocation): left to vLLM, and asked again
    runner = types.SimpleNamespace()
    assert patch.has_mamba_state(runner)
    runner.kv_cache_config = groups(attention)
    assert not patch.has_mamba_state(runner)


class Runner:
    """What the wrapper reads of vLLM's runner; ``prepare`` records the config it saw."""

    def __init__(self, spec_groups=None):
        self.speculative_config = "spec"
        self.kv_cache_config = groups(*(spec_groups or [object.__new__(FullAttentionSpec)]))
        self.seen = []


def prepare(runner, scheduler_output, num_scheduled_tokens):
    runner.seen.append(runner.speculative_config)
    if num_scheduled_tokens == "raise":
        raise RuntimeError("vLLM failed")
    return ("logits_indices", None if runner.speculative_config is None else "metadata", 1)


def test_steps_without_drafts_see_no_speculation_and_the_config_comes_back():
    wrapped = patch._plain_without_drafts(prepare)
    runner = Runner()
    assert wrapped(runner, output(a=[]), [1])[1] is None
    assert wrapped(runner, output(a=[3, 4]), [3])[1] == "metadata"
    assert runner.seen == [None, "spec"] and runner.speculative_config == "spec"
    assert getattr(runner, patch.PLAIN_STEPS) == 1
    with pytest.raises(RuntimeError, match="vLLM failed"):
        wrapped(runner, output(), "raise")
    assert runner.speculative_config == "spec"
    mamba = Runner([object.__new__(MambaSpec)])
    assert wrapped(mamba, output(), [1])[1] == "metadata"
    assert mamba.seen == ["spec"] and not hasattr(mamba, patch.PLAIN_STEPS)


def test_vllms_prepare_inputs_reads_the_config_once():
    """What the patch relies on, read in the installed vLLM: one read of the speculative config
    in ``_prepare_inputs``, and no read in the runner methods it calls."""
    import inspect

    assert patch.missing_in(VLLM_PREPARE, patch.PREPARE_READS, patch.PREPARE_PARAMETERS) == []
    assert patch._reads_of_config(VLLM_PREPARE) == 1
    source = inspect.getsource(VLLM_PREPARE)
    called = {name for name in dir(GPUModelRunner) if f"self.{name}(" in source}
    assert "_calc_spec_decode_metadata" in called and "_prepare_input_ids" in called
    for name in called:
        method = getattr(GPUModelRunner, name)
        if callable(method) and name != "_calc_spec_decode_metadata":
            assert patch.READ not in inspect.getsource(method), name


def test_the_patch_installs_once_and_refuses_a_prepare_of_another_shape(monkeypatch):
    warnings = []
    monkeypatch.setattr(patch.logger, "warning", lambda *args: warnings.append(args[0] % args[1:]))

    class Other:
        def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
            return self.speculative_config, self.speculative_config

    module = types.SimpleNamespace(GPUModelRunner=Other)
    patch._install(module)
    assert Other._prepare_inputs.__name__ == "_prepare_inputs"
    assert len(warnings) == 1 and "plain_inputs_without_drafts not applied" in warnings[0]
    runner = type("R", (GPUModelRunner,), {"_prepare_inputs": VLLM_PREPARE})
    module = types.SimpleNamespace(GPUModelRunner=runner)
    patch._install(module)
    installed = runner._prepare_inputs
    assert installed.patch == patch.NAME and installed.__wrapped__ is VLLM_PREPARE
    patch._install(module)
    assert runner._prepare_inputs is installed and len(warnings) == 1
