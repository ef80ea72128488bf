"""The trained tiny DeepSeek's files and a shard of training data written without vLLM: the
``vllm-mtp train`` tests' inputs (``tests/unit/train``, and the world-size run in
``tests/engine/train``). Training data here is written directly in the collector's shard format
from the model's own forward (transformers)."""

import pytest
import torch

from vllm_mtp_plugin.tools.tiny import trained
from vllm_mtp_plugin.tools.mtp_layer.shard_format import write_shard
from vllm_mtp_plugin.tools.train.trainer import TrainSettings


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-pipeline")
    return (trained.write_checkpoint(root / "full", 1), trained.write_checkpoint(root / "bare", 0))


@pytest.fixture(scope="module")
def data(models, tmp_path_factory):
    """24 sequences of held-out-like text with the target's final-norm states."""
    from transformers import DeepseekV3ForCausalLM

    full, _ = models
    model = DeepseekV3ForCausalLM.from_pretrained(full, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    sequences, hidden, nxt = [], [], []
    for n in range(24):
        ids = torch.randint(2, 4096, (1, 20 + n % 7), generator=gen)
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True)
        sequences.append(ids[0].tolist())
        hidden.append(out.hidden_states[-1][0].to(torch.bfloat16))
        nxt.append(int(out.logits[0, -1].argmax()))
    directory = tmp_path_factory.mktemp("data")
    write_shard(directory / "shard-00000.safetensors", sequences, nxt, hidden, [5] * 24, {})
    return directory


def settings(**overrides):
    return TrainSettings(**{"steps": 6, "batch_size": 4, "eval_every": 3, "checkpoint_every": 2,
                            "held_out_fraction": 0.2, "init": "scratch", **overrides})
