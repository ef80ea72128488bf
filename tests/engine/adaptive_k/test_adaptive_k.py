"""Adaptive k (``VLLM_MTP_ADAPTIVE_K=1``) in the real engine, on the shipped trained tiny model
(acceptance measured, not set by construction):

* lossless while k switches: greedy tokens are the target's own (transformers' fp32 greedy
  continuation, which equals vLLM's k = 0: ``tests/engine/tiny/test_trained_model.py``), on V1
  (compiled, as users run it; with vLLM's default process mode, the engine core spawned; with
  tensor parallelism) and on Model Runner V2 (harness);
* k does switch: every k from 0 to the configured one ran (each batch size starts with a burst at
  every k), as the controller's own summary lines say;
* no stale drafter after k = 0: a k = 0 decode step skips the MTP layer and the next step that
  runs it catches up first (``patches/deferred_first_pass_at_k0.py``; that the drafts are then
  those of a layer that never skipped: ``test_deferred_first_pass.py``); the layer's calls add up;
  the steps after k = 0 are prepared as without speculation
  (``patches/plain_inputs_without_drafts.py``).

A user's own ``num_speculative_tokens_per_batch_size`` keeping it off is a unit test
(``tests/unit/adaptive_k/test_engine_steps.py``): the warning, and a table the controller does not
take (``is_adaptive_table``).
"""

import functools
import json
import os
import re
import time

import pytest
from support.target_greedy import mismatches

from vllm_mtp_plugin.tools.cpu_features import avx512_hidden
from vllm_mtp_plugin.tools.engine.offline import OfflineConfig, run_config
from vllm_mtp_plugin.tools.tiny import trained

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

K = 3
MAX_TOKENS = 48
ADAPTIVE = {"VLLM_MTP_ADAPTIVE_K": "1", "VLLM_MTP_ADAPTIVE_K_LOG_INTERVAL": "0"}
SUMMARY = re.compile(r"vllm-mtp-plugin: adaptive k: (\{.*\})")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return trained.write_checkpoint(tmp_path_factory.mktemp("trained") / "model")


@pytest.fixture(scope="module")
def prompts():
    from importlib import resources

    text = resources.files("vllm_mtp_plugin.tools").joinpath(
        "data/trained_prompts.jsonl").read_text()
    return [json.loads(line)["prompt"] for line in text.splitlines()][:4]


