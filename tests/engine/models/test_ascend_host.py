"""The V3 drafter under every host's way of attaching the target's head and embedding, with no
vocab-sized matrix of its own; rotation-quantised checkpoints; pipeline parallelism refused early.

Hosts: vLLM's V1 proposer and Model Runner V2's ``load_eagle_model`` run with their real code;
vllm-ascend's proposer cannot be imported here (it needs torch_npu), so its attach logic is
reproduced line for line below, with the file and lines it comes from.
"""

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from support.checkpoint_edits import edited_copy
from support.drafters import engine_config, load_drafter, v3_target_embedding_and_head
from torch import nn

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

VOCAB = 2048


@pytest.fixture(scope="module")
def rotated_checkpoint(checkpoints, tmp_path_factory):
    """The tiny oracle V3 checkpoint plus a top-level ``rot.weight`` [hidden, hidden], as
    modelslim's rotation-quantised exports store it."""
    def add_rotation(tensors):
        hidden = tensors["model.embed_tokens.weight"].shape[1]
        gen = torch.Generator().manual_seed(3)
        rot, _ = torch.linalg.qr(torch.randn(hidden, hidden, generator=gen))
        tensors["rot.weight"] = rot.contiguous()

    out = edited_copy(checkpoints("oracle"), tmp_path_factory.mktemp("rotated"),
                      tensors=add_rotation)
    return out, load_file(str(out / "model.safetensors"))


@pytest.fixture(scope="module")
def world(rotated_checkpoint):
    from support.drafters import single_process_vllm

    model_dir, tensors = rotated_checkpoint
    with single_process_vllm(engine_config(model_dir, "float32")) as vllm_config:
        yield vllm_config, tensors


def target_parts(tensors):
    """A target with the checkpoint's embedding and lm_head (vLLM's parallel layers)."""
    embed, head = v3_target_embedding_and_head(tensors)
    target = nn.Module()
    target.model, target.lm_head = nn.Module(), head
    target.model.embed_tokens = embed
    return target


def expected_logits(tensors, hidden, layer):
    norm_w = tensors[f"model.layers.{layer}.shared_head.norm.weight"]
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w
    return normed @ tensors[f"model.layers.{layer}.shared_head.head.weight"].T


def ascend_share(proposer, target, compare_first: bool) -> None:
    """vllm-ascend's MTP branch (``vllm_ascend/spec_decode/llm_base_proposer.py`` at 182b75ea84,
    2026-08-22; the same in tag v0.23.0, lines 490-493): PP == 1, ``share_embeddings = not
    self.use_compress`` (lines 416-428: ``del`` then assign ``model.model.embed_tokens``), then
    for DeepSeek MLA targets (lines 475-478)::

        for _, layer_module in self.model.model.layers.items():
            if torch.equal(layer_module.shared_head.head.weight, model.lm_head.weight):
                layer_module.shared_head.head = model.lm_head

    ``self.model.lm_head`` is set for eagle/dflash/dspark only (lines 439-466), never for MTP.
    ``compare_first=False`` is the variant described for 0.30.0rc2 (the comparison skipped when the
    drafter says ``has_own_lm_head = False``); that release's source was not available to read.
    """
    drafter = proposer.model
    if hasattr(drafter.model, "embed_tokens"):
        del drafter.model.embed_tokens
    drafter.model.embed_tokens = target.model.embed_tokens
    for _, layer_module in drafter.model.layers.items():
        if not compare_first and not getattr(drafter, "has_own_lm_head", True):
            layer_module.shared_head.head = target.lm_head
        elif torch.equal(layer_module.shared_head.head.weight, target.lm_head.weight):
            layer_module.shared_head.head = target.lm_head


