"""A step that verifies no draft samples its tokens with vLLM's sampler alone (patch
``sample_steps_without_drafts``, documented on the function that applies it)."""

from __future__ import annotations

from .framework import NotFound, Patch, logger, missing_in
from .import_hooks import after_import

NAME = "sample_steps_without_drafts"
MODULE = "vllm.v1.sample.rejection_sampler"
# What vLLM's RejectionSampler.forward must still do for the shortcut to equal it (its source).
FORWARD_READS = ("bonus_sampler_output = self.sampler(", "predict_bonus_token=True",
                 "rejection_sample(", "if sampling_metadata.max_num_logprobs is not None:")
FORWARD_PARAMETERS = ("metadata", "draft_probs", "logits", "sampling_metadata")
UNPATCHED = ("Steps that verify no draft (prefills, k = 0 steps) go through vLLM's whole "
             "rejection sampler, as vLLM does: work that changes no token.")


def probe() -> str | None:
    """Needed wherever vLLM's V1 rejection sampler runs; its shape is checked when vLLM imports
    it (``_install``)."""
    return None


def sample_steps_without_drafts() -> None:
    """Sample a step that verifies no draft token with vLLM's sampler alone (V1 runner).

    What it changes: vLLM's V1 runner hands every step of a speculative engine to its rejection
    sampler (``v1/worker/gpu_model_runner.py`` ``_sample``), also a step in which no request has a
    draft: a prefill, or a k = 0 step of adaptive k or of a per-batch-size table. There
    ``RejectionSampler.forward`` (``v1/sample/rejection_sampler.py``) samples the bonus tokens
    with the sampler (``predict_bonus_token=True``), then processes zero target rows, runs the
    rejection kernels over them and copies the bonus tokens into a ``[batch, 1]`` output. Here
    such a step (``max_spec_len == 0``) returns the sampler's own output for the bonus rows,
    which is that ``[batch, 1]`` tensor: the same tokens, and seeded requests' generators left
    where vLLM leaves them (it draws nothing from them for a request without drafts). The one
    lasting effect of the skipped work: in a batch that is not all greedy, vLLM draws
    recovered-token noise (batch x vocab) from the global generator and discards it; without
    those draws an unseeded request's later tokens are other draws of the same distribution.
    Left to vLLM: steps with drafts, logprob requests (``max_num_logprobs``: vLLM assembles them
    there; ``logprob_token_ids``, which its forward drops), vLLM's synthetic acceptance mode.
    Model Runner V2 has its own rejection sampler and already samples such steps with its sampler
    alone. What it saves per step was not told apart from noise in by-hand runs of adaptive k on
    the trained tiny model at one request. How to see it:
    ``tests/unit/plugin/test_sample_steps_without_drafts.py`` compares it with vLLM's forward;
    every engine test with speculation runs through it. When it can go: when vLLM's V1 runner
    skips the rejection sampler for steps without drafts.
    """
    after_import(MODULE, _install)


def _install(module) -> None:
    sampler = getattr(module, "RejectionSampler", None)
    forward = getattr(sampler, "forward", None)
    missing = missing_in(forward, FORWARD_READS, FORWARD_PARAMETERS)
    if forward is None or missing or getattr(module, "SamplerOutput", None) is None:
        logger.warning("vllm-mtp-plugin: %s not applied: %s. %s", NAME, NotFound(
            f"{MODULE}.RejectionSampler.forward reading {missing or 'it'}"), UNPATCHED)
        return
    if getattr(forward, "patch", None) != NAME:
        sampler.forward = _without_drafts(forward, module.SamplerOutput)


def _without_drafts(forward, sampler_output):
    def forward_sampling_steps_without_drafts(self, metadata, draft_probs, logits,
                                              sampling_metadata):
        if (metadata.max_spec_len != 0 or sampling_metadata.max_num_logprobs is not None
                or sampling_metadata.logprob_token_ids
                or getattr(self, "synthetic_mode", False)):
            return forward(self, metadata, draft_probs, logits, sampling_metadata)
        bonus = self.sampler(logits=logits[metadata.bonus_logits_indices],
                             sampling_metadata=sampling_metadata, predict_bonus_token=True)
        return sampler_output(sampled_token_ids=bonus.sampled_token_ids, logprobs_tensors=None)

    forward_sampling_steps_without_drafts.__wrapped__ = forward
    forward_sampling_steps_without_drafts.patch = NAME
    return forward_sampling_steps_without_drafts


PATCH = Patch(NAME, probe, sample_steps_without_drafts, UNPATCHED)
