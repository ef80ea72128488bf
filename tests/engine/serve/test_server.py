"""`vllm-mtp serve` over the OpenAI API, and the demo end to end."""

import json
import os
import re
import subprocess
import sys

import pytest
from openai import OpenAI

from vllm_mtp_plugin.tools.engine import metrics
from vllm_mtp_plugin.tools.engine.server import Server

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    model = checkpoints("oracle")
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    log = tmp_path_factory.mktemp("server") / "serve.log"
    # vLLM's default process mode (the suite's environment turns it off for offline engines).
    with Server(model, ["--speculative-config", spec, "--served-model-name", "tiny",
                        "--max-model-len", "512"], log_path=log,
                env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}) as srv:
        yield srv
    assert srv.process.returncode is not None  # stopped


def test_completions_chat_and_spec_decode_metrics(server):
    client = OpenAI(base_url=server.base_url, api_key="EMPTY")
    before = metrics.scrape(server.base_url)
    completion = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20,
                                           temperature=0.0, extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Describe the water cycle."}],
        max_tokens=20, temperature=0.0, extra_body={"ignore_eos": True})
    delta = metrics.scrape(server.base_url) - before
    assert completion.usage.completion_tokens == 20 and completion.choices[0].text
    assert chat.usage.completion_tokens == 20 and chat.choices[0].message.content
    # Oracle drafter: every draft accepted, at both positions. A request's first token comes from
    # its prefill, then each verified draft gives k + 1 = 3: ceil(19 / 3) = 7 drafts per request.
    assert delta.num_drafts == 2 * 7
    assert delta.num_draft_tokens == 2 * delta.num_drafts
    assert delta.num_accepted_tokens == delta.num_draft_tokens
    assert delta.accepted_per_position == (delta.num_drafts, delta.num_drafts)



def test_server_log_names_the_drafter_where_it_is_built(server):
    log = server.log_path.read_text(errors="replace")
    assert "(EngineCore pid=" in log
    line = next(l for l in log.splitlines() if "vllm-mtp-plugin 0.1.0: " in l)
    assert ("DeepSeekMTP (V3 MTP layer) serves DeepSeekMTPModel; MTP layer(s) 2 loaded "
            "(18 parameters); the target's embedding and head are shared: 2.0 MiB not allocated "
            "(embed_tokens + 1 shared_head.head, 2048 x 256 bfloat16 each, this rank)") in line


COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_total", "vllm:generation_tokens_total")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def page_values(server) -> dict:
    """The counters above as the ``/metrics`` page shows them (summed over their labels), and the
    accepted tokens per position."""
    import urllib.request

    page = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics").read().decode()
    values: dict = {name: None for name in COUNTERS}
    positions: dict = {}
    for (name, labels), value in metrics.parse_prometheus(page).items():
        if name in COUNTERS:
            values[name] = (values[name] or 0) + value
        elif name == PER_POSITION:
            position = int(dict(labels)["position"])
            positions[position] = positions.get(position, 0) + value
    values[PER_POSITION] = [positions[p] for p in sorted(positions)]
    return values


def test_metrics_page_counts_every_draft_of_a_request(server):
    """The page's counters, read by name: after one 19-token request on the oracle checkpoint
    (first token from the prefill, then 6 drafts of k = 2, each accepted whole, 1 + 6 * 3 = 19
    tokens), every counter moved by exactly that; its totals are consistent whatever ran before."""
    client = OpenAI(base_url=server.base_url, api_key="EMPTY")
    before = page_values(server)
    completion = client.completions.create(model="tiny", prompt="The water cycle", max_tokens=19,
                                           temperature=0.0, extra_body={"ignore_eos": True})
    after = page_values(server)
    assert completion.usage.completion_tokens == 19
    assert None not in after.values() and len(after[PER_POSITION]) == 2, after
    drafts, drafted, accepted, generated = (after[n] - (before[n] or 0) for n in COUNTERS)
    per_position = [a - b for a, b in zip(after[PER_POSITION], before[PER_POSITION] or [0, 0])]
    assert (drafts, drafted, accepted, generated, per_position) == (6, 12, 12, 19, [6, 6])
    assert generated == 1 + drafts + accepted
    totals = [after[n] for n in COUNTERS[:3]]
    assert 0 < totals[0] and totals[1] == 2 * totals[0] and totals[2] <= totals[1], totals
    assert sum(after[PER_POSITION]) == totals[2]
    assert after[PER_POSITION][1] <= after[PER_POSITION][0]  # position 1 only after position 0


