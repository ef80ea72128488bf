"""``tests/support/fork_server.py``: jobs forked from a process that has imported vLLM behave as new
interpreters would (arguments, environment, working directory, log, exit code, traceback,
timeout), one server per environment; an engine run that way reports what a plain process does.

The probes run in the environments the suite's engines run in (``offline.child_env``), so they
use the servers this worker has started for its engines instead of starting their own."""

import json
import os
import re
import subprocess
import sys
import time
import types

import pytest

from support import fork_server
from vllm_mtp_plugin.tools.engine.offline import LAUNCHER, OfflineConfig, child_env, run_config

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

PROBE = """
import atexit, gc, json, os, sys, threading, time
import torch._dynamo.output_graph as output_graph
from torch._inductor.codecache import FxGraphCache
print("probe ran", flush=True)
out, code = sys.argv[1], int(sys.argv[2])
atexit.register(lambda: open(out + ".atexit", "w").write("exit handler ran"))
threading.Thread(target=lambda: time.sleep(0.5) or open(out + ".thread", "w").write("joined")).start()
json.dump({"argv": sys.argv, "cwd": os.getcwd(), "plugin": os.environ.get("MTP_PLUGIN"),
           "test": os.environ.get("PYTEST_CURRENT_TEST"), "server": os.getppid(),
           "name": __name__, "vllm_imported": "vllm.entrypoints.llm" in sys.modules,
           "frozen": gc.get_freeze_count(),
           "graph_name": output_graph.unique_id("__compiled_fn", with_uuid=True),
           "fx_graph_cache": FxGraphCache._get_tmp_dir()},
          open(out, "w"))
if code == 99:
    raise ValueError("probe failed on purpose")
if code == 98:
    time.sleep(60)
sys.exit(code)
"""


@pytest.fixture
def probe(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)

    def run(code=0, impl="plugin", timeout=60.0, **env):
        out, log = tmp_path / f"out-{time.monotonic_ns()}.json", tmp_path / "job.log"
        exit_code = fork_server.run([str(script), str(out), str(code)],
                                    {**child_env(impl), **env}, str(log), timeout)
        report = json.loads(out.read_text()) if out.exists() else {}
        for end in ("atexit", "thread"):
            ended = out.with_name(f"{out.name}.{end}")
            report[end] = ended.read_text() if ended.exists() else None
        return exit_code, report, log.read_text()

    return run


