"""Patches to vLLM, each applied by ``register()`` and documented here: what, how to see it, when
it can go."""

from __future__ import annotations

DEEPSEEK_MTP_MODEL_TYPES = ("deepseek_v3", "deepseek_v4")


def check_mtp_layers_declared() -> None:
    """Reject ``method: "mtp"`` on a DeepSeek config that declares no MTP layer, with a clear error.

    What it fixes: ``SpeculativeConfig`` takes ``n_predict`` from ``num_nextn_predict_layers``; when
    a checkpoint's config.json says ``0`` (MTP layers stripped, e.g. by a quantizer),
    ``num_speculative_tokens % n_predict`` raises a bare ``ZeroDivisionError``. How to see it: set
    ``num_nextn_predict_layers`` to 0 in a DeepSeek-V3 config.json and serve it with
    ``--speculative-config '{"method": "mtp", "num_speculative_tokens": 2}'``. When it can go:
    when ``config/speculative.py`` validates ``n_predict`` itself. Idempotent.
    """
    from vllm.config.speculative import SpeculativeConfig

    original = SpeculativeConfig.hf_config_override
    if getattr(original, "_checks_mtp_layers", False):
        return

    def hf_config_override(hf_config):
        if (hf_config.model_type in DEEPSEEK_MTP_MODEL_TYPES
                and getattr(hf_config, "num_nextn_predict_layers", None) == 0):
            raise ValueError(
                f"{getattr(hf_config, 'name_or_path', '') or 'the checkpoint'}: config.json sets "
                "num_nextn_predict_layers to 0, so the checkpoint has no MTP layer to draft with "
                "(it may have been quantized or exported without them). Use a checkpoint that "
                "keeps its MTP layers, or serve without --speculative-config."
            )
        return original(hf_config)

    hf_config_override._checks_mtp_layers = True
    SpeculativeConfig.hf_config_override = staticmethod(hf_config_override)