def test_demo_runs_end_to_end_on_the_trained_model(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "vllm_mtp_plugin.tools.cli", "demo", "--requests", "2",
                          "--max-tokens", "16", "-k", "2"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "server ready after" in out.stdout
    # Each server first got the 8 requests once, unmeasured (the counters below hold 2 per kind).
    assert len(re.findall(r"^\[demo\] warm-up: 8 requests, not measured, in [\d.]+ s$",
                          out.stdout, re.M)) == 2, out.stdout[-3000:]
    # bf16 (the checkpoint's) where the CPU computes in it, else fp32; compiled, as users run it.
    from vllm_mtp_plugin.tools.cpu_features import AVX512_BF16, host_cpu_flags

    dtype = "the checkpoint's" if AVX512_BF16 in host_cpu_flags() else "float32"
    assert f"[demo] engine dtype: {dtype}; vLLM's default compilation" in out.stdout
    # Served with probabilistic drafts, the recommended method for sampled requests.
    assert '"draft_sample_method": "probabilistic"}' in out.stdout
    # Two requests of each kind, each printed with its reply: replies differ by prompt; the chat
    # prompts once more sampled at T = 0.6.
    replies = re.findall(r"^\[demo\] (code|prose|chat(?:, T=0\.6)?) +.* -> 16 tokens: (.*)$",
                         out.stdout, re.M)
    assert [kind for kind, _ in replies] == (["code"] * 2 + ["prose"] * 2 + ["chat"] * 2
                                             + ["chat, T=0.6"] * 2)
    assert len({reply for _, reply in replies[:6]}) == 6
    assert not any("<|t" in r for _, r in replies)
    # One acceptance table per kind from vLLM's counters (2 requests of 16 tokens, k = 2). Each
    # request's first token comes from its prefill, then each draft gives 1 + its accepted tokens,
    # the last one cut at max_tokens: 2 * 16 <= 2 + drafts + accepted <= 2 * (16 + 2).
    firsts = []
    for kind in ("code", "prose", "chat", "chat, T=0.6"):
        block = out.stdout.split(f"\n{kind}:\n", 1)[1].split("\n\n", 1)[0]
        row = dict(re.findall(r"^ *(\S.*?) {2,}(\S+)$", block, re.M))
        drafts, drafted, accepted = (int(row[n]) for n in ("drafts", "draft tokens",
                                                            "accepted tokens"))
        first, second = (float(row[f"position {i}"].rstrip("%")) for i in (0, 1))
        assert drafted == 2 * drafts and 32 <= 2 + drafts + accepted <= 36, (kind, row)
        assert round((first + second) * drafts / 100) == accepted, (kind, row)
        assert row["acceptance rate"] == f"{accepted / drafted:.1%}", (kind, row)
        assert row["mean acceptance length"] == f"{1 + accepted / drafts:.2f}", (kind, row)
        # Position 1 is accepted only after position 0; a trained drafter (unlike the oracle) is
        # neither always right nor equally right on code, prose and chat.
        assert 0 <= second <= first and 0 < first < 100, (kind, row)
        firsts.append(first)
    assert len(set(firsts)) > 1
    assert "nothing in the checkpoint sets it" in out.stdout
    # The same requests without speculation on a second server: both rates side by side, per
    # kind and overall, the ratio theirs.
    assert "[demo] the same requests without speculative decoding" in out.stdout
    assert out.stdout.count("server ready after") == 2
    rates = re.findall(r"^(code|prose|chat|chat, T=0\.6|all) +([\d.]+) +([\d.]+) +([\d.]+)x$",
                       out.stdout.split("[demo] output tokens per second", 1)[1], re.M)
    assert [kind for kind, *_ in rates] == ["code", "prose", "chat", "chat, T=0.6", "all"], rates
    for kind, with_mtp, without, ratio in rates:
        assert float(with_mtp) > 0 and float(without) > 0, (kind, with_mtp, without)
        assert abs(float(ratio) - float(with_mtp) / float(without)) < 0.01, (kind, ratio)
    assert "MTP, k=2" in out.stdout.split("[demo] output tokens per second", 1)[1]
    assert (tmp_path / "vllm-mtp-plugin" / "tiny-trained" / "model.safetensors").exists()
