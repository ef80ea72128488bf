"""The Model Runner V2 test harness on vLLM's own kernels: the top-k/top-p kernel and V2's
probabilistic drafting kernels run interpreted, and the switch that gives V2 vLLM's PyTorch
masking (the harness itself, inert or switched on: ``tests/unit/suite/test_mrv2_harness.py``)."""

import pytest
from support.children import python_json

from vllm_mtp_plugin.tools.engine.mrv2 import harness_env, needs_interpreter

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)


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


@pytest.mark.skipif(not needs_interpreter(), reason="V2 runs natively here: no harness")
def test_vllms_top_k_top_p_kernel_runs_interpreted_and_matches_pytorch():
    """Its loop variable must be a tensor (``row.to(tl.int64)``), as in compiled Triton."""
    kept = python_json(TOPK_TOPP, harness_env())
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


@pytest.mark.skipif(not needs_interpreter(), reason="V2 runs natively here: no harness")
def test_v2s_probabilistic_drafting_kernels_run_interpreted():
    """A block mask and'ed with a scalar is a bool mask (the interpreter made it int32), and
    ``libdevice.log1p`` computes (a stub returning None in the interpreter): V2's gumbel_sample
    stores the draft logits a probabilistic rejection needs where it should, and nothing for a
    token of no request."""
    facts = python_json(GUMBEL, harness_env())
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


@pytest.mark.skipif(not needs_interpreter(), reason="V2 runs natively here: no harness")
def test_top_k_top_p_switch_gives_v2_vllms_pytorch_masking():
    """``VLLM_MTP_TEST_MRV2_TOP_K_TOP_P=pytorch``: what V2's sampling states call is vLLM's
    PyTorch implementation (the harness's function), with its masks; without it, vLLM's own."""
    switched = python_json(TOP_K_TOP_P_SWITCHED, {**harness_env(),
                                              "VLLM_MTP_TEST_MRV2_TOP_K_TOP_P": "pytorch"})
    assert switched["module"] == "sitecustomize" and switched["same"]
    assert switched["kept"][1] == 1 and switched["kept"][0] <= 4
    plain = python_json(TOP_K_TOP_P_SWITCHED, harness_env())
    assert plain["module"] == "vllm.v1.sample.ops.topk_topp_sampler" and plain["same"]
