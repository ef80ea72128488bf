"""``vllm-mtp serve --adapt``: a server whose MTP layer no longer fits its target (the trained tiny
DeepSeek with a noised layer) trains a new one on the traffic it serves and swaps it in, through
the OpenAI API, as users run it (compiled, engine core spawned). Its first candidate is better on
held-out data yet serves worse (a test-only fault, ``tests/support/faults.py`` ``round-1-head``:
that layer drafts through a shifted head), so it is rolled back; the second is kept. Nothing
fails, greedy outputs stay the target's own - those of the requests in flight during each swap
and rollback (started before the reload began, finished after it ended) checked one by one - and
the served acceptance of the kept version is higher."""

import json
import threading
import time
import urllib.request

import pytest
from openai import OpenAI

from vllm_mtp_plugin.tools.engine.server import Server
from vllm_mtp_plugin.tools.engine import metrics
from vllm_mtp_plugin.tools.tiny import trained

from support.checkpoint_edits import edited_copy, noise
from support.faults import fault_env
from support.target_greedy import mismatches

pytestmark = pytest.mark.engine

PROMPTS = [json.loads(line)["prompt"] for line in (trained.shipped_dir().parent /
                                                   "trained_prompts.jsonl").read_text().splitlines()]
NOISE = 0.5
TRAFFIC_MAX_TOKENS = (48, 80, 160)  # one client each, back to back


ADMIN = "admin-key"


def _status(server) -> dict:
    return json.loads(urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{server.port}/mtp/adapt",
        headers={"Authorization": f"Bearer {ADMIN}"})).read())


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapt")
    good = trained.write_checkpoint(root / "trained", 1)
    noised = edited_copy(good, root / "noised", tensors=noise(
        f"model.layers.{trained.ARCH.num_hidden_layers}.", NOISE))
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 1})
    sent, spans, failures, stop, lock = [], [], [], threading.Event(), threading.Lock()
    # The clients pause while a round trains: the trainer runs at a lower priority than serving
    # (adapt.py), and on this 2-core machine, beside another test, it otherwise got ~1/15 of a
    # core. They send while the candidate is evaluated, swapped in and watched.
    flowing = threading.Event()
    flowing.set()
    with Server(noised, ["--speculative-config", spec, "--served-model-name", "t",
                         "--max-model-len", "512", "--dtype", "float32",
                         "--adapt", str(root / "adapt"), "--record-fraction", "1",
                         "--adapt-every-tokens", "1500", "--adapt-heldout-tokens", "600",
                         "--adapt-steps", "60", "--adapt-window-drafts", "150",
                     "--reload-api-key", ADMIN],
                log_path=root / "serve.log",
                env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                     **fault_env("round-1-head")}) as server:
        client = OpenAI(base_url=server.base_url, api_key="EMPTY", max_retries=0)

        def traffic(max_tokens: int):
            i = 0
            while not stop.is_set():
                flowing.wait()
                try:
                    started = time.time()
                    done = client.completions.create(
                        model="t", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens,
                        temperature=0.0, extra_body={"return_token_ids": True})
                    pair = (list(done.choices[0].prompt_token_ids),
                            list(done.choices[0].token_ids))
                    with lock:  # sent[i] ran from spans[i][0] to spans[i][1]
                        sent.append(pair)
                        spans.append((started, time.time()))
                except Exception as exc:  # noqa: BLE001 - counted: nothing may fail
                    failures.append(repr(exc))
                i += 1

        # Requests of three lengths: their ends fall at different steps, so a swap or rollback
        # (a tenth of a second) always finds one in flight (with two of one length, both clients
        # sometimes sat between requests at the moment of a swap).
        threads = [threading.Thread(target=traffic, args=(n,)) for n in TRAFFIC_MAX_TOKENS]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 1200  # two rounds; the second trains on all recorded so far
        status = _status(server)
        while time.monotonic() < deadline:
            status = _status(server)
            events = [e["event"] for e in status["history"]]
            if "kept after watching" in events or "failed" in events:
                break
            (flowing.clear if status["state"] == "training" else flowing.set)()
            time.sleep(1)
        stop.set()
        flowing.set()
        for thread in threads:
            thread.join(60)
        page = metrics.parse_prometheus(urllib.request.urlopen(
            f"http://127.0.0.1:{server.port}/metrics").read().decode())
    return {"status": status, "sent": sent, "spans": spans, "failures": failures, "metrics": page,
            "good": good, "log": (root / "serve.log").read_text(errors="replace")}


def test_the_server_rolls_back_a_layer_that_serves_worse_then_keeps_a_better_one(adapted):
    events = [e for e in adapted["status"]["history"]]
    names = [e["event"] for e in events]
    assert "failed" not in names, events
    assert names[:6] == ["training", "swapped", "rolled back", "training", "swapped",
                         "kept after watching"], events
    first, rollback, second, kept = events[1], events[2], events[4], events[5]
    # round 1: better on held-out data, worse served (the fault) -> the old layer back
    assert first["candidate_agreement"] > first["serving_agreement"]
    # the layer the server started with (the noised one), named without its host path
    assert rollback["answer_status"] == 200 and rollback["to"] == "the served checkpoint"
    assert rollback["served"]["new"] < 0.1 < rollback["served"]["previous"]
    assert rollback["served"]["new_draft_tokens"] >= 150
    # round 2, trained from the layer serving after the rollback: better, and kept
    assert events[3]["from"] == "the served checkpoint"
    assert second["candidate_agreement"] > second["serving_agreement"]
    served = kept["served"]
    assert served["new"] > served["previous"] and served["new_draft_tokens"] >= 150


def test_nothing_failed_and_outputs_stay_the_targets_own(adapted):
    assert adapted["failures"] == []
    sent = adapted["sent"]
    assert len(sent) > 20
    middle = len(sent) // 2
    assert mismatches(adapted["good"], sent[:3] + sent[middle - 2:middle + 2] + sent[-3:]) == []


def test_requests_in_flight_during_each_swap_give_the_targets_tokens(adapted):
    """Each swap and rollback happened while requests ran (three clients of different lengths,
    back to back): the ones that spanned the whole reload - weights replaced under them between
    two steps - give the target's own greedy tokens."""
    swaps = [e for e in adapted["status"]["history"] if e["event"] in ("swapped", "rolled back")]
    assert len(swaps) == 3, swaps
    across = []
    for swap in swaps:
        began = swap["time"] - swap["reload_seconds"]
        spanning = [i for i, (start, end) in enumerate(adapted["spans"])
                    if start < began and end > swap["time"]]
        assert spanning, (swap, adapted["spans"][-5:])
        across += spanning
    assert mismatches(adapted["good"], [adapted["sent"][i] for i in sorted(set(across))]) == []


def test_metrics_show_every_version(adapted):
    values = {(name, dict(labels).get("version")): v for (name, labels), v in
              adapted["metrics"].items() if name.startswith("vllm_mtp:")}
    # 0: the noised layer; 1: round 1 (faulted); 2: the noised layer again; 3: round 2
    assert values[("vllm_mtp:drafter_layer_version", None)] == 3
    accepted = "vllm_mtp:spec_decode_num_accepted_tokens_by_layer_total"
    drafts = "vllm_mtp:spec_decode_num_draft_tokens_by_layer_total"
    rate = {v: values[(accepted, v)] / values[(drafts, v)] for v in ("0", "1", "3")}
    assert rate["1"] < rate["0"] < rate["3"], rate