def test_jobs_run_as_new_interpreters_one_server_per_environment(probe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, first, log = probe(0, PYTEST_CURRENT_TEST="one")
    assert code == 0 and log == "probe ran\n"
    assert first["argv"][0].endswith("probe.py") and first["argv"][2] == "0"
    assert (first["cwd"], first["plugin"], first["test"]) == (str(tmp_path), "auto", "one")
    assert first["name"] == "__main__" and first["vllm_imported"]  # imported by the server
    assert first["frozen"] > 100_000  # vLLM's modules, out of the collector's reach
    # The suite's preload ran in the server (support/torch_caches.py): no uuid in the name.
    assert re.fullmatch(r"__compiled_fn_\d+", first["graph_name"]), first["graph_name"]
    # ... and the FX graph cache is the run's, wherever vLLM points TORCHINDUCTOR_CACHE_DIR.
    if os.environ.get("MTP_TEST_TORCH_CACHE"):
        assert first["fx_graph_cache"] == os.path.join(os.environ["MTP_TEST_TORCH_CACHE"], "fxgraph")
    # It ends as an interpreter does: its threads joined, then its exit handlers.
    assert (first["thread"], first["atexit"]) == ("joined", "exit handler ran")
    # Another test's name is not another environment: the same server forks it, with its name.
    code, second, _ = probe(3, PYTEST_CURRENT_TEST="two")
    assert code == 3 and second["test"] == "two" and second["server"] == first["server"]
    # Nor is the drafter class (MTP_PLUGIN, read when vLLM loads plugins): the child gets it.
    code, in_tree, _ = probe(0, "in-tree")
    assert code == 0 and in_tree["plugin"] == "off" and in_tree["server"] == first["server"]
    code, other, _ = probe(0, MTP_FORK_SERVER_PROBE_VARIABLE="1")
    assert code == 0 and other["server"] != first["server"]


def test_a_failing_job_leaves_its_traceback_and_a_slow_one_is_killed(probe):
    code, failed, log = probe(99)
    assert code == 1 and "ValueError: probe failed on purpose" in log
    assert failed["atexit"] == "exit handler ran"
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        probe(98, timeout=3)
    assert time.monotonic() - started < 30
    code, report, _ = probe(0)  # the server goes on
    assert code == 0 and report["plugin"] == "auto"


def test_servers_are_kept_per_environment_and_the_least_recently_used_stops(monkeypatch):
    started, stopped = [], []

    class Server:
        def __init__(self, env):
            self.env, self.exit = env, None
            self.process = types.SimpleNamespace(poll=lambda: self.exit)
            started.append(env["E"])

        def run(self, job, timeout):
            return int(self.env["E"])

        def stop(self):
            stopped.append(self.env["E"])

    monkeypatch.setattr(fork_server, "_Server", Server)
    monkeypatch.setattr(fork_server, "_servers", fork_server.OrderedDict())
    monkeypatch.setattr(fork_server, "MAX_SERVERS", 2)
    for e in "1", "2", "1", "3", "1", "2":
        assert fork_server.run(["x.py"], {"E": e, "PYTEST_CURRENT_TEST": e}, "/dev/null", 1) == int(e)
    assert started == ["1", "2", "3", "2"] and stopped == ["2", "3"]
    # A server that died between jobs is stopped (its pipe closed) and a new one started.
    fork_server._servers[next(reversed(fork_server._servers))].exit = -9
    assert fork_server.run(["x.py"], {"E": "2"}, "/dev/null", 1) == 2
    assert started[-1] == "2" and stopped == ["2", "3", "2"] and len(fork_server._servers) == 2


def test_an_engine_forked_from_the_server_reports_what_a_plain_process_does(
        checkpoints, prompts, monkeypatch):
    config = OfflineConfig(str(checkpoints("noisy", acceptance=0.6)), 2, "plugin", list(prompts),
                           12, eager="process-start")
    monkeypatch.setenv(LAUNCHER, fork_server.__file__)
    forked = run_config(config)
    monkeypatch.delenv(LAUNCHER)
    plain = run_config(config)
    for key in ("token_ids", "spec_decode", "runner", "plugin_registered", "allocated_bytes"):
        assert forked[key] == plain[key], key
    assert forked["drafter"]["class"] == plain["drafter"]["class"]
    assert 0 < plain["spec_decode"]["num_accepted_tokens"] < plain["spec_decode"]["num_draft_tokens"]


SPAWNED_PROBE = """
import json, sys
torch_at_start = "torch" in sys.modules
import torch._dynamo.output_graph as output_graph
from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
from torch._inductor.codecache import FxGraphCache
print(json.dumps({"torch_at_start": torch_at_start,
                  "graph_name": output_graph.unique_id("__compiled_fn", with_uuid=True),
                  "fx_graph_cache": FxGraphCache._get_tmp_dir(),
                  "aot_autograd_cache": AOTAutogradCache._get_tmp_dir()}))
"""


@pytest.mark.skipif(not os.environ.get("MTP_TEST_TORCH_CACHE"),
                    reason="MTP_TEST_TORCH_CACHE is set only with VLLM_CACHE_ROOT (tests/run.sh sets it)")
def test_processes_started_otherwise_share_the_runs_torch_cache():
    """An interpreter started as vLLM spawns engine cores and workers (this environment, nothing
    preloaded) gets the same patches through the suite's sitecustomize, when torch's compiler is
    imported, not before."""
    done = subprocess.run([sys.executable, "-c", SPAWNED_PROBE], capture_output=True, text=True,
                          timeout=120, check=True)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    shared = os.environ["MTP_TEST_TORCH_CACHE"]
    assert report["torch_at_start"] is False
    assert re.fullmatch(r"__compiled_fn_\d+", report["graph_name"]), report["graph_name"]
    assert report["fx_graph_cache"] == os.path.join(shared, "fxgraph")
    assert report["aot_autograd_cache"] == os.path.join(shared, "aotautograd")
