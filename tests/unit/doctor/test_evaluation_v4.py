"""The V4 layer evaluated outside vLLM on recorded drafter inputs (``mtp_layer/evaluation_v4.py``):
the shards are written as a recording writes them (the target's residual before its ``hc_head`` at
every token, flattened; the served layer's output streams), from transformers' V4 target. The
oracle layer agrees with the target every time, the noisy one at the rate it was built for; a
served output that is the files' layer's own is at distance 0, another layer's is not."""

import json

import pytest
import torch

from vllm_mtp_plugin.tools.mtp_layer import evaluation
from vllm_mtp_plugin.tools.mtp_layer import transformers_v4_layer as reference
from vllm_mtp_plugin.tools.mtp_layer.evaluation_v4 import evaluate_v4
from vllm_mtp_plugin.tools.mtp_layer.shard_format import write_shard
from vllm_mtp_plugin.tools.mtp_layer.v3_target import TrainInputError
from vllm_mtp_plugin.tools.tiny.v4 import build_checkpoint

pytest.importorskip("transformers.models.deepseek_v4")

SEQUENCES, LENGTH, PROMPT = 8, 64, 2


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4eval")
    return {mode: build_checkpoint(root / mode, mode, seed=0, quantization=None)
            for mode in ("oracle", "noisy")}


def recorded(directory, model_dir, served_by=None):
    """Shards of ``SEQUENCES`` random sequences: states from ``model_dir``'s target, the served
    output from ``served_by``'s layer (default: its own)."""
    target, layer = reference.load_reference(model_dir, 0, torch.float32)
    if served_by is not None:
        _, layer = reference.load_reference(served_by, 0, torch.float32)
    ids = torch.randint(2, 2048, (SEQUENCES, LENGTH), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), reference.residual_before_hc_head(target) as caught:
        target(ids, use_cache=False)
        states = caught["hidden"][:, :-1]  # a recording has no state for the last token
        positions = torch.arange(LENGTH - 1).expand(SEQUENCES, -1)
        outputs = reference.layer_streams(target, layer, states, ids[:, 1:], positions)
    directory.mkdir()
    write_shard(directory / "shard-00000.safetensors", [row[:-1].tolist() for row in ids],
                [int(row[-1]) for row in ids], list(states.flatten(-2)), [PROMPT] * SEQUENCES,
                {}, drafter_output=list(outputs.flatten(-2)))
    return directory


def test_the_oracle_layer_agrees_every_time_and_its_served_output_is_its_own(checkpoints,
                                                                              tmp_path):
    data = recorded(tmp_path / "oracle", checkpoints["oracle"])
    figures = evaluate_v4(checkpoints["oracle"], data, depth=2, by_sequence=True)
    # positions from the prompt's last token to the third-last recorded one
    assert figures["positions"] == SEQUENCES * (LENGTH - 1 - 2 - (PROMPT - 1) + 1)
    assert figures["agreement"][0] == 1.0
    assert figures["served_output"]["agreement"] == 1.0
    assert figures["served_output"]["relative_distance"] < 1e-5
    assert figures["accepted_by_k"][1] <= figures["accepted_by_k"][0] == 1.0
    assert len(figures["by_sequence"]) == SEQUENCES
    assert evaluation.evaluate(checkpoints["oracle"], data, 2, "recursive") == {
        k: v for k, v in figures.items() if k != "by_sequence"}  # the V3 entry point dispatches


def test_the_noisy_layer_agrees_at_its_rate_and_another_served_layer_shows(checkpoints,
                                                                          tmp_path):
    expected = json.loads((checkpoints["noisy"] / "tiny_meta.json").read_text())[
        "expected_acceptance"]
    data = recorded(tmp_path / "noisy", checkpoints["noisy"])
    figures = evaluate_v4(checkpoints["noisy"], data, depth=1)
    sigma = (expected * (1 - expected) / figures["positions"]) ** 0.5
    assert abs(figures["agreement"][0] - expected) < 3 * sigma, (figures["agreement"], expected)
    assert 0 < figures["sampled"]["greedy_drafts"] < 1
    # the noisy layer's output served where the files hold the oracle's: the distance shows it
    served_elsewhere = recorded(tmp_path / "mismatch", checkpoints["oracle"],
                                served_by=checkpoints["noisy"])
    mismatch = evaluate_v4(checkpoints["oracle"], served_elsewhere, depth=1)
    assert mismatch["agreement"][0] == 1.0
    assert mismatch["served_output"]["relative_distance"] > 0.1
    assert mismatch["served_output"]["agreement"] < 1 - 3 * sigma


def test_states_of_another_width_are_refused(checkpoints, tmp_path):
    narrow = tmp_path / "narrow"
    narrow.mkdir()
    write_shard(narrow / "shard-00000.safetensors", [[1, 2, 3]], [4], [torch.zeros(3, 256)],
                [1], {})
    with pytest.raises(TrainInputError, match="states of width 256.*reads 1024"):
        evaluate_v4(checkpoints["noisy"], narrow, depth=1)
