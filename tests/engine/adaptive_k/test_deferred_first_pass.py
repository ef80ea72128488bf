"""k = 0 steps skip the MTP layer, and the next step that runs it catches up
(``patches/deferred_first_pass_at_k0.py``): the drafts are those of a layer that never skipped.

The k schedule is vLLM's own per-batch-size table, so it is the same in every run: while more
than two requests decode, k = 0; once the others finish, the two long ones draft k = 2. Two
schedules: "long", where the four short requests run ~95 steps the layer skips, caught up in one
query per request (MLA's prefill path); "short", four at a time (``max_num_seqs``) with a short
request admitted every step or two, each admission a prefill that catches up one to a few rows per
request (MLA's decode path, verification's as the plugin runs it); "cached", the "long" one
longer and in bf16 on vLLM's AMX_MLA backend, which keeps prefix caching on: there a step at which
a request's first kept block must hold the layer's KV (another request may share the block as
soon as vLLM may hand it out) catches the batch up at once. A warm-up pass first, so the KV cache blocks the skipped
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
from support.hardware import needs_cpu

from vllm_mtp_plugin.tools.cpu_features import AMX
from vllm_mtp_plugin.tools.engine.offline import OfflineConfig, run_config
from vllm_mtp_plugin.tools.tiny import trained

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

K = 2
TABLE = [[1, 2, K], [3, 256, 0]]  # batch of 1-2: k = 2; more: k = 0
# Output tokens per request (the first two are the long ones) and max_num_seqs, per schedule.
SCHEDULES = {"long": ([160, 160, 96, 96, 96, 96], None),
             "short": ([120, 120, *[2, 3] * 15], 4),
             "cached": ([330, 330, 250, 250, 250, 250], None)}
CACHED_DTYPE = "bfloat16"  # AMX_MLA: its block size (128) and prefix caching


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    model = trained.write_checkpoint(tmp_path_factory.mktemp("trained") / "model")
    text = resources.files("vllm_mtp_plugin.tools").joinpath(
        "data/trained_prompts.jsonl").read_text()
    pool = [json.loads(line)["prompt"] for line in text.splitlines()]

    @functools.cache
    def go(setting: str, schedule: str = "long") -> dict:
        env = {"off": {"VLLM_MTP_DEFERRED_FIRST_PASS": "0"}, "on": None,
               "stale": fault_env("k0-no-catch-up")}[setting]
        lengths, max_num_seqs = SCHEDULES[schedule]
        prompts = [pool[i % len(pool)] for i in range(len(lengths))]
        llm_kwargs = {"dtype": CACHED_DTYPE if schedule == "cached" else "float32",
                      "per_request_spec_decode_metrics": "detailed"}
        if max_num_seqs:
            llm_kwargs["max_num_seqs"] = max_num_seqs
        return run_config(OfflineConfig(
            str(model), K, "plugin", prompts, max(lengths),
            sampling=[{"max_tokens": n} for n in lengths], warmup_prompts=len(prompts),
            eager="compiled-twin",  # compiled: tests/engine/adaptive_k/test_adaptive_k.py
            speculative_overrides={"num_speculative_tokens_per_batch_size": TABLE},
            llm_kwargs=llm_kwargs), env=env)

    return go


def drafts(result: dict) -> list[tuple]:
    return [(tuple(r["drafted_per_step"]), tuple(r["accepted_per_step"]))
            for r in result["runs"][-1]["drafted_per_request"]]


@pytest.mark.parametrize("schedule", [
    "long", "short", pytest.param("cached", marks=needs_cpu(
        *AMX, part="prefix caching with MLA (vLLM's AMX_MLA backend; CPU_MLA turns it off)"))])
def test_deferred_layer_drafts_as_one_that_never_skipped(run, schedule):
    on, off = run("on", schedule), run("off", schedule)
    deferred = on["drafter"]["deferred_first_pass"]
    assert off["drafter"]["deferred_first_pass"] is None, off["drafter"]
    if schedule == "long":  # ~95 steps of 6 rows, caught up at one step
        assert deferred["deferred_steps"] > 80 and deferred["caught_up_rows"] > 2 * 80, deferred
    elif schedule == "short":  # many catch-ups of a few rows per request
        assert deferred["catch_ups"] > 10, deferred
        assert deferred["caught_up_rows"] <= 4 * 3 * deferred["catch_ups"], deferred
    else:  # one catch-up per pass (warm-up, measured) and, in each, at least one more when a
        # request's first kept block had to hold the layer's KV (vLLM's MTP block drop: once the
        # block after it, position 256 on AMX_MLA's blocks of 128, is full)
        assert deferred["catch_ups"] >= 2 + 2, deferred
    assert deferred["rows_kept"] == 0, deferred
    assert on["token_ids"] == off["token_ids"]
    assert off["spec_decode"]["num_drafts"] >= 40, off["spec_decode"]
    assert drafts(on) == drafts(off)
    assert on["spec_decode"] == off["spec_decode"]


def test_dropping_the_skipped_rows_shows(run):
    """The comparison above can fail: a layer that skips without catching up drafts otherwise,
    and worse."""
    stale, off = run("stale"), run("off")  # the "long" schedule
    assert stale["drafter"]["deferred_first_pass"]["deferred_steps"] > 80
    assert stale["token_ids"] == off["token_ids"]  # lossless either way
    assert drafts(stale) != drafts(off)

    def acceptance(result):
        spec = result["spec_decode"]
        return spec["num_accepted_tokens"] / spec["num_draft_tokens"]

    assert acceptance(stale) < acceptance(off) - 0.05, (stale["spec_decode"], off["spec_decode"])
