"""``vllm-mtp doctor``'s parts that need no engine: the sampling test, the verdict rules, the
drafter kind, the reference's arithmetic on recorded data, the engine mode and the JSON report.

The engines themselves: ``test_doctor.py``.
"""

import json

import pytest
import torch

from vllm_mtp_plugin.tools.stats import wilson
from vllm_mtp_plugin.tools.doctor import paired, selftest, verdict
from vllm_mtp_plugin.tools.mtp_layer import evaluation
from vllm_mtp_plugin.tools.doctor.checks import SCHEMA, Check, as_dicts, write_report
from vllm_mtp_plugin.tools.doctor.platform_facts import engine_mode
from vllm_mtp_plugin.tools.doctor.sampling import chi_square_p, homogeneity
from vllm_mtp_plugin.tools.tiny.v4 import build_checkpoint as build_v4
from vllm_mtp_plugin.weights.headers import read_checkpoint
from vllm_mtp_plugin.weights.preflight import drafter_kind

from support.checkpoint_edits import drop, edited_copy


def _samples(probs: torch.Tensor, n: int, seed: int) -> list[int]:
    return torch.multinomial(probs, n, replacement=True,
                             generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_chi_square_tail_matches_known_values():
    # chi-square(1) > 3.841 has probability 0.05; chi-square(10) > 18.307 too
    assert chi_square_p(3.841459, 1) == pytest.approx(0.05, abs=1e-5)
    assert chi_square_p(18.307038, 10) == pytest.approx(0.05, abs=1e-5)


def test_homogeneity_passes_one_distribution_and_fails_a_shifted_one():
    """Groups as sampling-t1 builds them: 12 groups of 48 samples a side, 30-token distributions.
    The shift is what accepting every greedy draft would do: mass moved to the top token."""
    generator = torch.Generator().manual_seed(0)
    groups_same, groups_shifted = [], []
    for g in range(12):
        probs = torch.softmax(torch.randn(30, generator=generator) * 1.5, 0)
        shifted = 0.7 * probs + 0.3 * torch.nn.functional.one_hot(probs.argmax(), 30)
        groups_same.append((_samples(probs, 48, 2 * g), _samples(probs, 48, 2 * g + 1)))
        groups_shifted.append((_samples(probs, 48, 2 * g), _samples(shifted, 48, 2 * g + 1)))
    same, moved = homogeneity(groups_same), homogeneity(groups_shifted)
    assert same["p_value"] > selftest.P_FAIL and same["samples"] == 12 * 48
    assert moved["p_value"] < selftest.P_FAIL
    assert moved["top_token_share"][1] > moved["top_token_share"][0]


PROBE = {"drafts": 400, "accepted": 300, "acceptance": 0.75,
         "interval": wilson(300, 400)}


def _reference(agreement: float, positions: int = 600, distance: float = 0.01,
               served: float | None = None) -> dict:
    served = agreement if served is None else served
    return {"agreement": [agreement, agreement * 0.6], "positions": positions,
            "agreement_interval": wilson(agreement * positions, positions),
            "accepted_by_k": [agreement, agreement * 0.6], "served_output": {
                "agreement": served, "relative_distance": distance,
                "agreement_interval": wilson(served * positions, positions)},
            "sampled": {"temperature": 1.0, "greedy_drafts": 0.3, "probabilistic_drafts": 0.6}}


def test_each_verdict_from_its_figures():
    assert verdict.decide("mtp", [], PROBE, _reference(0.76), None)["verdict"] == "healthy"
    low = {**PROBE, "accepted": 100, "acceptance": 0.25, "interval": wilson(100, 400)}
    decided = verdict.decide("mtp", [], low, _reference(0.76), None)
    assert decided["verdict"] == "serving-mismatch"
    assert "the served layer computes what the files say" in decided["causes"][0]
    broken_layer = verdict.decide("mtp", [], low, _reference(0.76, distance=0.4, served=0.2), None)
    assert "computes something else than the files' layer" in broken_layer["causes"][0]
    # Ten points lower, intervals apart, and the served layer computes something else: a loading
    # fault (enorm/hnorm swapped cost the trained tiny model 0.72 -> 0.62), though not "far below".
    slightly = {**PROBE, "accepted": 248, "acceptance": 0.62, "interval": wilson(248, 400)}
    assert verdict.decide("mtp", [], slightly, _reference(0.72), None)["verdict"] == "healthy"
    swapped = verdict.decide("mtp", [], slightly, _reference(0.72, distance=0.5, served=0.63), None)
    assert swapped["verdict"] == "serving-mismatch"
    assert "computes something else than the files' layer" in swapped["causes"][0]
    both_low = {**PROBE, "accepted": 120, "acceptance": 0.3, "interval": wilson(120, 400)}
    mismatch = verdict.decide("mtp", [], both_low, _reference(0.3), None)
    assert mismatch["verdict"] == "layer-mismatch"
    assert "vllm-mtp train MODEL --init checkpoint" in mismatch["next"][0]
    assert verdict.decide("dspark", ["p"], None, None, None)["verdict"] == "not-mtp"
    assert verdict.decide("none", [], None, None, None)["verdict"] == "not-mtp"
    assert verdict.decide("mtp", ["bad shape"], None, None, None) == {
        "verdict": "refused", "reasons": ["bad shape"], "causes": [],
        "next": ["fix what the start-up check names, then run vllm-mtp doctor again"]}
    assert verdict.decide("mtp", [], PROBE, None, None, reason="V4")["verdict"] == "undetermined"


def test_within_noise_is_not_a_serving_mismatch():
    """0.55 served over 40 drafts vs 0.76 own over 100 positions: below the ratio, but the
    intervals overlap, so healthy."""
    near = {"drafts": 40, "accepted": 22, "acceptance": 0.55, "interval": wilson(22, 40)}
    assert verdict.decide("mtp", [], near, _reference(0.76, positions=100), None)["verdict"] == \
        "healthy"


def test_advice_names_k_and_the_draft_method_from_the_figures():
    lines = verdict.advice(_reference(0.8), PROBE)
    assert "k = 1: 1.80, k = 2: 2.28" in lines[0]
    assert '"draft_sample_method": "probabilistic"' in lines[1]


def test_drafter_kind(checkpoints, tmp_path):
    def kind(path):
        config = json.loads((path / "config.json").read_text())
        return drafter_kind(read_checkpoint(path)[0], config)

    oracle = checkpoints("oracle")
    assert kind(oracle) == "mtp"
    bare = edited_copy(oracle, tmp_path / "bare", tensors=drop("model.layers.2."),
                       num_nextn_predict_layers=0)
    assert kind(bare) == "none"
    undeclared = edited_copy(oracle, tmp_path / "undeclared", num_nextn_predict_layers=0)
    assert kind(undeclared) == "mtp"  # the start-up check says: declare it
    v4 = build_v4(tmp_path / "v4", "random")
    assert kind(v4) == "mtp"
    assert kind(edited_copy(v4, tmp_path / "dspark", tensors=drop("mtp.0.enorm.", "mtp.0.hnorm."))
                ) == "dspark"


def test_every_selftest_engine_runs_in_the_platforms_default_mode(tmp_path):
    cp = selftest.Checkpoints(tmp_path / "served", {"oracle": tmp_path / "o", "noisy": tmp_path / "n"},
                              tmp_path / "two", 2)
    plans = selftest.engine_plans(cp, "float32", ["x", "y"], tensor_parallel=2)
    configs = {name: plan.config for name, plan in plans.items()}
    assert {name: (c.default_process_mode, c.eager, c.runner) for name, c in configs.items()} == {
        name: (True, None, None) for name in plans}
    assert configs["noisy-tp"].llm_kwargs["tensor_parallel_size"] == 2
    assert plans["noisy-tp"].env == selftest.cpu_thread_binding(2)
    assert configs["noisy-in-tree"].impl == "in-tree"
    # One directory for the one-layer checkpoints (one compile key), each engine's weights named.
    assert {c.model for n, c in configs.items() if n != "two-layers"} == {str(cp.served)}
    assert plans["oracle-k2"].weights == cp.weights["oracle"]
    assert plans["target"].weights == plans["noisy"].weights == cp.weights["noisy"]

    class Graphs:
        @staticmethod
        def support_static_graph_mode():
            return True

    class NoGraphs(Graphs):
        @staticmethod
        def support_static_graph_mode():
            return False

    assert engine_mode(Graphs())["captured_graphs"] and not engine_mode(NoGraphs())["captured_graphs"]
    assert selftest.expected_draft_layers("v1", 2, 2) == [2, 2]
    assert selftest.expected_draft_layers("v2", 2, 2) == [2, 3]


def test_the_json_report(tmp_path):
    path = tmp_path / "r.json"
    write_report(path, {"checks": as_dicts([Check("a", "pass", "fine", {"x": 1.5})]),
                        "work": str(tmp_path)})
    report = json.loads(path.read_text())
    assert report["schema"] == SCHEMA
    assert report["checks"] == [{"name": "a", "status": "pass", "summary": "fine",
                                 "figures": {"x": 1.5}}]
    assert report["work"].startswith("$TMP")  # no host path in a report a user pastes
    with pytest.raises(ValueError, match="status 'ok'"):
        Check("a", "ok", "")


def test_reference_figures_on_recorded_data(tmp_path):
    """A shard whose served output is the files' layer output: distance 0, agreements equal; a
    shard whose served output is scaled: a distance the verdict reads as a loading problem."""
    from vllm_mtp_plugin.tools.tiny import trained
    from vllm_mtp_plugin.tools.mtp_layer.shard_format import write_shard
    from vllm_mtp_plugin.tools.mtp_layer.transformers_layer import FrozenTarget, mtp_forward, transformers_config
    from vllm_mtp_plugin.tools.mtp_layer.trainable import initial_layer
    from vllm_mtp_plugin.tools.mtp_layer.v3_target import open_target

    model = trained.write_checkpoint(tmp_path / "model", 1)
    target = open_target(model)
    config = transformers_config(target.config)
    layer = initial_layer(target, config, "checkpoint", 0).eval()
    frozen = FrozenTarget(config, target.float_tensor("model.embed_tokens.weight"),
                          target.float_tensor("lm_head.weight"))
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(10, 500, (20,), generator=generator).tolist() for _ in range(3)]
    hidden = [torch.randn(20, config.hidden_size, generator=generator) for _ in sequences]
    nxt = [7, 8, 9]
    with torch.no_grad():
        outputs = [mtp_forward(layer, frozen, h[None], torch.tensor(s[1:] + [t])[None],
                               torch.arange(20)[None])[0] for h, s, t in zip(hidden, sequences, nxt)]
    for name, scale in (("same", 1.0), ("scaled", 3.0)):
        data = tmp_path / name
        data.mkdir()
        write_shard(data / "shard-00000.safetensors", sequences, nxt, hidden, [5, 5, 5], {},
                    [o * scale for o in outputs])
        figures = evaluation.evaluate(model, data, depth=2, unroll="recursive", device="cpu")
        assert figures["positions"] == 3 * (19 - 4)  # continuation positions 4..18
        served = figures["served_output"]
        if scale == 1.0:
            assert served["relative_distance"] < 1e-4
            assert served["agreement"] == figures["agreement"][0]
        else:
            assert served["relative_distance"] == pytest.approx(2.0, rel=1e-3)
        assert figures["accepted_by_k"][0] == figures["agreement"][0]
        assert figures["accepted_by_k"][1] <= figures["accepted_by_k"][0]
        assert 0 < figures["sampled"]["greedy_drafts"] < 1


