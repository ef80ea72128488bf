"""vllm-mtp-plugin: DeepSeek Multi-Token-Prediction drafters for vLLM.

``register()`` is the ``vllm.general_plugins`` entry point. vLLM calls it once in every process it
starts (API server, engine core, workers, short inspection subprocesses), so it only hands the model
registry lazy ``"module:Class"`` strings and applies the small patches in ``patches/`` (to vLLM
modules that are already imported by then): no model code is imported here. Which architectures
it keeps when a platform plugin registers the same names is decided in ``precedence.py``
(``MTP_PLUGIN=auto|on|off``), whatever the order vLLM loads the plugins in.
"""

from __future__ import annotations

from .identity import ARCHITECTURES, VERSION, Registration

__version__ = VERSION
__all__ = ["ARCHITECTURES", "__version__", "register"]


def register() -> None:
    """Point vLLM's MTP architectures at this package where ``precedence`` says so. Idempotent;
    logs once per process.

    Never raises: vLLM calls this for every model in every process, so a failure here is logged as
    a warning and vLLM goes on with its own classes.
    """
    import logging

    logger = logging.getLogger("vllm.vllm_mtp_plugin")
    # Two independent steps: the fixes to vLLM (patches/) apply even when the classes do not.
    try:
        from .patches import apply_register_patches

        apply_register_patches()
    except Exception as exc:  # noqa: BLE001 - a plugin must not take vLLM down
        logger.warning("vllm-mtp-plugin %s: its fixes to vLLM not applied (%s: %s).",
                       __version__, type(exc).__name__, exc)
    try:
        from . import precedence

        outcome = precedence.apply(ARCHITECTURES)
    except Exception as exc:  # noqa: BLE001 - a plugin must not take vLLM down
        logger.warning("vllm-mtp-plugin %s not registered (%s: %s); vLLM's own MTP classes serve.",
                       __version__, type(exc).__name__, exc)
        return
    if not Registration.done:
        Registration.done = True
        served = [arch for arch, how in outcome.items() if how == "ours"]
        logger.info("vllm-mtp-plugin %s serves %s", __version__, ", ".join(served) or "nothing")
