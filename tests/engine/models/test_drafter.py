"""Our drafter inside a live engine (in this process): what it shares, what it allocates, its logits."""

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from vllm_mtp_plugin.tools.engine.eager_reasons import eager_for
from vllm_mtp_plugin.models.predictor import MTPLayerStack

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)


@pytest.fixture(scope="module")
def engine(checkpoints):
    from vllm import LLM

    model = checkpoints("noisy", acceptance=0.6, num_nextn_predict_layers=2)
    llm = LLM(str(model), enforce_eager=eager_for("load-time"), distributed_executor_backend="uni",
              max_model_len=512, dtype="float32",
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    yield llm, model
    del llm


def inspect_drafter(llm, fn):
    return llm.collective_rpc(lambda worker: fn(worker.model_runner))[0]


def test_drafter_uses_the_targets_embedding_and_head(engine):
    llm, _ = engine

    def check(runner):
        draft, target = runner.drafter.model, runner.model
        target_ptrs = {p.data_ptr() for p in target.parameters()}
        own_vocab_sized = [n for n, p in draft.named_parameters()
                           if p.data_ptr() not in target_ptrs and 2048 in p.shape]
        return {
            "class": type(draft).__name__,
            "module": type(draft).__module__,
            "embed_shared": draft.model.embed_tokens is target.model.embed_tokens,
            "head_shared": draft.lm_head is target.lm_head,
            "own_vocab_sized": own_vocab_sized,
            "layers": sorted(draft.model.layers),
        }

    result = inspect_drafter(llm, check)
    assert (result["module"], result["class"]) == ("vllm_mtp_plugin.models.v3", "DeepSeekMTP")
    assert result["embed_shared"] and result["head_shared"]
    assert result["own_vocab_sized"] == []
    assert result["layers"] == ["2", "3"]  # keyed by absolute layer index


def test_logits_equal_the_checkpoint_head_over_the_shared_head_norm(engine):
    """What the in-tree class computes: shared_head.head(shared_head.norm(h)) with the checkpoint's
    own head copy. Ours uses the target's lm_head; the numbers must be the same."""
    llm, model = engine
    tensors = load_file(str(model / "model.safetensors"))
    hidden = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))

    for step, layer in ((0, 2), (1, 3), (2, 2)):
        logits = inspect_drafter(llm, lambda r: r.drafter.model.compute_logits(hidden, step).cpu())
        norm_w = tensors[f"model.layers.{layer}.shared_head.norm.weight"]
        head_w = tensors[f"model.layers.{layer}.shared_head.head.weight"]
        normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w
        expected = normed @ head_w.T
        assert logits.shape == (5, 2048)
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_spec_step_picks_layer_modulo_the_number_of_layers():
    class Layer(nn.Module):
        def __init__(self, vllm_config, prefix):
            super().__init__()
            self.prefix = prefix

    hf = SimpleNamespace(num_hidden_layers=61, num_nextn_predict_layers=3)
    config = SimpleNamespace(speculative_config=SimpleNamespace(
        draft_model_config=SimpleNamespace(hf_config=hf)))
    stack = MTPLayerStack(config, Layer, prefix="model")
    assert [stack.layer_for_step(s).prefix for s in range(5)] == [
        "model.layers.61", "model.layers.62", "model.layers.63", "model.layers.61", "model.layers.62"]