def test_tensor_parallel_ranks_get_their_cores_on_a_cpu(monkeypatch):
    """vLLM refuses TP = 2 on one NUMA node unless the ranks' cores are named."""
    import os

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    cores = sorted(os.sched_getaffinity(0))
    binding = selftest.cpu_thread_binding(2)["VLLM_CPU_OMP_THREADS_BIND"]
    groups = binding.split("|")
    assert len(groups) == 2 and groups[0].startswith(str(cores[0]))
    assert selftest.cpu_thread_binding(1) == {}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    assert selftest.cpu_thread_binding(2) == {}  # the user's own binding stands


def _batch(*speedups: float) -> dict:
    return {"acceptance_length_k1": 1.7, "rows": [
        {"batch_size": c, "modelled_speedup": s, "measured_speedup": s + 0.01,
         "tok_s_without": 100.0, "tok_s_k1": 100.0 * s}
        for c, s in zip((1, 8, 32), speedups)]}


@pytest.mark.parametrize("speedups, verdict_text", [
    ((1.6, 1.3, 1.1), "MTP pays at every batch size measured"),
    ((1.4, 1.1, 0.8), "MTP pays up to batch 8 and loses from batch 32"),
    ((0.9, 0.8, 0.7), "MTP costs more than it gains at every batch size"),
    # a batch size within the break-even band is not called a loss (or a gain)
    ((0.97, 0.8, 0.7), "MTP costs more than it gains at batch 8, 32 on this machine, about "
                       "breaks even at batch 1"),
    ((1.3, 1.2, 1.01), "MTP pays at batch 1, 8, about breaks even at batch 32"),
    ((1.02, 0.99, 1.0), "MTP about breaks even"),
])
def test_batch_size_advice_from_the_measured_speedups(speedups, verdict_text):
    from vllm_mtp_plugin.tools.doctor.batch import batch_advice

    [line] = batch_advice(_batch(*speedups))
    assert line.startswith("batch size: k = 1 against no speculation")
    assert verdict_text in line
    assert ("VLLM_MTP_ADAPTIVE_K=1 has the engine choose k" in line) == ("loses from" in line)
    assert f"batch 1: {speedups[0]:.2f}x (measured {speedups[0] + 0.01:.2f}x)" in line
    assert batch_advice(None) == [] and batch_advice({"rows": []}) == []


