"""Skips for parts of the suite that this CPU cannot run, each naming the missing flag.

The flags come from one probe, ``vllm_mtp_plugin.tools.cpu_features`` (read once per process;
``MTP_TEST_HIDE_AVX512=1`` hides AVX-512 and AMX). Skip only where the hardware really is the
limit: tests of names, shapes, maps and loading select their kernels explicitly instead
(``support/drafters.py``). docs/testing.md, "Hardware the tests need", lists every user of these.
"""

import pytest

from vllm_mtp_plugin.platform import platform_family
from vllm_mtp_plugin.tools.cpu_features import deepseek_v4_cpu_blockers, missing_cpu_features


def needs_cpu(*flags: str, part: str):
    """Skip unless this CPU has ``flags`` (on the CPU platform); ``part`` says what needs them."""
    missing = missing_cpu_features(*flags) if platform_family() == "cpu" else []
    return pytest.mark.skipif(bool(missing), reason=f"{part} needs: " + "; ".join(missing))


def needs_v4_target(fp8: bool = False):
    """Skip unless vLLM can run a DeepSeek-V4 target here (through the V2 test harness)."""
    blockers = deepseek_v4_cpu_blockers(fp8=fp8, triton_harness=True) \
        if platform_family() == "cpu" else []
    kind = "an FP8" if fp8 else "a bf16"
    return pytest.mark.skipif(bool(blockers), reason=f"vLLM cannot run {kind} DeepSeek-V4 target "
                              "on this machine: " + "; ".join(blockers))
