"""An MLA backend that takes the engine's dtype on CPUs with AMX (patch ``mla_dtype_on_amx``,
documented on the function that applies it)."""

from __future__ import annotations

import functools
import inspect

from .framework import NotFound, Patch, cpu_only, logger

NAME = "mla_dtype_on_amx"
AMX_MLA_MODULE = "vllm.v1.attention.backends.mla.amx_mla"
# What may go wrong without the patch (``Patch.unpatched``).
UNPATCHED = (
    "On a CPU with AMX, a DeepSeek (MLA) model served in float32 (or another dtype than bfloat16) "
    "may stop at load (RuntimeError: expect weight to be bfloat16, ...); serve it with "
    "--attention-backend CPU_MLA and \"attention_backend\": \"CPU_MLA\" in --speculative-config.")


def amx_tiles() -> bool:
    """Whether vLLM sees AMX tiles here (its own test, ``platforms/cpu.py``)."""
    import torch

    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def probe() -> str | None:
    """Needed on CPU platforms with AMX tiles whose backend choice prefers ``AMX_MLA``."""
    from vllm.platforms import current_platform

    if reason := cpu_only():
        return reason
    if not amx_tiles():
        return "no AMX tiles: vLLM picks CPU_MLA, which takes every dtype"
    platform = type(current_platform)
    for name in ("get_attn_backend_cls", "check_and_update_config"):
        if not hasattr(platform, name):
            return NotFound(f"{platform.__name__}.{name} not found")
    if "_is_amx_tile_supported" not in inspect.getsource(platform.get_attn_backend_cls):
        return f"{platform.__name__}.get_attn_backend_cls no longer prefers AMX_MLA"
    return None


def amx_mla_takes(dtype) -> bool:
    """Whether vLLM's AMX MLA backend holds weights of ``dtype`` (``supported_dtypes``)."""
    import importlib

    backend = importlib.import_module(AMX_MLA_MODULE).AMXMLABackend
    return dtype in getattr(backend, "supported_dtypes", [dtype])


def mla_dtype_on_amx() -> None:
    """Let vLLM run MLA on CPUs with AMX in a dtype its AMX backend does not hold.

    What it fixes: on a CPU with AMX tiles vLLM picks ``AMX_MLA`` for every MLA model
    (``platforms/cpu.py``: ``get_attn_backend_cls``, ~150-164, for the target and again for the
    drafter, whose attention backend is chosen on its own, ``v1/spec_decode/llm_base_proposer.py``
    ~1282) and sizes the KV cache and scheduler for it (``check_and_update_config``, ~245-275 and
    ~515: block size 128, prefix caching and chunked prefill on). That backend holds bfloat16
    weights only (``AMXMLABackend.supported_dtypes``; its ``process_weights_after_loading`` packs
    ``kv_b_proj`` with ``convert_weight_packed``), so a float32 engine stops at load:
    ``RuntimeError: expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8``.
    ``CPU_MLA``, vLLM's backend on every other CPU, takes any dtype. This makes both choices
    follow the engine's dtype: ``check_and_update_config`` sees ``attention_config.backend =
    CPU_MLA`` (vLLM then sets the reference backend's block size 16 and its scheduler settings,
    as on CPUs without AMX) and ``get_attn_backend_cls`` is asked for ``CPU_MLA`` whenever the
    dtype it is given is not one ``AMX_MLA`` holds, so the drafter follows too. bfloat16 engines
    keep ``AMX_MLA``; DeepSeek-V4 (its own backends) and models without MLA are left alone. How
    to see it: ``vllm serve`` a DeepSeek-V3 model with ``--dtype float32`` on a CPU with AMX
    (``tests/unit/plugin/test_amx_mla_dtype.py``). When it can go: when vLLM's CPU platform weighs
    the dtype in its MLA backend choice.
    """
    from vllm.platforms import current_platform

    platform = type(current_platform)
    choose = inspect.getattr_static(platform, "get_attn_backend_cls")
    update = inspect.getattr_static(platform, "check_and_update_config")
    if getattr(choose.__func__, "patch", None) != NAME:
        platform.get_attn_backend_cls = classmethod(_choosing_by_dtype(choose.__func__))
    if getattr(update.__func__, "patch", None) != NAME:
        platform.check_and_update_config = classmethod(_configuring_by_dtype(update.__func__))


def _cpu_mla():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum.CPU_MLA


def _choosing_by_dtype(get_attn_backend_cls):
    @functools.wraps(get_attn_backend_cls)
    def get_attn_backend_cls_by_dtype(cls, selected_backend, attn_selector_config, *args,
                                      **kwargs):
        config = attn_selector_config
        if (config.use_mla and not config.use_sparse and selected_backend != _cpu_mla()
                and amx_tiles() and not amx_mla_takes(config.dtype)):
            logger.info("vllm-mtp-plugin: %s: MLA in %s takes CPU_MLA (AMX_MLA holds "
                        "bfloat16 weights only)", NAME, config.dtype)
            selected_backend = _cpu_mla()
        return get_attn_backend_cls(cls, selected_backend, attn_selector_config, *args, **kwargs)

    get_attn_backend_cls_by_dtype.patch = NAME
    return get_attn_backend_cls_by_dtype


def _configuring_by_dtype(check_and_update_config):
    @functools.wraps(check_and_update_config)
    def check_and_update_config_by_dtype(cls, vllm_config, *args, **kwargs):
        model = vllm_config.model_config
        attention = getattr(vllm_config, "attention_config", None)
        if (model is not None and attention is not None and getattr(model, "use_mla", False)
                and getattr(model.hf_config, "model_type", None) != "deepseek_v4"
                and attention.backend != _cpu_mla() and amx_tiles()
                and not amx_mla_takes(model.dtype)):
            named = attention.backend
            (logger.warning if named is not None else logger.info)(
                "vllm-mtp-plugin: %s: MLA in %s runs on CPU_MLA (%s holds bfloat16 weights only)",
                NAME, model.dtype, named.name if named is not None else "AMX_MLA")
            attention.backend = _cpu_mla()
        return check_and_update_config(cls, vllm_config, *args, **kwargs)

    check_and_update_config_by_dtype.patch = NAME
    return check_and_update_config_by_dtype


PATCH = Patch(NAME, probe, mla_dtype_on_amx, UNPATCHED)