def test_batch_sizes_option():
    import argparse

    from vllm_mtp_plugin.tools.doctor.cli import _batch_sizes, parse_args

    assert _batch_sizes("1,8, 32") == (1, 8, 32) and _batch_sizes("none") == ()
    for bad in ("0,8", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="give batch sizes >= 1"):
            _batch_sizes(bad)
    args, extra = parse_args(["m", "--batch-sizes", "2,4", "--max-num-seqs", "4"])
    assert args.batch_sizes == (2, 4) and extra == ["--max-num-seqs", "4"]


def test_served_drafts_pair_with_the_layers_own_at_their_positions():
    """The served trajectory (k = 1: one position further after a rejection, two after an
    acceptance), a request whose text parts from the reference's, and the verdict on the pairs."""
    assert list(paired.served_positions(5, [1, 0, 1, 0], [1, 1, 1, 1])) == [
        (4, True), (6, False), (7, True), (9, False)]
    tokens = list(range(100, 120))  # prompt 100..104, then the target's continuation
    agree = [True] * 13  # the layer's own draft is right at every position 4..16
    sequence = {"tokens": tokens, "start": 4, "agree": agree}
    request = {"prompt_token_ids": tokens[:5], "token_ids": tokens[5:],
               "accepted_per_step": [1, 0, 1, 0, 1, 1, 1], "drafted_per_step": [1] * 7}
    result = paired.pair([sequence], [request])
    assert (result["pairs"], result["both"], result["lost"], result["gained"]) == (7, 5, 2, 0)
    assert result["drop"] == pytest.approx(2 / 7) and result["own"] == 1.0
    # Texts that part at token 10: drafts whose next-next token lies there or later do not pair.
    parted = {**request, "token_ids": tokens[5:10] + [1] + tokens[11:]}
    assert paired.pair([sequence], [parted])["pairs"] == 3  # positions 4, 6, 7
    assert paired.pair([sequence], [{**request, "prompt_token_ids": [1, 2]}]) is None
    # Faithful serving: no discordant pair, a narrow interval around 0; a drop of 0.05 over 400
    # pairs (22 lost, 2 gained) is told, the same counts over 60 pairs are too few to use.
    assert paired.drop_interval(0, 0, 400)[1] < 0.01
    told = {"pairs": 400, "drop": 20 / 400, "drop_interval": paired.drop_interval(22, 2, 400),
            "served": 0.62, "own": 0.67}
    assert paired.tells_a_serving_drop(told) is True
    assert paired.tells_a_serving_drop({**told, "pairs": 60}) is None
    near_ties = {**told, "drop": 3 / 400, "drop_interval": paired.drop_interval(5, 2, 400)}
    assert paired.tells_a_serving_drop(near_ties) is False
    base = {**PROBE, "accepted": 248, "acceptance": 0.62, "interval": wilson(248, 400)}
    assert verdict.decide("mtp", [], {**base, "paired": told}, _reference(0.66), None)[
        "verdict"] == "serving-mismatch"
    assert verdict.decide("mtp", [], {**base, "paired": near_ties}, _reference(0.66), None)[
        "verdict"] == "healthy"
