"""Everything that differs between platforms (CUDA, CPU, Ascend NPU) and between vLLM versions.

Probes ask vLLM what it has instead of comparing version strings; nothing else in the package looks
at the platform or the vLLM version.
"""

from __future__ import annotations

import functools


PROJECTIONS = ("gate_proj", "down_proj", "up_proj")


@functools.cache
def fused_moe_expert_params() -> dict[str, str]:
    """Fused-MoE parameter prefixes by checkpoint projection, as this vLLM names them.

    vLLM 0.32 keeps routed experts under ``experts.routed_experts.w13_``/``w2_``; older releases
    used ``experts.w13_``. The answer comes from vLLM's own mapping helper, called by keyword and
    read by projection name wherever it sits in the weight name; an answer without all three
    projections is refused with what was found (the drafter's experts could not be loaded).
    """
    from torch import nn
    from vllm.model_executor.layers.fused_moe.layer import fused_moe_make_expert_params_mapping

    mapping = fused_moe_make_expert_params_mapping(
        model=nn.Module(), ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj",
        ckpt_up_proj_name="up_proj", num_experts=1)
    found = {}
    for entry in mapping:
        param, weight_name = entry[0], entry[1]
        names = [part for part in str(weight_name).split(".") if part in PROJECTIONS]
        if names:
            found[names[0]] = param
    if set(found) != set(PROJECTIONS):
        raise RuntimeError(
            "vllm-mtp-plugin: vLLM's fused_moe_make_expert_params_mapping no longer names the "
            f"expert projections as expected (found {found or mapping!r}); the MTP drafter cannot "
            "map its experts. Set MTP_PLUGIN=off to draft with vLLM's own class.")
    return found


def host_compares_head_copies() -> bool:
    """Whether this platform's proposer attaches the target's head to an MTP layer only after
    comparing it with a copy the layer holds, so the drafter must load one.

    vllm-ascend's proposer (the NPU platform; ``vllm_ascend/spec_decode/llm_base_proposer.py``
    lines 475-478 at 182b75ea84, lines 490-493 in v0.23.0) runs, for every MTP layer,
    ``if torch.equal(layer.shared_head.head.weight, model.lm_head.weight): layer.shared_head.head
    = model.lm_head``. vLLM's own proposers (CUDA, ROCm, XPU, CPU) attach without comparing.
    """
    from vllm.platforms import current_platform

    return getattr(current_platform, "device_type", None) == "npu"


def mtp_completeness_check_enabled() -> bool:
    """Whether a load must bring every MTP tensor (vLLM's ``mtp_validation`` scope).

    vLLM's weight-transfer engines (RL weight sync) call ``load_weights`` with a chunk of the
    weights inside ``disable_mtp_completeness_check()``; vLLM without ``mtp_validation`` only
    loads whole checkpoints.
    """
    try:
        from vllm.model_executor.model_loader.mtp_validation import (
            is_mtp_completeness_check_enabled,
        )
    except ImportError:
        return True
    return is_mtp_completeness_check_enabled()


def narrows_per_rank(param) -> bool:
    """Whether ``param``'s own ``weight_loader`` takes the full checkpoint tensor and keeps this
    tensor-parallel rank's part itself, as vLLM's parallel layers do.

    A parameter without a loader, or with vLLM's ``default_weight_loader`` (a plain copy), needs
    its rank's slice from the caller. vLLM 0.33 creates V4's ``attn_sink`` with
    ``make_attention_sink``, whose loader narrows per rank; older releases use a plain parameter.
    """
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    loader = getattr(param, "weight_loader", None)
    return loader is not None and loader is not default_weight_loader


# ---------------------------------------------------------------------------------------------
# DeepSeek V4: the decoder block, side streams and CPU features of the current platform
# ---------------------------------------------------------------------------------------------

V4_PACKAGE = "vllm.models.deepseek_v4"
# The module that holds each in-tree platform's ``DeepseekV4DecoderLayer`` (vLLM 0.32 layout).
V4_BLOCK_MODULES = {
    "cuda": f"{V4_PACKAGE}.nvidia.model",
    "rocm": f"{V4_PACKAGE}.amd.model",
    "xpu": f"{V4_PACKAGE}.xpu.model",
    "cpu": f"{V4_PACKAGE}.cpu.model",
}
# An out-of-tree platform names its own V4 block with this class attribute ("module:Class").
V4_BLOCK_ATTRIBUTE = "deepseek_v4_decoder_layer"


def runner_drafter(runner):
    """The draft model a vLLM model runner keeps, or None (no speculation, or a speculator
    without a model): V1 at ``runner.drafter.model``, Model Runner V2 at
    ``runner.speculator.model``."""
    owner = getattr(runner, "drafter", None) or getattr(runner, "speculator", None)
    return getattr(owner, "model", None)


