"""k = 0 steps skip the MTP layer, and the next step that runs it catches up
(``patches/deferred_first_pass_at_k0.py``): the drafts are those of a layer that never skipped.

The k schedule is vLLM's own per-batch-size table, so it is the same in every run: while more
than two requests decode, k = 0; once the four short ones finish, the two long ones draft k = 2
after ~95 steps the layer skipped. A warm-up pass first, so the KV cache blocks the skipped
positions map to hold an earlier request's values (what a busy server's cache holds). On the
shipped trained tiny model (acceptance measured, not set by construction), fp32:

* with the deferral (the default): per request, the drafts and acceptances of every verify step
  equal those with ``VLLM_MTP_DEFERRED_FIRST_PASS=0`` (vLLM's way: the layer runs at every k = 0
  step), and the backlog was used (steps deferred, rows caught up);
* with the rows dropped instead of caught up (the ``k0-no-catch-up`` fault: the stale cache
  TensorRT-LLM's k = 0 left), the same comparison fails and acceptance falls.
"""

import functools
import json
from importlib import resources

import pytest
from support.faults import fault_env

from vllm_mtp_plugin.tools.engine.offline import OfflineConfig, run_config
from vllm_mtp_plugin.tools.tiny import trained

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

K = 2
TABLE = [[1, 2, K], [3, 256, 0]]  # batch of 1-2: k = 2; more: k = 0
LONG, SHORT = 160, 96  # output tokens: the first two prompts, the other four


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    model = trained.write_checkpoint(tmp_path_factory.mktemp("trained") / "model")
    text = resources.files("vllm_mtp_plugin.tools").joinpath(
        "data/trained_prompts.jsonl").read_text()
    prompts = [json.loads(line)["prompt"] for line in text.splitlines()][:6]

    @functools.cache
    def go(setting: str) -> dict:
        env = {"off": {"VLLM_MTP_DEFERRED_FIRST_PASS": "0"}, "on": None,
               "stale": fault_env("k0-no-catch-up")}[setting]
        sampling = [{"max_tokens": LONG if i < 2 else SHORT} for i in range(len(prompts))]
        return run_config(OfflineConfig(
            str(model), K, "plugin", prompts, LONG, sampling=sampling, warmup_prompts=len(prompts),
            eager="compiled-twin",  # compiled: tests/engine/adaptive_k/test_adaptive_k.py
            speculative_overrides={"num_speculative_tokens_per_batch_size": TABLE},
            llm_kwargs={"dtype": "float32", "per_request_spec_decode_metrics": "detailed"}),
            env=env)

    return go


def drafts(result: dict) -> list[tuple]:
    return [(tuple(r["drafted_per_step"]), tuple(r["accepted_per_step"]))
            for r in result["runs"][-1]["drafted_per_request"]]


def test_deferred_layer_drafts_as_one_that_never_skipped(run):
    on, off = run("on"), run("off")
    assert on["drafter"]["deferred_first_pass"]["deferred_steps"] > 80, on["drafter"]
    assert on["drafter"]["deferred_first_pass"]["caught_up_rows"] > 2 * 80, on["drafter"]
    assert off["drafter"]["deferred_first_pass"] is None, off["drafter"]
    assert on["token_ids"] == off["token_ids"]
    assert off["spec_decode"]["num_drafts"] >= 2 * (LONG - SHORT) // (K + 1), off["spec_decode"]
    assert drafts(on) == drafts(off)
    assert on["spec_decode"] == off["spec_decode"]


def test_dropping_the_skipped_rows_shows(run):
    """The comparison above can fail: a layer that skips without catching up drafts otherwise,
    and worse."""
    stale, off = run("stale"), run("off")
    assert stale["drafter"]["deferred_first_pass"]["deferred_steps"] > 80
    assert stale["token_ids"] == off["token_ids"]  # lossless either way
    assert drafts(stale) != drafts(off)

    def acceptance(result):
        spec = result["spec_decode"]
        return spec["num_accepted_tokens"] / spec["num_draft_tokens"]

    assert acceptance(stale) < acceptance(off) - 0.05, (stale["spec_decode"], off["spec_decode"])
