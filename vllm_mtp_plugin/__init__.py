"""vllm-mtp-plugin: DeepSeek Multi-Token-Prediction drafters for vLLM.

``register()`` is the ``vllm.general_plugins`` entry point. vLLM calls it once in every process it
starts (API server, engine core, workers, short inspection subprocesses), so it only hands the model
registry lazy ``"module:Class"`` strings and applies the small patches in ``patches.py`` (to vLLM
modules that are already imported by then): no model code is imported here.
"""

from __future__ import annotations

__version__ = "0.1.0"

# vLLM architecture name -> our implementation. Keeping vLLM's names means
# `--speculative-config '{"method": "mtp"}'` picks these with no other change.
ARCHITECTURES: dict[str, str] = {
    "DeepSeekMTPModel": "vllm_mtp_plugin.models.v3:DeepSeekMTP",
    "DeepSeekV4MTPModel": "vllm_mtp_plugin.models.v4:DeepSeekV4MTP",
}

_registered = False


def register() -> None:
    """Point vLLM's MTP architectures at this package. Idempotent; logs once per process."""
    global _registered
    from vllm import ModelRegistry
    from vllm.logger import init_logger

    from .patches import apply_register_patches

    for arch, target in ARCHITECTURES.items():
        ModelRegistry.register_model(arch, target)
    apply_register_patches()
    if not _registered:
        _registered = True
        init_logger("vllm.vllm_mtp_plugin").info("vllm-mtp-plugin %s serves %s", __version__, ", ".join(ARCHITECTURES))
