"""``vllm-mtp serve --record`` end to end: requests through the OpenAI API become training shards
(every position of prompt and output, prefix-cached or not, streamed or not), outputs stay what
the target alone gives, and ``vllm-mtp train --data`` trains from the shards.

One server of the trained tiny DeepSeek as users run it: compiled, vLLM's default process mode,
MTP k = 1, fp32 (so that greedy outputs equal transformers' fp32 greedy:
``test_trained_model.py``), with prefix caching and chunked prefill on, as on GPUs. vLLM's CPU
platform turns both off for MLA (``platforms/cpu.py``, without AMX), so this server runs the
target's attention unabsorbed (``VLLM_MLA_DISABLE=1``, vLLM's switch; the same weights) with
32-token blocks (the CPU backend's smallest) and a 64-token step budget: the second round's prompts come from the prefix
cache and every prompt is prefilled in chunks, and the shards must still be whole."""

import json
import stat
import subprocess
import sys
import threading
import time
from importlib import resources

import pytest
import torch
from openai import OpenAI

from vllm_mtp_plugin.tools.engine import metrics
from vllm_mtp_plugin.tools.engine.server import Server
from vllm_mtp_plugin.tools.tiny import trained
from vllm_mtp_plugin.tools.mtp_layer.shard_format import SequenceStore

from support.recorded import recorded_requests, sent_requests
from support.target_greedy import mismatches

pytestmark = pytest.mark.engine

MAX_TOKENS = 24
RECORDS = [json.loads(line) for line in resources.files("vllm_mtp_plugin.tools")
           .joinpath("data/trained_prompts.jsonl").read_text().splitlines()]
# A shared preamble (81 tokens: two whole 32-token blocks) that later requests read from the
# prefix cache, as a system prompt is (less the last matched block, which vLLM computes again
# for the drafter).
PREAMBLE = ("Read the request below, then answer it directly and briefly, the way a careful "
            "engineer would answer a colleague who asked it in a hurry: say what to do first, "
            "keep any code short and correct, name the assumptions you make, and do not repeat "
            "the question back.\n\n")
PROMPTS = [PREAMBLE + r["prompt"] for r in RECORDS if "prompt" in r][::2][:4]  # code and prose
SEEDED = PREAMBLE + (
    "A service writes one log line per request and the disk fills up every few days. Explain "
    "how to rotate the logs with the tools a Linux server already has, how many days of logs to "
    "keep, how to compress the old ones, and how to check that the rotation really ran.")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return trained.write_checkpoint(tmp_path_factory.mktemp("live") / "trained", 1)


