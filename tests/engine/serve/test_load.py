"""Under load nothing is lost: 24 streaming clients against `vllm-mtp serve` with MTP (k = 3).

A smaller run of `benchmarks/load_test.py`: completions and chats, a quarter of the streams closed
after a few chunks, prompts up to the context limit, n > 1 and stop strings. The oracle checkpoint
makes the expected counters exact (every draft accepted); a server without speculation on the same
checkpoint gives the reference tokens.
"""

import json
import sys

import pytest

from support import paths
from vllm_mtp_plugin.tools.engine.eager_reasons import eager_serve_args
from vllm_mtp_plugin.tools.engine.server import Server, start_all

sys.path.insert(0, str(paths.REPO / "benchmarks"))
import loadtest  # noqa: E402  benchmarks/loadtest.py: the load test's mix and checks

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

K = 3
MAX_MODEL_LEN = 512
CLIENTS = 24


@pytest.fixture(scope="module")
def servers(checkpoints, tmp_path_factory):
    """The speculative server and the reference, started side by side (vLLM's default mode)."""
    model = checkpoints("oracle")
    logs = tmp_path_factory.mktemp("load")
    common = ["--served-model-name", "tiny", *eager_serve_args("outside-the-graph"),
              "--max-model-len",
              str(MAX_MODEL_LEN), "--dtype", "float32"]
    spec = ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": K})]
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    group = [Server(model, common + spec, log_path=logs / "spec.log", env=env),
             Server(model, common, log_path=logs / "reference.log", env=env)]
    start_all(group)
    try:
        yield group
    finally:
        for server in group:
            server.stop()


def test_24_clients_with_aborts_lose_nothing(servers):
    spec, reference = servers
    margin = loadtest.context_margin(K)
    mix = loadtest.make_mix(spec.base_url, "tiny", 2 * CLIENTS, MAX_MODEL_LEN, seed=3,
                            max_tokens=(8, 24), margin=margin)
    assert sum(r.abort_after is not None for r in mix) == CLIENTS // 2
    assert {r.kind for r in mix} == {"chat", "completion"}
    assert any(r.n > 1 for r in mix) and any(r.stop for r in mix)
    assert max(r.prompt_tokens + r.max_tokens for r in mix) == MAX_MODEL_LEN - margin

    outcome = loadtest.evaluate(spec.base_url, "tiny", mix, CLIENTS, K,
                                reference_url=reference.base_url, oracle=True, margin=margin,
                                request_timeout=240, overall_timeout=420)
    print(loadtest.format_summary("spec", outcome.figures, outcome.problems))
    assert outcome.problems == []
    figures = outcome.figures
    assert figures["completed"] + figures["aborted"] == len(mix)
    assert figures["aborted"] > 0 and figures["error"] == figures["timeout"] == 0
    assert outcome.reference["completed"] == len(mix)
    counters = figures["spec_decode"]
    assert counters["num_drafts"] > 0
    assert counters["num_accepted_tokens"] == counters["num_draft_tokens"] == K * counters["num_drafts"]
    assert counters["accepted_per_position"] == [counters["num_drafts"]] * K
    assert figures["server_finished"].get("error", 0) == 0
