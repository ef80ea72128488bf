"""Platform differences of the V4 drafter: which block, which streams, which hc_head, which CPU.

The out-of-tree case runs in a child process under a test-only platform plugin
(``support/fake_npu/platform_plugin``: a ``vllm.platform_plugins`` entry point, CPU-backed, reporting
``PlatformEnum.OOT``), because vLLM chooses its platform once per process.
"""

import json
import os
import subprocess
import sys

import pytest
from support.drafters import tiny_v4_checkpoint
from support import paths

from vllm_mtp_plugin import platform as plat
from vllm_mtp_plugin.tools import cpu_features

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

SUPPORT = paths.SUPPORT / "fake_npu"
REPO = paths.REPO


@pytest.fixture(scope="module")
def oot_facts():
    model = tiny_v4_checkpoint("random", quantization=None)
    env = {**os.environ, "VLLM_MTP_FAKE_NPU": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(SUPPORT / "platform_plugin"),
                                          os.environ.get("PYTHONPATH", "")])}
    env.pop("VLLM_TARGET_DEVICE", None)  # "cpu" there would short-cut platform plugins
    proc = subprocess.run([sys.executable, str(SUPPORT / "probe_oot.py"), str(model)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_oot_platform_is_the_one_vllm_chose(oot_facts):
    assert (oot_facts["platform"], oot_facts["out_of_tree"], oot_facts["is_cpu"]) == \
        ("FakeNPUPlatform", True, False)


def test_oot_drafter_uses_the_platforms_block_and_imports_no_other_platforms_code(oot_facts):
    assert oot_facts["block"] == "vllm.models.deepseek_v4.cpu.model:DeepseekV4DecoderLayer"
    imported = oot_facts["imported_by_construction"]
    assert "vllm.models.deepseek_v4.cpu.model" in imported
    for other in ("nvidia", "amd", "xpu"):
        assert not [m for m in imported if m.startswith(f"vllm.models.deepseek_v4.{other}")]
    # vLLM's package __init__ (which would pick nvidia/ here) did not run for our import...
    assert oot_facts["package_before_construction"] is False
    assert oot_facts["package_after_construction"] is False
    # ...and still runs, unchanged, when something imports the package later.
    assert oot_facts["package_reimported_with_its_classes"] is True


def test_oot_drafter_creates_no_cuda_stream(oot_facts):
    assert oot_facts["cuda_streams_created"] == 0


def test_oot_hc_head_runs_through_the_portable_op(oot_facts):
    assert oot_facts["hc_head_op"] == "PortableHCHeadOp"
    assert oot_facts["hc_head_dispatch"] == "forward_oot"
    assert oot_facts["portable_hc_head_calls"] == [[3, 4, 256]]  # once, in compute_logits
    assert oot_facts["loaded_all"] is True
    assert oot_facts["logits_shape"] == [3, 2048]
    assert oot_facts["logits_max_abs_diff"] < 0.05
    assert oot_facts["fused_shape"] == [3, 4, 256]


def test_cpu_platform_gets_vllms_cpu_block_and_no_streams():
    assert plat.platform_family() == "cpu"
    assert plat.deepseek_v4_block_qualname() == \
        "vllm.models.deepseek_v4.cpu.model:DeepseekV4DecoderLayer"
    assert plat.deepseek_v4_aux_streams() is None


def test_a_platform_without_a_v4_block_is_told_how_to_provide_one(monkeypatch):
    monkeypatch.setattr(plat, "platform_family", lambda: "other")
    with pytest.raises(NotImplementedError) as err:
        plat.deepseek_v4_block_qualname()
    assert "vLLM ships V4 blocks for cuda, rocm, xpu, cpu only" in str(err.value)
    assert 'deepseek_v4_decoder_layer = "package.module:DecoderLayer"' in str(err.value)


def test_a_vllm_without_the_platforms_v4_block_gets_a_clear_error(monkeypatch):
    """vLLM 0.27 has no ``deepseek_v4/cpu/``: stop with a message, not a bare ImportError."""
    assert plat.v4_module_exists("vllm.models.deepseek_v4.cpu.model")
    monkeypatch.setitem(plat.V4_BLOCK_MODULES, "cpu", "vllm.models.deepseek_v4.cpu_gone.model")
    with pytest.raises(NotImplementedError) as err:
        plat.deepseek_v4_block_qualname()
    assert "this vLLM has no DeepSeek-V4 decoder block for cpu" in str(err.value)


def test_cpu_feature_probe_names_each_missing_flag(tmp_path, monkeypatch):
    import vllm.triton_utils

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_tile\n")
    assert {"avx512f", "avx512_bf16", "amx_tile"} <= cpu_features.cpu_flags(str(cpuinfo))
    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", True)
    assert cpu_features.deepseek_v4_cpu_blockers(str(cpuinfo)) == []  # bf16 V4
    assert cpu_features.deepseek_v4_cpu_blockers(str(cpuinfo), fp8=True) == [
        f"CPU flag amx_bf16 missing from {cpuinfo}"]
    cpuinfo.write_text("flags\t\t: avx512f\n")
    assert cpu_features.deepseek_v4_cpu_blockers(str(cpuinfo)) == [
        f"CPU flag avx512_bf16 missing from {cpuinfo}"]
    cpuinfo.write_text("flags\t\t: avx512_bf16 amx_bf16 amx_tile\n")
    assert cpu_features.deepseek_v4_cpu_blockers(str(cpuinfo), fp8=True) == []
    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", False)
    assert cpu_features.deepseek_v4_cpu_blockers(str(cpuinfo)) == [
        "Triton with a CPU backend (triton-cpu) is not installed"]
    assert cpu_features.deepseek_v4_cpu_blockers(str(cpuinfo), triton_harness=True) == []
    assert cpu_features.cpu_flags(str(tmp_path / "absent")) == frozenset()
