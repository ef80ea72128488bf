"""Bad requests and bad configs get vLLM's own answers with MTP on: the plugin changes none of them.

Requests: one server with the plugin and one with ``VLLM_PLUGINS=""`` (vLLM's drafter class), both
with MTP, get the same invalid requests; status, error type and message must be 4xx and identical.
Configs: ``EngineArgs(...).create_engine_config()`` in a child process per plugin setting (no
engine starts); exception type and message must be identical.
"""

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from vllm_mtp_plugin.tools.engine.eager_reasons import eager_serve_args
from vllm_mtp_plugin.tools.engine.offline import child_env
from vllm_mtp_plugin.tools.engine.server import Server, start_all

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

SPEC = {"method": "mtp", "num_speculative_tokens": 2}
LONG = "word " * 700  # well over 512 tokens

# name -> (body fields, expected status, a fragment of vLLM's message)
REQUESTS = {
    "max_tokens over max_model_len": ({"max_tokens": 600}, 400,
                                      "max_tokens=600 cannot be greater than max_model_len=512"),
    "negative temperature": ({"temperature": -0.5}, 400, "temperature must be non-negative"),
    "top_p above 1": ({"top_p": 1.5}, 400, "top_p must be in (0, 1]"),
    "unknown model": ({"model": "no-such-model"}, 404, "The model `no-such-model` does not exist"),
    "n = 0": ({"n": 0}, 400, "n must be at least 1"),
    "prompt longer than max_model_len": ({"prompt": LONG}, 400,
                                         "maximum context length is 512 tokens"),
}


def _plugins_env(impl: str) -> dict:
    """``in-tree``: vLLM without any plugin (``VLLM_PLUGINS=""``), the answers to compare with."""
    env = child_env("plugin")
    if impl == "in-tree":
        env["VLLM_PLUGINS"] = ""
    return env


