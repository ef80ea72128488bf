"""The quick run stays quick: a test under tests/unit/ that starts vLLM fails, naming what it
started (``tests/conftest.py``, the engine marker); these tests are such tests' first steps."""

import subprocess
import sys

import pytest

from vllm_mtp_plugin.tools.engine import offline, server

REFUSED = "it belongs under tests/engine/"


def test_a_process_running_vllm_is_refused():
    with pytest.raises(RuntimeError, match=f"starts vLLM \\(a process: .*{REFUSED}"):
        subprocess.Popen([sys.executable, "-c", "import vllm"])
    with pytest.raises(RuntimeError, match=REFUSED):
        subprocess.Popen(["vllm-mtp", "serve", "model"])


def test_an_offline_engine_and_a_server_are_refused():
    with pytest.raises(RuntimeError, match=f"offline.run_config\\): {REFUSED}"):
        offline._launcher()
    with pytest.raises(RuntimeError, match=f"a vllm-mtp serve server\\): {REFUSED}"):
        server.Server.start(None)


def test_other_processes_run():
    done = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True)
    assert done.stdout.strip() == "42"