def check_attached(drafter, target, tensors, via_lm_head: bool):
    assert drafter.model.embed_tokens is target.model.embed_tokens
    assert (getattr(drafter, "lm_head", None) is target.lm_head) is via_lm_head
    layer = drafter.model.mtp_start_layer_idx
    assert drafter.model.layers[str(layer)].shared_head.head is target.lm_head
    hidden = torch.randn(4, tensors["lm_head.weight"].shape[1],
                         generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(drafter.compute_logits(hidden), expected_logits(tensors, hidden, layer),
                               rtol=1e-4, atol=1e-4)


def test_no_vocab_sized_matrix_and_an_empty_head_slot(world):
    drafter = load_drafter(*world)
    assert drafter.has_own_lm_head is False and not hasattr(drafter, "has_own_embed_tokens")
    assert [n for n, p in drafter.named_parameters() if VOCAB in p.shape] == []
    slot = drafter.model.layers["2"].shared_head.head
    assert list(slot.parameters()) == [] and not hasattr(slot, "weight")
    with pytest.raises(RuntimeError, match="the MTP drafter has no output head"):
        drafter.compute_logits(torch.zeros(1, 256))


def test_vllm_v1_proposer_attaches_head_and_embedding(world):
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    vllm_config, tensors = world
    drafter, target = load_drafter(vllm_config, tensors), target_parts(tensors)
    proposer = SimpleNamespace(model=drafter, vllm_config=vllm_config,
                               use_local_argmax_reduction=False)
    SpecDecodeBaseProposer._maybe_share_embeddings(proposer, target)
    SpecDecodeBaseProposer._maybe_share_lm_head(proposer, target)
    check_attached(drafter, target, tensors, via_lm_head=True)


def test_model_runner_v2_load_eagle_model_attaches_head_and_embedding(world, monkeypatch):
    from vllm.v1.worker.gpu.spec_decode.eagle import utils

    vllm_config, tensors = world
    drafter, target = load_drafter(vllm_config, tensors), target_parts(tensors)
    monkeypatch.setattr(utils, "get_model", lambda **kwargs: drafter)  # vLLM built it: ours
    assert utils.load_eagle_model(target, vllm_config) is drafter
    check_attached(drafter, target, tensors, via_lm_head=True)


def test_ascend_proposer_attaches_the_per_layer_head_only(world):
    vllm_config, tensors = world
    drafter, target = load_drafter(vllm_config, tensors), target_parts(tensors)
    ascend_share(SimpleNamespace(model=drafter), target, compare_first=False)
    check_attached(drafter, target, tensors, via_lm_head=False)


def test_ascend_proposer_that_compares_first_replaces_a_loaded_copy(world, monkeypatch):
    """On the NPU platform the layer holds the checkpoint's head, so the comparison succeeds and
    the host swaps in the target's head (the copy is then freed); elsewhere no copy is kept."""
    from vllm_mtp_plugin.models import v3

    vllm_config, tensors = world
    monkeypatch.setattr(v3, "host_compares_head_copies", lambda: True)  # vllm-ascend's platform
    drafter, target = load_drafter(vllm_config, tensors), target_parts(tensors)
    copy = drafter.model.layers["2"].shared_head.head
    assert [n for n, p in drafter.named_parameters() if VOCAB in p.shape] == [
        "model.layers.2.shared_head.head.weight"]
    torch.testing.assert_close(copy.weight, tensors["model.layers.2.shared_head.head.weight"],
                               rtol=0, atol=0)
    ascend_share(SimpleNamespace(model=drafter), target, compare_first=True)
    check_attached(drafter, target, tensors, via_lm_head=False)
    assert drafter.model.layers["2"].shared_head.head is not copy


def test_a_host_that_compares_an_empty_slot_gets_a_clear_error(world):
    vllm_config, tensors = world
    drafter, target = load_drafter(vllm_config, tensors), target_parts(tensors)
    with pytest.raises(AttributeError, match="set MTP_PLUGIN=off"):
        ascend_share(SimpleNamespace(model=drafter), target, compare_first=True)


def test_only_shards_with_the_mtp_layers_or_rot_are_read(world):
    """``is_unused_checkpoint_weight`` lets vLLM's loader skip shards of target-only tensors."""
    drafter = load_drafter(*world)
    unused = drafter.is_unused_checkpoint_weight
    assert not unused("rot.weight") and not unused("model.layers.2.enorm.weight")
    assert not unused("model.layers.2.mlp.experts.3.up_proj.weight")
    assert unused("model.layers.0.self_attn.kv_a_proj_with_mqa.weight")
    assert unused("model.embed_tokens.weight") and unused("lm_head.weight")


def test_rotation_weight_is_loaded_and_applied_at_every_step(world, monkeypatch):
    """vllm-ascend's ``AscendDeepSeekMTP.forward`` (``vllm_ascend/models/deepseek_mtp.py`` lines
    32-34 at 182b75ea84): ``hidden_states = self.rot(hidden_states)`` before vLLM's forward, on
    every call. Here the predictor's forward rotates first (``prepare_hidden_states``), then the
    step's layer gets the rotated state."""
    vllm_config, tensors = world
    drafter = load_drafter(vllm_config, tensors)
    assert drafter.rotation is drafter.model.layers["2"].rot  # loaded from the top-level name
    seen = []

    def layer_for_step(step):
        return lambda positions, hidden, embeds: seen.append((step, hidden)) or hidden

    monkeypatch.setattr(drafter.model, "layer_for_step", layer_for_step)
    hidden = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    for step in (0, 1):
        drafter.forward(torch.zeros(3, dtype=torch.long), torch.arange(3), hidden, None,
                        torch.zeros(3, 256), step)
    expected = hidden @ tensors["rot.weight"].T  # the checkpoint's rotation reached the layer
    assert [step for step, _ in seen] == [0, 1]
    for _, got in seen:
        torch.testing.assert_close(got, expected)


def test_pipeline_parallelism_is_refused_at_construction(world):
    from vllm_mtp_plugin.models.v3 import DeepSeekMTP

    vllm_config, _ = world
    vllm_config.parallel_config.pipeline_parallel_size = 2
    try:
        with pytest.raises(NotImplementedError,
                           match=r"pipeline_parallel_size=2\).*--pipeline-parallel-size 1.*"
                                 r"MTP_PLUGIN=off"):
            DeepSeekMTP(vllm_config=vllm_config, prefix="")
    finally:
        vllm_config.parallel_config.pipeline_parallel_size = 1


def test_rotation_weight_the_drafter_was_not_built_for_is_named(world, monkeypatch):
    """A hub-id checkpoint with ``rot.weight`` but no ``is_rot_used``: a clear error, not a generic
    unknown tensor."""
    from vllm_mtp_plugin.models import v3
    from vllm_mtp_plugin.weights.loader import CheckpointError

    monkeypatch.setattr(v3, "uses_rotation", lambda vllm_config: False)
    with pytest.raises(CheckpointError, match=r"top-level 'rot.weight'.*\"is_rot_used\": true"):
        load_drafter(*world)