@pytest.fixture(scope="module")
def served(model, tmp_path_factory):
    """The server, its recording directory, and what the client sent and got back."""
    root = tmp_path_factory.mktemp("live-serve")
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 1})
    with Server(model, ["--speculative-config", spec, "--served-model-name", "t",
                        "--max-model-len", "512", "--dtype", "float32",
                        "--block-size", "32", "--max-num-batched-tokens", "64",
                        "--max-num-seqs", "16",
                        "--record", str(root / "recorded"), "--record-fraction", "1"],
                log_path=root / "serve.log",
                env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_MLA_DISABLE": "1"}) as server:
        client = OpenAI(base_url=server.base_url, api_key="EMPTY")
        sent, acceptance, seeded = _traffic(client, server.base_url)
        store = _wait_for_shards(root / "recorded", len(sent))
        yield {"server": server, "dir": root / "recorded", "sent": sent, "store": store,
               "seeded": seeded,
               "acceptance": acceptance, "log": root / "serve.log", "model": model}


def _completion(client, prompt, temperature=0.0, **kwargs):
    done = client.completions.create(model="t", prompt=prompt, max_tokens=MAX_TOKENS,
                                     temperature=temperature,
                                     extra_body={"return_token_ids": True}, **kwargs)
    return [(list(done.choices[0].prompt_token_ids or done.prompt_token_ids or []),
             list(c.token_ids)) for c in done.choices]


def _traffic(client, base_url) -> tuple[list[tuple[list[int], list[int]]], dict, list]:
    """Greedy completions, two rounds (the second while the first round's recording windows
    run; its prompts are prefix-cached), a streamed chat, two sampled completions of one, and a
    seeded completion twice. Returns what was sent and got, the served acceptance of the greedy
    rounds, and the seeded completions."""
    sent = []
    before = metrics.scrape(base_url)
    for _ in range(2):
        threads, results = [], [None] * len(PROMPTS)
        for i, prompt in enumerate(PROMPTS):
            def run(i=i, prompt=prompt):
                results[i] = _completion(client, prompt)
            threads.append(threading.Thread(target=run))
            threads[-1].start()
        for thread in threads:
            thread.join()
        sent += [pair for result in results for pair in result]
    acceptance = (metrics.scrape(base_url) - before).summary()
    stream = client.chat.completions.create(
        model="t", messages=[{"role": "user", "content": "Write a loop in C."}],
        max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
        extra_body={"return_token_ids": True})
    prompt_ids, output_ids = [], []
    for chunk in stream:
        prompt_ids = list(getattr(chunk, "prompt_token_ids", None) or prompt_ids)
        for choice in chunk.choices:
            output_ids += list(getattr(choice, "token_ids", None) or [])
    sent.append((prompt_ids, output_ids))
    sent += _completion(client, PROMPTS[0], n=2, temperature=1.0, seed=7)
    # A seeded prompt prefilled in chunks (all but the preamble uncached: over a step's budget),
    # then the same again, read from the prefix cache and prefilled in one step, then with
    # another seed.
    seeded = [_completion(client, SEEDED, temperature=1.0, seed=seed) for seed in (11, 11, 12)]
    sent += [pair for result in seeded for pair in result]
    return sent, acceptance, seeded


def _wait_for_shards(directory, expected: int, timeout: float = 120.0) -> SequenceStore:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if list(directory.glob("shard-*.safetensors")):
            store = SequenceStore(directory)
            if len(store) >= expected:
                return store
        time.sleep(1.0)
    raise AssertionError(f"{expected} recorded sequences expected in {directory} within "
                         f"{timeout:.0f} s; found {list(directory.iterdir())}")


def test_every_finished_request_is_recorded_whole(served):
    store, sent = served["store"], served["sent"]
    assert all(prompt and output for prompt, output in sent), sent
    assert recorded_requests(store) == sent_requests(sent)
    # One hidden state per position, of the target's width, none left at its empty value.
    for tokens, hidden in zip(store.tokens, store.hidden):
        assert hidden.shape == (len(tokens) - 1, store.hidden_size)
        assert bool(torch.isfinite(hidden).all()) and float(hidden.abs().sum(-1).min()) > 0
    log = served["log"].read_text(errors="replace")
    assert "vllm-mtp record: shard-" in log and "failed" not in log.split("vllm-mtp record")[-1]


def test_prompts_came_from_the_prefix_cache_and_in_chunks(served):
    """The conditions the module is about held: prefix caching and chunked prefill on, prompt
    tokens read from the cache (the second round and the shared preamble), and each completion
    of the two rounds longer than a step's token budget, so its re-prefill ran in chunks."""
    log = served["log"].read_text(errors="replace")
    assert "enable_prefix_caching=True, enable_chunked_prefill=True" in log
    hits = [float(line.split()[-1]) for line in metrics.page(served["server"].base_url).splitlines()
            if line.startswith("vllm:prefix_cache_hits_total")]
    assert hits and sum(hits) >= 2 * 32 * len(PROMPTS), hits
    rounds = served["sent"][:2 * len(PROMPTS)]
    assert min(len(p) + len(o) for p, o in rounds) > 64


def test_seeded_prompt_prefilled_in_chunks_samples_as_in_one_step(served):
    """A seeded request whose prompt takes several steps (vLLM throws away the token sampled on
    each partial one) gives the tokens the same request gives when its prompt is one step from
    the prefix cache: the thrown-away draws left its generator alone
    (``patches/seeded_chunked_prefill_on_cpu.py``; vLLM 0.32 alone kills the engine on the first)."""
    (cold,), (warm,), (other_seed,) = served["seeded"]
    assert len(cold[0]) - 2 * 32 > 64, len(cold[0])  # uncached past the preamble: over one step
    assert cold[0] == warm[0] and len(cold[1]) == MAX_TOKENS
    assert cold[1] == warm[1]
    assert other_seed[1] != cold[1]  # the tokens depend on the draws: a seed changes them


def test_metrics_count_what_was_recorded(served):
    """``/metrics`` carries the recorder's figures: every completion the client got was finished,
    sampled (F = 1) and recorded, with its tokens; the windows took time; the directory's size
    is that of its shards."""
    from vllm_mtp_plugin.tools.live import record_metrics

    sent = served["sent"]
    deadline = time.monotonic() + 30  # the last window counts just after its shard appears
    while True:
        figures = record_metrics.read(served["server"].base_url)
        if figures["recorded_requests"] >= len(sent) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert figures["finished_requests"] == figures["sampled_requests"] == len(sent), figures
    assert figures["recorded_requests"] == len(sent), figures
    assert figures["recorded_tokens"] == sum(len(p) + len(o) for p, o in sent), figures
    assert figures["incomplete_requests"] == figures["skipped_requests"] == 0, figures
    assert figures["failed_windows"] == figures["pauses"] == figures["paused_requests"] == 0
    assert figures["active"] == 1 and figures["cut_requests"] == 0, figures
    # the workers wrote the windows' own rows only: at most one per recorded token (requests
    # that share a prefix share its rows), none of the concurrent traffic's
    assert 0 < figures["written_rows"] <= figures["recorded_tokens"], figures
    assert figures["calls_matched_by_tokens"] == 0, figures  # every row told by its request
    assert 0 < figures["window_seconds"] < 120, figures
    sizes = sum(p.stat().st_size for p in served["dir"].glob("shard-*.safetensors"))
    assert figures["directory_bytes"] == sizes, figures


def test_shards_are_private(served):
    assert stat.S_IMODE(served["dir"].stat().st_mode) == 0o700
    for shard in served["dir"].glob("shard-*"):
        assert stat.S_IMODE(shard.stat().st_mode) == 0o600, shard
    assert not list(served["dir"].glob("*.partial")) and not list(served["dir"].glob(".raw-*"))


def test_recorded_states_are_what_the_drafter_serves_on(served):
    """The checkpoint's own layer on the recorded states agrees with the target about as often
    as the served drafts were accepted (the same layer on the same inputs): rows shifted by one
    position or taken from another request would agree at chance (~0)."""
    from vllm_mtp_plugin.tools.mtp_layer.evaluation import evaluate

    own = evaluate(served["model"], served["dir"], 1, "recursive", device="cpu")
    served_rate = served["acceptance"]["acceptance_rate"]
    assert own["positions"] > 150
    assert own["agreement"][0] > 0.5, own
    assert abs(own["agreement"][0] - served_rate) < 0.12, (own["agreement"], served_rate)


def test_greedy_outputs_are_the_targets_own_while_recording(served):
    """Both greedy rounds (the second overlapping the first's re-prefills) equal transformers'
    fp32 greedy continuation of the same prompt ids: recording changed no output."""
    assert mismatches(served["model"], served["sent"][:2 * len(PROMPTS)]) == []


def test_train_from_recorded_shards(served, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "vllm_mtp_plugin.tools.cli", "train", str(served["model"]),
         "--data", str(served["dir"]), "--out", str(tmp_path / "out"), "--steps", "4",
         "--batch-size", "2", "--quiet"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    n = len(served["store"])
    assert f"[1/3] recorded data: {n} sequences" in done.stdout
    assert "collecting" not in done.stdout
    report = json.loads((tmp_path / "out" / "training" / "training.json").read_text())
    assert report["sequences"] == n and report["trainable_parameters"] > 0
    assert (tmp_path / "out" / "config.json").exists()
    assert (tmp_path / "out" / "training" / "loss.png").stat().st_size > 0
