"""Refuse a DeepSeek checkpoint whose MTP part disagrees with its config.json before any engine
starts (patch ``check_mtp_checkpoint``, documented on the function that applies it).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from .framework import NotFound, Patch, logger

# The targets vLLM drafts for with DeepSeek MTP layers (``hf_config_override``).
DEEPSEEK_MTP_MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "deepseek_v4")
_vllm_hf_config_override: Callable | None = None


def _speculative_config():
    from vllm.config.speculative import SpeculativeConfig

    return SpeculativeConfig


def _current_hf_config_override() -> Callable:
    """The plain function behind ``SpeculativeConfig.hf_config_override`` as this process has it."""
    current = inspect.getattr_static(_speculative_config(), "hf_config_override")
    return current.__func__ if isinstance(current, staticmethod) else current


def hf_config_override(hf_config, *args, **kwargs):
    """vLLM's ``SpeculativeConfig.hf_config_override`` after a check for declared MTP layers.

    Module-level on purpose: vLLM keeps this function as the draft ``ModelConfig``'s
    ``hf_overrides`` and pickles it into spawned engine processes, which can only pickle functions
    by qualified name. Extra arguments (vLLM 0.33 passes ``transformers_mtp_overrides``,
    positionally or by keyword) go to vLLM's function unchanged; when it is given (the
    Transformers modeling backend), vLLM skips its DeepSeek rewrite and so do these checks.
    """
    # In a process that unpickled this function before (or without) register(), vLLM's own
    # function is still the one on the class.
    original = _vllm_hf_config_override or _current_hf_config_override()
    transformers_backend = (args[0] if args else kwargs.get("transformers_mtp_overrides"))
    if transformers_backend:
        return original(hf_config, *args, **kwargs)
    if (hf_config.model_type in DEEPSEEK_MTP_MODEL_TYPES
            and getattr(hf_config, "num_nextn_predict_layers", None) == 0):
        raise ValueError(
            f"{getattr(hf_config, 'name_or_path', '') or 'the checkpoint'}: config.json sets "
            "num_nextn_predict_layers to 0, so the checkpoint has no MTP layer to draft with "
            "(it may have been quantized or exported without them). Use a checkpoint that "
            "keeps its MTP layers, or serve without --speculative-config."
        )
    _preflight(hf_config)
    return original(hf_config, *args, **kwargs)


def _preflight(hf_config) -> None:
    """The checkpoint's MTP part against its config.json, before any engine process starts
    (``weights/preflight.py``). A fault in the check itself is logged and never blocks vLLM."""
    from ..weights.preflight import check_before_engine_start
    from ..weights.loader import CheckpointError

    try:
        check_before_engine_start(hf_config)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - a checker bug must not refuse a valid checkpoint
        logger.warning("vllm-mtp-plugin: start-up check of the MTP layers skipped (%s: %s)",
                       type(exc).__name__, exc)


def probe() -> str | None:
    """Applicable while ``hf_config_override`` is a static function taking the hf_config first;
    needed everywhere (vLLM checks neither the MTP tensors before loading nor ``n_predict = 0``)."""
    current = _current_hf_config_override()
    if current is hf_config_override:
        return "already applied in this process"
    params = list(inspect.signature(current).parameters.values())
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY,
                                              params[0].POSITIONAL_OR_KEYWORD):
        return NotFound(f"SpeculativeConfig.hf_config_override{inspect.signature(current)} is "
                        "not f(hf_config, ...)")
    return None


# What may go wrong without the patch (``Patch.unpatched``).
CHECKPOINT_UNPATCHED = (
    "A checkpoint whose MTP part disagrees with its config.json fails with vLLM's own error "
    "(num_nextn_predict_layers: 0 gives ZeroDivisionError; a missing MTP tensor a KeyError after "
    "the target has loaded) instead of a message naming the tensor; check it with "
    "`vllm-mtp inspect DIR`.")


def check_mtp_checkpoint() -> None:
    """Refuse, with a clear message, a DeepSeek checkpoint whose MTP part disagrees with its
    config.json, before any engine process starts.

    What it fixes: (1) ``SpeculativeConfig`` takes ``n_predict`` from ``num_nextn_predict_layers``;
    when config.json says ``0`` (MTP layers stripped, e.g. by a quantizer), vLLM raises a bare
    ``ZeroDivisionError``. (2) Checkpoints with missing, shifted, partial or surplus MTP layers,
    absent shards, truncated headers or unloadable dtypes fail only after the target has loaded,
    some with a bare ``KeyError`` from the target's loader; ``weights/preflight.py`` finds them from
    the headers first. How to see it: set ``num_nextn_predict_layers`` to 0 in a DeepSeek-V3
    config.json, or delete ``model.layers.61.enorm.weight``, and serve it with
    ``--speculative-config '{"method": "mtp", "num_speculative_tokens": 2}'``. When it can go:
    when vLLM validates ``n_predict`` and the MTP tensors before loading. Where: vLLM calls
    ``hf_config_override`` when it builds the draft model's config (front-end process).
    """
    global _vllm_hf_config_override
    current = _current_hf_config_override()
    if current is hf_config_override:
        return
    _vllm_hf_config_override = current
    _speculative_config().hf_config_override = staticmethod(hf_config_override)


PATCH = Patch("check_mtp_checkpoint", probe,
              check_mtp_checkpoint, CHECKPOINT_UNPATCHED)
