"""Which drafter class serves when another plugin registers the same architecture names.

A test-only rival plugin (``tests/support/precedence/rival``: registers ``DeepSeekMTPModel``,
``DeepseekV32MTPModel`` and ``DeepSeekV4MTPModel`` as vllm-ascend does, and offers an out-of-tree
platform without a V4 decoder block) is discovered before or after vllm-mtp-plugin in child
processes (``support/precedence/resolve.py``). The outcome must not depend on the order.
"""

import json
import os
import subprocess
import sys

import pytest
from support import paths

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

RESOLVE = paths.SUPPORT / "precedence" / "resolve.py"
OURS_V3 = "vllm_mtp_plugin.models.v3:DeepSeekMTP"
OURS_V4 = "vllm_mtp_plugin.models.v4:DeepSeekV4MTP"
RIVAL_V3 = "vllm_mtp_rival.models:RivalDeepSeekMTP"
RIVAL_V4 = "vllm_mtp_rival.models:RivalDeepSeekV4MTP"
IN_TREE_V3 = "vllm.model_executor.models.deepseek_mtp:DeepSeekMTP"


def start(order: str, *switches: str, npu: bool = False) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "MTP_PLUGIN")}
    env["VLLM_MTP_RIVAL_NPU"] = "1" if npu else "0"
    return subprocess.Popen([sys.executable, str(RESOLVE), order, *switches], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def report(child: subprocess.Popen) -> dict:
    out, _ = child.communicate(timeout=600)
    lines = [line for line in out.splitlines() if line.startswith("REPORT ")]
    assert child.returncode == 0 and lines, out[-3000:]
    return json.loads(lines[-1].removeprefix("REPORT "))


@pytest.fixture(scope="module")
def reports(checkpoints):
    """The rival's out-of-tree platform (no V4 block) with the rival discovered first and last,
    and the CPU platform (has a V4 block) with the rival last and a real engine."""
    children = {
        "npu_first": start("first", "overrides", npu=True),
        "npu_last": start("last", "mode=on", npu=True),
        "cpu_last": start("last", f"engine={checkpoints('oracle')}", "mode=off", "mode=on"),
    }
    return {name: report(child) for name, child in children.items()}


def test_ours_serve_what_they_support_whichever_plugin_loads_last(reports):
    first, last, cpu = reports["npu_first"], reports["npu_last"], reports["cpu_last"]
    assert first["discovered"] == ["rival_mtp", "vllm_mtp_plugin"]
    assert last["discovered"] == cpu["discovered"] == ["vllm_mtp_plugin", "rival_mtp"]
    assert first["platform"] == last["platform"] == "RivalNPUPlatform"
    assert cpu["platform"] == "CpuPlatform"
    # V3: ours on both platforms; V3.2 stays the rival's (not an architecture of this plugin).
    for rep in (first, last, cpu):
        assert rep["loaded"]["DeepSeekMTPModel"] == OURS_V3
        assert rep["loaded"]["DeepseekV32MTPModel"] == RIVAL_V3
    assert cpu["loaded"]["DeepSeekV4MTPModel"] == OURS_V4  # vLLM ships a CPU V4 block


def test_a_real_engine_builds_our_drafter_with_the_rival_loaded_after_us(reports):
    engine = reports["cpu_last"]["engine"]
    assert engine == {"drafter": OURS_V3, "rival_constructed": [], "tokens": 8}


def test_switches_force_either_side(reports):
    first, cpu = reports["npu_first"], reports["cpu_last"]
    # vLLM's --model-class-overrides (its own code path) wins over the precedence rule.
    assert first["overrides"]["DeepSeekMTPModel"] == IN_TREE_V3
    # MTP_PLUGIN=off: the rival's classes everywhere; on: ours again.
    assert cpu["mode=off"] == {"DeepSeekMTPModel": RIVAL_V3, "DeepseekV32MTPModel": RIVAL_V3,
                               "DeepSeekV4MTPModel": RIVAL_V4}
    assert cpu["mode=on"]["DeepSeekMTPModel"] == OURS_V3
    assert cpu["mode=on"]["DeepSeekV4MTPModel"] == OURS_V4
    assert any("DeepSeekMTPModel, DeepSeekV4MTPModel are served by the platform plugin's class" in w
               and "(MTP_PLUGIN=off)" in w for w in cpu["warnings"])


def test_v4_goes_to_the_platforms_class_where_no_v4_block_exists(reports):
    first, last = reports["npu_first"], reports["npu_last"]
    assert first["loaded"]["DeepSeekV4MTPModel"] == last["loaded"]["DeepSeekV4MTPModel"] == RIVAL_V4
    for rep in (first, last):
        line = [w for w in rep["warnings"] if "DeepSeekV4MTPModel" in w]
        assert len(line) == 1 and "no DeepSeek-V4 decoder block for RivalNPUPlatform" in line[0]
        assert "Set MTP_PLUGIN=on to use ours anyway." in line[0]
    # Forced: ours, even though its V4 drafter would stop with a clear error on this platform.
    assert last["mode=on"]["DeepSeekV4MTPModel"] == OURS_V4
