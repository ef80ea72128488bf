"""``vllm-mtp doctor`` without a model, end to end: every check passes on this machine in vLLM's
default engine mode (compiled, engine core spawned, vLLM's runner), and the JSON lists each check
with its figures.
"""

import json

import pytest

from vllm_mtp_plugin.tools.doctor.cli import main
from vllm_mtp_plugin.tools.doctor.selftest import K_ORACLE

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

SELFTEST_CHECKS = ["plugin-serves", *(f"oracle-k{k}" for k in K_ORACLE), "noisy-lossless",
                   "plugin-equals-in-tree", "layer-per-step", "sampling-t1", "tensor-parallel"]


def test_selftest_passes_in_the_default_engine_mode(tmp_path, capsys):
    report_path = tmp_path / "doctor.json"
    code = main(["--json", str(report_path), "--work-dir", str(tmp_path / "work")])
    out = capsys.readouterr().out
    report = json.loads(report_path.read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == SELFTEST_CHECKS, out
    failed = {n: c["summary"] for n, c in checks.items() if c["status"] == "fail"}
    assert failed == {} and code == 0, out
    assert checks["tensor-parallel"]["status"] == "skip"  # a CPU is one device
    assert checks["plugin-serves"]["figures"]["drafter"].startswith("vllm_mtp_plugin.")
    assert checks["plugin-serves"]["figures"]["compilation"] != "eager"
    for k in K_ORACLE:
        figures = checks[f"oracle-k{k}"]["figures"]
        assert figures["num_accepted_tokens"] == figures["num_draft_tokens"] == k * figures[
            "num_drafts"] > 0
    in_tree = checks["plugin-equals-in-tree"]["figures"]
    assert in_tree["counters"] == in_tree["other_counters"]
    assert not in_tree["other_drafter"].startswith("vllm_mtp_plugin.")
    assert checks["layer-per-step"]["figures"]["layers_seen"] == [2, 2]  # V1: layer L each step
    sampling = checks["sampling-t1"]["figures"]
    assert sampling["samples"] > 400 and sampling["num_drafts"] > 0
    assert report["platform"]["platform"] == "cpu"
    assert report["platform"]["engine_mode"]["captured_graphs"] is False
    assert all(e["runner"] == "v1" and e["compilation"] != "eager" for e in
               report["engines"].values())
