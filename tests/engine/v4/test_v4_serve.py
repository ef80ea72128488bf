"""``vllm-mtp serve`` of a bf16 tiny DeepSeek-V4 checkpoint with MTP, over the OpenAI API.

Runs under the Model Runner V2 test harness (``tools/engine/mrv2.py.harness_env``: Triton's interpreter
stands in for a Triton CPU backend; tests only, never for serving), in vLLM's default process mode.
The oracle drafter is always right, so the counters move by exact amounts: a request that asks for
``1 + m (k + 1)`` tokens gets its first token from the prefill and then ``m`` verification steps
of ``k`` drafts each, every draft accepted plus one bonus token. vLLM picks its ``deepseek_v4``
tokenizer mode for these checkpoints; its chat encoding makes a short chat about 260 tokens long.
"""

import json

import pytest
from openai import OpenAI
from support.hardware import needs_v4_target
from support.drafters import tiny_v4_checkpoint

from vllm_mtp_plugin.tools.engine.eager_reasons import eager_serve_args
from vllm_mtp_plugin.tools.engine import metrics
from vllm_mtp_plugin.tools.engine.mrv2 import harness_env
from vllm_mtp_plugin.tools.engine.server import Server


K, STEPS = 2, 5
MAX_TOKENS = 1 + STEPS * (K + 1)

pytestmark = [pytest.mark.engine, needs_v4_target()]  # engine: starts vLLM (conftest.py)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tiny_v4_checkpoint("oracle", quantization=None)
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": K})
    log = tmp_path_factory.mktemp("v4-server") / "serve.log"
    env = harness_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    with Server(model, ["--speculative-config", spec, "--served-model-name", "tiny-v4",
                        "--dtype", "bfloat16", *eager_serve_args("interpreted-v4"),
                        "--max-model-len", "512"],
                log_path=log, env=env) as srv:
        yield srv
    assert srv.process.returncode is not None  # stopped, by its PID


def test_completion_chat_and_spec_decode_counters(server):
    client = OpenAI(base_url=server.base_url, api_key="EMPTY")
    steps = {"num_drafts": STEPS, "num_draft_tokens": K * STEPS, "num_accepted_tokens": K * STEPS}
    before = metrics.scrape(server.base_url)
    completion = client.completions.create(model="tiny-v4", prompt="Once upon a time",
                                           max_tokens=MAX_TOKENS, temperature=0.0,
                                           extra_body={"ignore_eos": True})
    middle = metrics.scrape(server.base_url)
    chat = client.chat.completions.create(
        model="tiny-v4", messages=[{"role": "user", "content": "Describe the water cycle."}],
        max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})
    after = metrics.scrape(server.base_url)
    assert completion.usage.completion_tokens == MAX_TOKENS and completion.choices[0].text
    assert chat.usage.completion_tokens == MAX_TOKENS and chat.choices[0].message.content
    for delta in (middle - before, after - middle):
        assert {name: getattr(delta, name) for name in steps} == steps
        assert delta.accepted_per_position == (STEPS,) * K


def test_the_server_ran_our_v4_drafter_on_model_runner_v2(server):
    log = server.log_path.read_text(errors="replace")
    assert "Using V2 Model Runner" in log
    line = next(l for l in log.splitlines() if "vllm-mtp-plugin 0.1.0: " in l)
    assert "DeepSeekV4MTP (V4 MTP layer) serves DeepSeekV4MTPModel; MTP layer(s) 2 loaded" in line
