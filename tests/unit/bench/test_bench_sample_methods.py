"""The benchmark's speculative sampling axes (``--draft-sample-method``,
``--rejection-sample-method``): which configurations a sweep runs, what reaches vLLM's
speculative config in offline and serve mode, and how rows show them. No engine starts here."""

import json
from pathlib import Path

import pytest

from vllm_mtp_plugin.tools.bench import analysis, report
from vllm_mtp_plugin.tools.tiny.presets import Checkpoint
from vllm_mtp_plugin.tools.bench.cli import parse_args
from vllm_mtp_plugin.tools.bench.offline_mode import offline_config
from vllm_mtp_plugin.tools.bench.serve_mode import serve_args
from vllm_mtp_plugin.tools.bench.sweep import Config, Sweep

PROBABILISTIC = {"draft_sample_method": "probabilistic"}
BLOCK = {"rejection_sample_method": "block"}


def _sweep(**kwargs) -> Sweep:
    return Sweep(checkpoints=["x"], impls=["plugin"], ks=[0, 2],
                 draft_sample_methods=["greedy", "probabilistic"],
                 rejection_sample_methods=["standard", "block"], **kwargs)


def test_each_speculative_row_gets_every_combination_and_k0_runs_once():
    configs = _sweep().configs()
    assert [(c.k, c.sample_methods()) for c in configs] == [
        (0, {}), (2, {}), (2, BLOCK), (2, PROBABILISTIC), (2, {**PROBABILISTIC, **BLOCK})]
    assert len({c.label() for c in configs}) == len({(c.k, c.log_suffix()) for c in configs}) == 5
    assert configs[4].label() == ("x plugin k=2 c=1 draft_sample_method=probabilistic "
                                  "rejection_sample_method=block")
    # the baseline records no sampling method (nothing is drafted), whatever comes first
    only = Sweep(checkpoints=["x"], ks=[0, 1], draft_sample_methods=["probabilistic"])
    k0 = only.configs()[0]
    assert k0.sample_methods() == {} and k0.recorded_sample_methods() == {
        "draft_sample_method": None, "rejection_sample_method": None}
    with pytest.raises(ValueError, match="draft_sample_methods"):
        Sweep(draft_sample_methods=["argmax"])
    with pytest.raises(ValueError, match="rejection_sample_methods"):
        Sweep(rejection_sample_methods=[])


def test_the_methods_reach_the_speculative_config_offline_and_served():
    sweep = _sweep(floor=False)
    ckpt = Checkpoint("x", Path("/ckpt"), {})
    both = Config("x", "plugin", 2, 1, draft_sample_method="probabilistic",
                  rejection_sample_method="block")
    offline = offline_config(sweep, ckpt, both, sweep.passes({"all": ["Hello"]}))
    assert offline.speculative_overrides == {**PROBABILISTIC, **BLOCK}
    # vLLM's defaults are left to vLLM: the default sweep passes nothing new
    assert offline_config(sweep, ckpt, Config("x", "plugin", 2, 1),
                          sweep.passes({"all": ["Hello"]})).speculative_overrides == {}
    args = serve_args(sweep, 2, "float32", sample_methods=both.sample_methods())
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec == {"method": "mtp", "num_speculative_tokens": 2, **PROBABILISTIC, **BLOCK}
    assert "--speculative-config" not in serve_args(sweep, 0, "float32",
                                                    sample_methods=both.sample_methods())


def test_cli_axes():
    args = parse_args(["offline", "--draft-sample-method", "greedy", "probabilistic",
                       "--rejection-sample-method", "block"])
    assert args.draft_sample_methods == ["greedy", "probabilistic"]
    assert args.rejection_sample_methods == ["block"]
    defaults = parse_args(["offline"])
    assert (defaults.draft_sample_methods, defaults.rejection_sample_methods) == (
        ["greedy"], ["standard"])
    with pytest.raises(SystemExit):
        parse_args(["offline", "--draft-sample-method", "random"])


def _row(k, draft=None, rejection=None, impl="plugin"):
    return {"mode": "offline", "checkpoint": "b", "impl": impl, "k": k, "concurrency": 1,
            "temperature": 1.0, "output_tok_s": 10.0 + k + (draft == "probabilistic"),
            "mla_verify": "on", "draft_sample_method": draft, "rejection_sample_method": rejection}


def test_rows_show_the_methods_and_share_the_k0_baseline():
    rows = analysis.add_derived([
        _row(0), _row(2, "greedy", "standard"), _row(2, "probabilistic", "standard"),
        _row(2, "probabilistic", "block"), _row(2, "probabilistic", "standard", "in-tree")])
    assert [r["speedup"] for r in rows[1:4]] == pytest.approx([1.2, 1.3, 1.3])
    # plugin vs in-tree: the same sampling methods only
    assert rows[2]["vs_in_tree"] == pytest.approx(1.0) and rows[3].get("vs_in_tree") is None
    impls = [cells[1] for cells in report.table_rows(rows)]
    assert impls == ["plugin", "plugin", "plugin (draft probabilistic)",
                     "plugin (draft probabilistic, rejection block)",
                     "in-tree (draft probabilistic)"]
    varying = report._varying(rows)
    assert "draft_sample_method" in varying and "rejection_sample_method" in varying
