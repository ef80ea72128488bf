"""``vllm-mtp doctor`` without a model, end to end: every check passes on this machine in vLLM's
default engine mode (compiled, engine core spawned, vLLM's runner), and the JSON lists each check
with its figures.

Its engines are also the suite's proof that vLLM's default process mode (engine core spawned, the
whole config pickled into it) serves the plugin as the in-process shortcut does: the drafter is the
plugin's class and vLLM's comes back with the plugin off, the tokens and every spec-decode counter
of the two are equal, and the tokens are the target's own (``test_default_process_mode.py`` has
the rest: a load error through the engine core, ``draft_model`` unaffected).
"""

import json

import pytest

from vllm_mtp_plugin.tools.doctor.cli import main
from vllm_mtp_plugin.tools.doctor.selftest import K, K_ORACLE

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

OURS = "vllm_mtp_plugin.models.v3:DeepSeekMTP"
IN_TREE = "vllm.model_executor.models.deepseek_mtp:DeepSeekMTP"
SELFTEST_CHECKS = ["plugin-serves", *(f"oracle-k{k}" for k in K_ORACLE), "noisy-lossless",
                   "plugin-equals-in-tree", "layer-per-step", "sampling-t1", "tensor-parallel"]


def test_selftest_passes_in_the_default_engine_mode(tmp_path, capsys):
    report_path, work = tmp_path / "doctor.json", tmp_path / "work"
    code = main(["--json", str(report_path), "--work-dir", str(work)])
    out = capsys.readouterr().out
    report = json.loads(report_path.read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == SELFTEST_CHECKS, out
    failed = {n: c["summary"] for n, c in checks.items() if c["status"] == "fail"}
    assert failed == {} and code == 0, out
    assert checks["tensor-parallel"]["status"] == "skip"  # a CPU is one device
    assert checks["plugin-serves"]["figures"]["drafter"] == OURS
    assert checks["plugin-serves"]["figures"]["compilation"] != "eager"
    for k in K_ORACLE:
        figures = checks[f"oracle-k{k}"]["figures"]
        assert figures["num_accepted_tokens"] == figures["num_draft_tokens"] == k * figures[
            "num_drafts"] > 0
    in_tree = checks["plugin-equals-in-tree"]["figures"]
    assert in_tree["counters"] == in_tree["other_counters"]
    assert in_tree["other_drafter"] == IN_TREE and in_tree["identical_tokens"] is True
    noisy = checks["noisy-lossless"]["figures"]  # tokens identical to k = 0's, some drafts rejected
    assert noisy["identical_to_k0"] is True
    assert 0 < noisy["num_accepted_tokens"] < noisy["num_draft_tokens"] == K * noisy["num_drafts"]
    for engine in ("noisy", "noisy-in-tree", "target"):  # each engine core a process of its own
        assert "(EngineCore pid=" in (work / "logs" / f"{engine}.log").read_text(errors="replace")
    assert checks["layer-per-step"]["figures"]["layers_seen"] == [2, 2]  # V1: layer L each step
    sampling = checks["sampling-t1"]["figures"]
    assert sampling["samples"] > 400 and sampling["num_drafts"] > 0
    assert report["platform"]["platform"] == "cpu"
    assert report["platform"]["engine_mode"]["captured_graphs"] is False
    assert all(e["runner"] == "v1" and e["compilation"] != "eager" for e in
               report["engines"].values())
