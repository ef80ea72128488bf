"""A step in which no request verifies a draft is prepared as in an engine without speculation
(patch ``plain_inputs_without_drafts``, documented on the function that applies it)."""

from __future__ import annotations

from .framework import NotFound, Patch, logger, missing_in
from .import_hooks import after_import

NAME = "plain_inputs_without_drafts"
MODULE = "vllm.v1.worker.gpu_model_runner"
# What vLLM's _prepare_inputs must still do for the patch to be exact (read in its source): its one
# read of the speculative config picks between the two ways of preparing a step.
PREPARE_READS = ("use_spec_decode = self.speculative_config is not None",
                 "spec_decode_metadata = None", "self._calc_spec_decode_metadata(",
                 "scheduled_spec_decode_tokens")
PREPARE_PARAMETERS = ("scheduler_output",)
READ = "self.speculative_config"
PLAIN_STEPS = "_mtp_plain_steps"  # the runner's count of steps prepared without speculation
UNPATCHED = ("Steps that verify no draft (prefills, k = 0 steps of adaptive k or of a "
             "per-batch-size table) build spec-decode metadata and go through the rejection "
             "sampler, as vLLM does: work that changes no token.")


def probe() -> str | None:
    """Needed wherever vLLM's V1 runner runs; its shape is checked when vLLM imports it
    (``_install``)."""
    return None


def plain_inputs_without_drafts() -> None:
    """Prepare a step that verifies no draft as vLLM prepares a step without speculation (V1).

    What it changes: vLLM's V1 runner (``v1/worker/gpu_model_runner.py`` ``_prepare_inputs``,
    ~2184-2231) builds spec-decode metadata for every step of a speculative engine
    (``_calc_spec_decode_metadata``: index arrays copied to the device, a gather of draft
    tokens), also for a step in which no request has a draft: a prefill, a k = 0 step of adaptive
    k or of a per-batch-size table. That metadata then sends the step through the rejection
    sampler (``_sample``). Here such a step (every request's scheduled drafts empty) is prepared
    by vLLM's own branch for engines without speculation: ``logits_indices`` the last token of
    each request, which is what zero drafts give, no metadata, so ``_sample`` calls the sampler
    and ``propose_draft_token_ids`` takes its no-metadata branch (target tokens and hidden states
    of the step as they are: again what zero drafts give). It does so by hiding the speculative
    config from that one read (the only one in ``_prepare_inputs`` and what it calls, checked
    in its source when vLLM imports it). Not for models with Mamba-type state (GDN, Mamba2,
    short convolutions): their attention backends read the per-request draft counts only the
    speculative branch fills. How to see it: the adaptive-k engine test counts the steps
    prepared this way (``tests/engine/adaptive_k/test_adaptive_k.py``) and checks the tokens
    against the target's; the unit test checks which steps qualify and the warning when vLLM
    changes shape (``tests/unit/plugin/test_plain_inputs_without_drafts.py``). When it can go:
    when vLLM prepares steps without drafts without spec-decode metadata.
    """
    after_import(MODULE, _install)


def _install(module) -> None:
    runner = getattr(module, "GPUModelRunner", None)
    prepare = getattr(runner, "_prepare_inputs", None)
    missing = (["GPUModelRunner._prepare_inputs"] if prepare is None
               else missing_in(prepare, PREPARE_READS, PREPARE_PARAMETERS))
    if prepare is not None and not missing and _reads_of_config(prepare) != 1:
        missing = [f"exactly one {READ} (found {_reads_of_config(prepare)})"]
    if missing:
        logger.warning("vllm-mtp-plugin: %s not applied: %s. %s", NAME, NotFound(
            f"{MODULE}.GPUModelRunner._prepare_inputs reading {missing}"), UNPATCHED)
        return
    if getattr(prepare, "patch", None) != NAME:
        runner._prepare_inputs = _plain_without_drafts(prepare)


def _reads_of_config(function) -> int:
    import inspect

    return inspect.getsource(function).count(READ)


def verifies_no_draft(scheduler_output) -> bool:
    """No request of the step has a draft to verify (vLLM's scheduler lists drafts per request;
    under async scheduling placeholders stand for drafts still on the device, and count)."""
    return not any(scheduler_output.scheduled_spec_decode_tokens.values())


def has_mamba_state(runner) -> bool:
    """Whether a KV-cache group of the runner holds Mamba-type state (whose backends read the
    draft counts of the speculative branch); decided once per runner."""
    known = getattr(runner, "_mtp_has_mamba_state", None)
    if known is None:
        from vllm.v1.kv_cache_interface import MambaSpec

        groups = getattr(getattr(runner, "kv_cache_config", None), "kv_cache_groups", None)
        if groups is None:  # before the KV cache exists (profiling runs): vLLM's way, asked again
            return True
        known = any(isinstance(g.kv_cache_spec, MambaSpec) for g in groups)
        runner._mtp_has_mamba_state = known
    return known


def _plain_without_drafts(prepare):
    def prepare_inputs_plain_without_drafts(self, scheduler_output, *args, **kwargs):
        config = self.speculative_config
        if (config is None or not verifies_no_draft(scheduler_output)
                or has_mamba_state(self)):
            return prepare(self, scheduler_output, *args, **kwargs)
        self.speculative_config = None
        try:
            prepared = prepare(self, scheduler_output, *args, **kwargs)
        finally:
            self.speculative_config = config
        setattr(self, PLAIN_STEPS, getattr(self, PLAIN_STEPS, 0) + 1)
        return prepared

    prepare_inputs_plain_without_drafts.__wrapped__ = prepare
    prepare_inputs_plain_without_drafts.patch = NAME
    return prepare_inputs_plain_without_drafts


PATCH = Patch(NAME, probe, plain_inputs_without_drafts, UNPATCHED)