def _env(impl: str) -> dict:
    return {**_plugins_env(impl), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


@pytest.fixture(scope="module")
def servers(checkpoints, tmp_path_factory):
    """{"plugin": server, "in-tree": server}, both with MTP on the same checkpoint."""
    logs = tmp_path_factory.mktemp("bad-requests")
    args = ["--served-model-name", "tiny", *eager_serve_args("outside-the-graph"),
            "--max-model-len", "512",
            "--speculative-config", json.dumps(SPEC)]
    group = {}
    for impl in ("plugin", "in-tree"):
        group[impl] = Server(checkpoints("oracle"), args, log_path=logs / f"{impl}.log")
        group[impl].env = _env(impl)
    start_all(list(group.values()))
    try:
        yield group
    finally:
        for server in group.values():
            server.stop()


def _post(server: Server, endpoint: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"{server.base_url}/{endpoint}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _body(endpoint: str, fields: dict, stream: bool) -> dict:
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0.0, "prompt": "Once upon a time",
            **fields}
    if stream:
        body["stream"] = True
    if endpoint == "chat/completions":
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
    return body


def test_the_servers_differ_only_in_the_drafter_class(servers):
    assert "vllm-mtp-plugin 0.1.0: " in servers["plugin"].log_path.read_text(errors="replace")
    assert "vllm-mtp-plugin" not in servers["in-tree"].log_path.read_text(errors="replace")
    body = _body("completions", {"max_tokens": 16, "ignore_eos": True}, False)
    answers = {impl: _post(server, "completions", body) for impl, server in servers.items()}
    assert answers["plugin"][0] == 200
    assert answers["plugin"][1]["choices"][0]["text"] == answers["in-tree"][1]["choices"][0]["text"]
    assert answers["plugin"][1]["usage"] == answers["in-tree"][1]["usage"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
@pytest.mark.parametrize("case", list(REQUESTS))
def test_bad_request_answer_is_unchanged_by_the_plugin(servers, case, endpoint, stream):
    fields, status, fragment = REQUESTS[case]
    body = _body(endpoint, fields, stream)
    answers = {impl: _post(server, endpoint, body) for impl, server in servers.items()}
    assert answers["plugin"] == answers["in-tree"]
    got_status, error = answers["plugin"]
    assert got_status == status
    assert error["error"]["code"] == status
    assert fragment in error["error"]["message"]


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_prompt_plus_max_tokens_over_the_context_is_cut_at_the_context(servers, endpoint):
    """vLLM 0.32 answers 200 and stops at max_model_len ("length"); so it does with the plugin."""
    body = _body(endpoint, {"prompt": "word " * 480, "max_tokens": 60, "ignore_eos": True}, False)
    answers = {impl: _post(server, endpoint, body) for impl, server in servers.items()}
    status, answer = answers["plugin"]
    assert status == answers["in-tree"][0] == 200
    usage = answer["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 512
    assert usage["prompt_tokens"] + 60 > 512
    assert answer["choices"][0]["finish_reason"] == "length"
    assert usage == answers["in-tree"][1]["usage"]
    assert answer["choices"][0] == answers["in-tree"][1]["choices"][0]


CONFIG_CHILD = r"""
import json, sys
from vllm import ModelRegistry
from vllm.engine.arg_utils import EngineArgs
results = {}
for name, model, spec in json.loads(sys.argv[1]):
    try:
        config = EngineArgs(model=model, speculative_config=spec, max_model_len=512,
                            ).create_engine_config()
        draft = config.speculative_config.draft_model_config.hf_config.architectures
        results[name] = {"ok": draft}
    except Exception as exc:
        results[name] = {"type": f"{type(exc).__module__}.{type(exc).__qualname__}",
                         "message": str(exc)}
results["registered"] = ModelRegistry.models["DeepSeekMTPModel"].module_name
print("RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def config_errors(checkpoints):
    """Per plugin setting: what create_engine_config() said for each config (children in parallel)."""
    one, two = str(checkpoints("oracle")), str(checkpoints("oracle", num_nextn_predict_layers=2))
    configs = [
        ["3 tokens on 2 MTP layers", two, {"method": "mtp", "num_speculative_tokens": 3}],
        ["0 tokens", one, {"method": "mtp", "num_speculative_tokens": 0}],
        ["negative tokens", one, {"method": "mtp", "num_speculative_tokens": -2}],
        ["unknown method", one, {"method": "mtp-next", "num_speculative_tokens": 1}],
        ["valid", one, {"method": "mtp", "num_speculative_tokens": 3}],
    ]
    children = {impl: subprocess.Popen([sys.executable, "-c", CONFIG_CHILD, json.dumps(configs)],
                                       env=_plugins_env(impl), stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
                for impl in ("plugin", "in-tree")}
    results = {}
    for impl, child in children.items():
        out, _ = child.communicate(timeout=300)
        line = next((l for l in out.splitlines() if l.startswith("RESULTS ")), None)
        assert child.returncode == 0 and line, out[-3000:]
        results[impl] = json.loads(line[len("RESULTS "):])
    return results


def test_config_children_ran_with_and_without_the_plugin(config_errors):
    assert config_errors["plugin"]["registered"].startswith("vllm_mtp_plugin.")
    assert config_errors["in-tree"]["registered"].startswith("vllm.")
    assert config_errors["plugin"]["valid"] == config_errors["in-tree"]["valid"] == {
        "ok": ["DeepSeekMTPModel"]}


@pytest.mark.parametrize("name, fragment", [
    ("3 tokens on 2 MTP layers", "num_speculative_tokens:3 must be divisible by n_predict=2"),
    ("0 tokens", "num_speculative_tokens\n  Input should be greater than 0"),
    ("negative tokens", "num_speculative_tokens\n  Input should be greater than 0"),
    ("unknown method", "method\n  Input should be 'ngram'"),
])
def test_config_error_is_unchanged_by_the_plugin(config_errors, name, fragment):
    assert config_errors["plugin"][name] == config_errors["in-tree"][name]
    error = config_errors["plugin"][name]
    assert error["type"] == "pydantic_core._pydantic_core.ValidationError"
    assert fragment in error["message"]