@pytest.fixture(scope="module")
def run(model_dir, prompts, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")

    @functools.cache
    def go(runner: str | None = None, default_process_mode=False, layer_calls=False,
           tp: int = 1, max_num_seqs: int | None = None) -> tuple[dict, str]:
        """k = K with the switch on. fp32: a small model has near-ties that bf16 rounds
        differently in a verify pass and a decode step (tests/engine/tiny/test_trained_model.py)."""
        log = logs / f"{runner}-{default_process_mode}-{layer_calls}-tp{tp}-{max_num_seqs}.log"
        env = dict(ADAPTIVE)
        llm_kwargs = {"dtype": "float32"}
        if max_num_seqs:
            llm_kwargs["max_num_seqs"] = max_num_seqs
        if tp > 1:  # one rank per core (tests/engine/plugin/test_tensor_parallel.py)
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
            llm_kwargs.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
        result = run_config(OfflineConfig(
            str(model_dir), K, "plugin", prompts, MAX_TOKENS, runner=runner,
            default_process_mode=default_process_mode, record_layer_calls=layer_calls,
            eager="layer-calls" if layer_calls else None,
            llm_kwargs=llm_kwargs),
            log_path=str(log), env=env)
        return result, log.read_text()

    return go


@pytest.fixture(scope="module")
def prompt_ids(model_dir, prompts):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return [tokenizer(p).input_ids for p in prompts]


def assert_targets_own(model_dir, prompt_ids, result):
    assert mismatches(model_dir, list(zip(prompt_ids, result["token_ids"]))) == []


def summaries(log: str) -> list[dict]:
    return [json.loads(m.group(1)) for m in SUMMARY.finditer(log)]


def steps_at_k(log: str) -> dict[int, int]:
    found = summaries(log)
    assert found, log[-3000:]
    return {int(k): n for k, n in found[-1]["steps_at_k"].items()}


def test_model_runner_v2(run, model_dir, prompt_ids):
    adaptive, log = run("v2")
    assert adaptive["runner"] == "v2"
    assert "adaptive k on: each step drafts 0..3 tokens" in log
    assert_targets_own(model_dir, prompt_ids, adaptive)
    chosen = steps_at_k(log)
    assert set(chosen) == set(range(K + 1)) and all(chosen.values()), chosen


def test_default_process_mode_and_compiled(run, model_dir, prompt_ids):
    """The engine core spawned, its config pickled: the table reaches it and the controller
    runs there (its log lines come from that process). One sequence at a time: vLLM's dense
    lookup then names k = 0 only, yet the V1 runner takes every k (``choosable_ks``)."""
    adaptive, log = run(default_process_mode=True, max_num_seqs=1)
    assert "choices [0, 1, 2, 3]" in log
    assert adaptive["compilation"] != "eager"
    assert_targets_own(model_dir, prompt_ids, adaptive)
    assert set(steps_at_k(log)) == set(range(K + 1))


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP = 2 on CPU needs 2 cores (one per rank)")
@pytest.mark.skipif(avx512_hidden(), reason="TP = 2 fails under MTP_TEST_HIDE_AVX512 in the "
                    "target's vocab-parallel embedding (tests/engine/plugin/test_tensor_parallel.py)")
def test_tensor_parallel(run, model_dir, prompt_ids):
    """TP = 2: one scheduler, one k per step for both ranks (the count travels in the
    scheduler's output to each worker)."""
    adaptive, log = run(tp=2)
    assert "(Worker_TP1 pid=" in log
    assert_targets_own(model_dir, prompt_ids, adaptive)
    assert set(steps_at_k(log)) == set(range(K + 1))


def test_v1_lossless_and_the_k0_steps_deferred_then_caught_up(run, model_dir, prompt_ids):
    """V1 (eager here: the layers' calls are counted from Python): greedy tokens the target's own
    while every k runs, fewer drafts than k = 3 throughout would make; the MTP layer ran k times
    at each step drafting k >= 1, once at each k = 0 step it did not defer (prefills), and once
    per catch-up of the deferred ones: calls = sum over steps of max(1, k) - deferred + catch-ups
    (vLLM alone would make sum of max(1, k): its proposer runs the layer at k = 0 too)."""
    result, log = run("v1", layer_calls=True)
    assert result["runner"] == "v1"
    assert "adaptive k on: each step drafts 0..3 tokens" in log
    assert_targets_own(model_dir, prompt_ids, result)
    chosen = steps_at_k(log)
    assert set(chosen) == set(range(K + 1)) and all(chosen.values()), chosen
    spec = result["spec_decode"]
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] < K * spec["num_drafts"], spec
    calls = sum(n for per_layer in result["drafter"]["layer_calls"].values()
                for n in per_layer.values())
    deferred = result["drafter"]["deferred_first_pass"]
    assert deferred["deferred_steps"] > 0 and deferred["catch_ups"] > 0, deferred
    assert calls == (sum(max(1, k) * n for k, n in chosen.items()) - deferred["deferred_steps"]
                     + deferred["catch_ups"]), (calls, chosen, deferred)
    # A step after one that drafted nothing verifies nothing: prepared as without speculation
    # (no spec-decode metadata, patches/plain_inputs_without_drafts.py). Each k = 0 choice is
    # followed by such a step unless it ended a batch (one per generate call at most).
    plain = result["drafter"]["plain_steps"]
    assert chosen[0] - len(result["runs"]) - 1 <= plain <= sum(chosen.values()), (plain, chosen)


def test_served_with_the_openai_client_and_metrics(model_dir, tmp_path):
    """``vllm-mtp serve`` (vLLM's default process mode) with the switch on: completions as
    without it, and ``/metrics`` shows the k each step drafted and the controller's estimates."""
    from openai import OpenAI

    from vllm_mtp_plugin.tools.engine.metrics import page, parse_prometheus
    from vllm_mtp_plugin.tools.engine.server import Server

    spec = json.dumps({"method": "mtp", "num_speculative_tokens": K})
    with Server(model_dir, ["--speculative-config", spec, "--served-model-name", "tiny",
                            "--max-model-len", "512", "--dtype", "float32"],
                log_path=tmp_path / "serve.log",
                env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1", **ADAPTIVE}) as server:
        client = OpenAI(base_url=server.base_url, api_key="EMPTY")
        completion = client.completions.create(model="tiny", prompt="Once upon a time",
                                               max_tokens=48, temperature=0.0,
                                               extra_body={"ignore_eos": True})
        assert completion.usage.completion_tokens == 48
        deadline, steps = time.monotonic() + 30, {}
        while time.monotonic() < deadline and sum(steps.values()) < 10:
            time.sleep(1.2)  # the engine core writes its state once a second
            found = parse_prometheus(page(server.base_url))
            steps = {labels: v for (name, labels), v in found.items()
                     if name == "vllm_mtp:adaptive_k_steps_total"}
        assert len(steps) == K + 1 and all(steps.values()), steps
        names = {name for name, _ in found}
        assert {"vllm_mtp:adaptive_k_chosen", "vllm_mtp:adaptive_k_acceptance",
                "vllm_mtp:adaptive_k_tokens_per_second",
                "vllm_mtp:adaptive_k_step_seconds"} <= names, sorted(names)
    log = (tmp_path / "serve.log").read_text()
    assert "adaptive k on: each step drafts 0..3 tokens" in log