def platform_family() -> str:
    """``cuda``, ``rocm``, ``xpu``, ``cpu``, ``oot`` (out-of-tree plugin) or ``other``."""
    from vllm.platforms import current_platform as p

    for family, probe in (("rocm", p.is_rocm), ("xpu", p.is_xpu), ("cpu", p.is_cpu),
                          ("cuda", p.is_cuda), ("oot", p.is_out_of_tree)):
        if probe():
            return family
    return "other"


def deepseek_v4_block_qualname() -> str:
    """``"module:Class"`` of the DeepSeek-V4 decoder block this platform runs.

    An out-of-tree platform (Ascend, a test platform) sets ``deepseek_v4_decoder_layer`` on its
    platform class; in-tree platforms use vLLM's own module for their family.
    """
    from vllm.platforms import current_platform

    # On the class: the platform instance logs a warning for every attribute it lacks.
    named = getattr(type(current_platform), V4_BLOCK_ATTRIBUTE, None)
    if named:
        return named
    family = platform_family()
    if family not in V4_BLOCK_MODULES:
        raise NotImplementedError(
            f"vllm-mtp-plugin has no DeepSeek-V4 decoder block for platform "
            f"{type(current_platform).__name__} ({family}): vLLM ships V4 blocks for "
            f"{', '.join(V4_BLOCK_MODULES)} only. An out-of-tree platform provides its own by "
            f"setting `{V4_BLOCK_ATTRIBUTE} = \"package.module:DecoderLayer\"` on its platform class."
        )
    if not v4_module_exists(V4_BLOCK_MODULES[family]):
        raise NotImplementedError(
            f"this vLLM has no DeepSeek-V4 decoder block for {family} "
            f"({V4_BLOCK_MODULES[family]} is missing; vLLM 0.27 has none for cpu), so neither "
            "vLLM's nor vllm-mtp-plugin's V4 drafter can run here. Use a vLLM release that "
            "ships one, or serve without --speculative-config."
        )
    return f"{V4_BLOCK_MODULES[family]}:DeepseekV4DecoderLayer"


def v4_block_missing() -> str | None:
    """Why no DeepSeek-V4 decoder block can be built on this platform (``None`` when one can).

    Checked without importing the block: an out-of-tree platform must name one
    (``deepseek_v4_decoder_layer``; vllm-ascend's NPU platform names none, its V4 drafter is its
    own class), an in-tree one must ship its module.
    """
    try:
        deepseek_v4_block_qualname()
    except NotImplementedError as exc:
        from vllm.platforms import current_platform

        return (f"no DeepSeek-V4 decoder block for {type(current_platform).__name__}: "
                f"{str(exc).partition(': ')[2] or exc}")
    return None


def v4_module_exists(module_name: str) -> bool:
    """Whether ``vllm.models.deepseek_v4.<...>`` is there, without running the package ``__init__``
    (which imports a platform implementation)."""
    import importlib.util
    from pathlib import Path

    module_spec = importlib.util.find_spec(V4_PACKAGE)
    if module_spec is None or not module_spec.submodule_search_locations:
        return False
    relative = Path(*module_name.removeprefix(V4_PACKAGE + ".").split("."))
    return any((Path(root) / relative).with_suffix(".py").is_file()
               or (Path(root) / relative / "__init__.py").is_file()
               for root in module_spec.submodule_search_locations)


def deepseek_v4_block_cls() -> type:
    """The platform's V4 decoder block class, imported without the other platforms' modules."""

    module_name, _, cls_name = deepseek_v4_block_qualname().partition(":")
    return getattr(import_v4_module(module_name), cls_name)


def deepseek_v4_aux_streams(count: int = 3) -> list | None:
    """Side streams for the V4 block's overlapped GEMMs, or ``None`` where it runs on one stream.

    CUDA: ``torch.cuda.Stream`` (as vLLM's V4 model). ROCm, XPU and CPU blocks take none. An
    out-of-tree accelerator gets its own device module's streams (``torch.npu.Stream`` on
    Ascend); a CPU-backed platform gets none. No CUDA stream is created anywhere but on CUDA.
    """
    import torch
    from vllm.platforms import current_platform

    family = platform_family()
    if family == "cuda":
        return [torch.cuda.Stream() for _ in range(count)]
    device_module = getattr(torch, current_platform.device_type, None)
    if family == "oot" and current_platform.device_type not in ("cpu", "cuda") and hasattr(
        device_module, "Stream"
    ):
        return [device_module.Stream() for _ in range(count)]
    return None


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
