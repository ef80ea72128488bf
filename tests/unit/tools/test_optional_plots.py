"""Every picture a command draws is optional: without matplotlib (vLLM's requirements do not
bring it) bench, tune and build-tiny finish and say which picture they left out
(``tools/plotting.py``); ``vllm-mtp train``: ``test_train_pipeline.py``."""

import sys

import pytest

from vllm_mtp_plugin.tools.bench import report
from vllm_mtp_plugin.tools.tiny import trained
from vllm_mtp_plugin.tools.tune import plot as tune_plot
from vllm_mtp_plugin.tools.tune.results import Acceptance, MethodChoice, TuneResult

LEFT_OUT = "not drawn: matplotlib is not installed (pip install matplotlib draws it next time)"


@pytest.fixture
def no_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError


def test_each_picture_is_left_out_with_one_line(no_matplotlib, tmp_path, capsys):
    assert report.plot_all([{"k": 1}], tmp_path) == []
    assert tune_plot.expected({}, tmp_path / "tune.png") is None
    assert tune_plot.measured_against_pick([], tmp_path / "check.png", "t") is None
    trained.plot_training({}, tmp_path / "loss.png")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 4 and all(LEFT_OUT in line for line in lines)
    assert [p.name for p in tmp_path.iterdir()] == []


def test_with_matplotlib_the_picture_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    choice = MethodChoice(best_fixed_k={1: 1}, expected_tok_s={1: {0: 10.0, 1: 12.0}},
                          acceptance=Acceptance([1.0, 1.2], {}))
    data = TuneResult(schedule=[[1, 1, 1]], speculative_config=None, draft_sample_method="greedy",
                      choices={"greedy": choice}, ks_measured=[0, 1], compilation=[],
                      measurements=[{"concurrency": 1, "k": 0, "measured_tok_s": 10.0},
                                    {"concurrency": 1, "k": 1, "measured_tok_s": 12.5}],
                      settings={"max_k": 1})
    assert tune_plot.expected(data, tmp_path / "tune.png").stat().st_size > 1000
