"""The tiny V3 checkpoints tell a mis-mapped drafter from the real one.

Their RMSNorm weights are random gains and their router biases random (``tools/tiny/v3.py``), so a
weight map that swaps ``enorm``/``hnorm`` or loads ``e_score_correction_bias`` as zeros computes
something else. Here our drafter and vLLM's in-tree ``DeepSeekMTP`` are built the way vLLM's worker
builds them (one process, gloo world of 1), loaded from the same noisy checkpoint, and run on the
same inputs: with the real weight map both give the same hidden states and logits; with a swapped
or bias-dropping map ours does not. Without attention metadata (as in vLLM's profiling run) the MLA
attention returns zeros; the fusion, the MoE block with its router, ``shared_head.norm`` and the
head all run.
"""

import dataclasses

import pytest
import torch
from support.drafters import (engine_config, load_drafter, single_process_vllm,
                              v3_target_embedding_and_head)

from vllm_mtp_plugin.weights.rules import Rule

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

L = 2  # the tiny target has 2 layers: the MTP layer is layer 2
TOKENS = 7

# Loads enorm.weight into hnorm and hnorm.weight into enorm (a placeholder name in between).
SWAP_NORMS = (Rule(r"\.enorm\.weight$", ".swapped_norm.weight"),
              Rule(r"\.hnorm\.weight$", ".enorm.weight"),
              Rule(r"\.swapped_norm\.weight$", ".hnorm.weight"))
# Loads every router bias as zeros (what a map that drops it to its initial value would leave).
ZERO_ROUTER_BIAS = (Rule(r"\.e_score_correction_bias$", ".e_score_correction_bias",
                         transform=lambda tensor, param: torch.zeros_like(tensor)),)


@pytest.fixture(scope="module")
def noisy(checkpoints):
    return checkpoints("noisy", acceptance=0.6)


@pytest.fixture(scope="module")
def vllm_config(noisy):
    with single_process_vllm(engine_config(noisy, "float32")) as config:
        yield config


@pytest.fixture(scope="module")
def tensors(noisy):
    from safetensors.torch import load_file

    return load_file(str(noisy / "model.safetensors"))


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 2048, (TOKENS,), generator=g)
    positions = torch.arange(TOKENS)
    hidden = torch.randn(TOKENS, 256, generator=g)
    return ids, positions, hidden


def run_drafter(vllm_config, tensors, inputs, model_cls, renames=None):
    """Build ``model_cls``, load the checkpoint (through a broken map when ``renames`` is given),
    run one draft step: (hidden for the head, hidden fed back, logits). The attention and MoE
    layers are registered by name in the config's forward context, so each model is built and run
    before the next one replaces them."""
    from vllm.forward_context import set_forward_context

    def break_map(drafter):
        broken = dataclasses.replace(drafter.weight_map(), renames=renames)
        drafter.weight_map = lambda: broken

    drafter = load_drafter(vllm_config, tensors, cls=model_cls,
                              before_loading=break_map if renames is not None else None)
    if not hasattr(drafter.model, "embed_tokens"):  # ours: the target's parts, as vLLM attaches them
        drafter.model.embed_tokens, drafter.lm_head = v3_target_embedding_and_head(tensors)
    ids, positions, hidden = inputs
    with torch.no_grad(), set_forward_context(None, vllm_config):
        pre_norm, fed_back = drafter(ids, positions, hidden)
        logits = drafter.compute_logits(pre_norm)
    return pre_norm, fed_back, logits


@pytest.fixture(scope="module")
def in_tree(vllm_config, tensors, inputs):
    from vllm.model_executor.models.deepseek_mtp import DeepSeekMTP

    return run_drafter(vllm_config, tensors, inputs, DeepSeekMTP)


def ours(vllm_config, tensors, inputs, renames=None):
    from vllm_mtp_plugin.models.v3 import DeepSeekMTP

    return run_drafter(vllm_config, tensors, inputs, DeepSeekMTP, renames)


def test_the_checkpoint_has_no_neutral_norms_or_biases(tensors):
    enorm, hnorm = tensors[f"model.layers.{L}.enorm.weight"], tensors[f"model.layers.{L}.hnorm.weight"]
    assert (enorm - hnorm).abs().max() > 0.3
    for name, value in tensors.items():
        if name.endswith("norm.weight"):
            assert (value - 1).abs().max() > 0.3, name
        if name.endswith("e_score_correction_bias"):
            assert value.abs().min() > 0 and value.std() > 0.03, name


def test_real_map_equals_the_in_tree_class(vllm_config, tensors, inputs, in_tree):
    for mine, theirs in zip(ours(vllm_config, tensors, inputs), in_tree):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    # Inputs of one scale and logits that vary: the comparison is not of zeros.
    assert in_tree[2].std() > 0.1


@pytest.mark.parametrize("renames", [SWAP_NORMS, ZERO_ROUTER_BIAS], ids=["enorm-hnorm-swapped",
                                                                        "router-bias-zeroed"])
def test_a_broken_map_differs_from_the_in_tree_class(vllm_config, tensors, inputs, in_tree,
                                                     renames):
    """Largest differences measured (hidden for the head, hidden fed back, logits): swapped norms
    7.6, 2.0, 1.7; zeroed router biases (some tokens pick other experts, whose outputs are small
    residuals by construction) 0.037, 0.009, 0.008. The real map agrees to ~1e-7."""
    pre_norm, fed_back, logits = ours(vllm_config, tensors, inputs, renames)
    for mine, theirs in zip((pre_norm, fed_back, logits), in_tree):
        assert (mine - theirs).abs().max() > 1e-3
