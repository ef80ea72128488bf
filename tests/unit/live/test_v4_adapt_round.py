"""The offline half of a live-training round for a DeepSeek-V4 layer, with the arguments ``--adapt``
gives (``tools/live/adapt.py`` runs ``vllm-mtp train SERVING --data ... --work-dir ... --steps ...``
and ``tools.live.evaluate`` in processes of their own; here in this one): recorded states of a V4 target in the shard
format, a stale layer served (built to agree 3 times in 10), the candidate trained on them agrees
more often on held-out shards, beyond noise. Recording and swapping while vLLM serves V4 are not
in this test."""

import json

import torch

from vllm_mtp_plugin.tools.live import evaluate
from vllm_mtp_plugin.tools.live.adapt import better_beyond_noise
from vllm_mtp_plugin.tools.mtp_layer import transformers_v4_layer as reference
from vllm_mtp_plugin.tools.mtp_layer.shard_format import write_shard
from vllm_mtp_plugin.tools.tiny.v4 import build_checkpoint
from vllm_mtp_plugin.tools.train import cli


def recorded(directory, target, sequences, seed):
    ids = torch.randint(2, 2048, (sequences, 48), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad(), reference.residual_before_hc_head(target) as caught:
        target(ids, use_cache=False)
    states = caught["hidden"][:, :-1].flatten(-2).to(torch.bfloat16)  # as a bf16 engine records
    directory.mkdir()
    write_shard(directory / "shard-00000.safetensors", [row[:-1].tolist() for row in ids],
                [int(row[-1]) for row in ids], list(states), [2] * sequences, {})
    return directory


def test_a_v4_round_trains_a_better_candidate_from_recorded_states(tmp_path):
    serving = build_checkpoint(tmp_path / "serving", "noisy", quantization=None, acceptance=0.3)
    target, _ = reference.load_reference(serving, 0, torch.float32)
    data = recorded(tmp_path / "data", target, 96, seed=1)
    heldout = recorded(tmp_path / "heldout", target, 24, seed=2)
    candidate = tmp_path / "candidate"
    assert cli.main([str(serving), "--data", str(data), "--out", str(candidate), "--work-dir",
                     str(tmp_path / "work"), "--steps", "80", "--quiet"]) == 0
    result = tmp_path / "evaluation.json"
    assert evaluate.main([str(serving), str(candidate), str(heldout), "--out", str(result)]) == 0
    scores = json.loads(result.read_text())
    assert abs(scores["serving"]["agreement"][0] - 0.3) < 0.1  # the stale layer as built
    assert better_beyond_noise(scores["candidate"], scores["serving"]), scores
