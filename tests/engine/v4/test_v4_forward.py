"""The V4 drafter's forward and compute_logits on this CPU, with vLLM's CPU V4 block (bf16 weights).

What runs: the input fusion, vLLM's hyper-connected block (hc_pre/hc_post kernels, MoE with vLLM's
CPU experts and router) and ``hc_head`` -> norm -> the target's head. What cannot run here: the
block's attention kernels. Without attention metadata (as in vLLM's own profiling run) vLLM's
CPU V4 attention returns zeros, so the block's attention contributes nothing in these tests; real
metadata needs vLLM's Triton kernels (see tools.cpu_features.deepseek_v4_cpu_blockers).

References are computed here from the checkpoint tensors with plain tensor arithmetic.
"""

import pytest
import torch
from support.hardware import needs_cpu
from support.drafters import (
    attach_target_parts,
    engine_config,
    process_loaded_drafter,
    v4_kernels_missing,
)

from vllm_mtp_plugin.tools.cpu_features import AVX512_BF16

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

L, HC, H, EPS = 2, 4, 256, 1e-6


@pytest.fixture(scope="module")
def drafter(v4_drafter, v4_tensors):
    """The shared bf16 drafter (``support/v4_fixtures.py``) with the target's parts attached."""
    attach_target_parts(v4_drafter, v4_tensors)
    return v4_drafter


def inputs(tokens=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 2048, (tokens,), generator=g)
    positions = torch.arange(tokens)  # position 0: no previous token, embedding zeroed
    hidden = torch.randn(tokens, HC * H, generator=g).to(torch.bfloat16)
    return ids, positions, hidden


def rms(x, weight):
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS) * weight.float()


def reference_fusion(t, ids, positions, hidden):
    """h_proj(hnorm(h)) per stream + e_proj(enorm(e)) (docs/v4.md), in fp32."""
    w = lambda n: t[f"mtp.0.{n}"].float()  # noqa: E731
    e = t["embed.weight"].float()[ids] * (positions != 0).float()[:, None]
    h = hidden.float().view(-1, HC, H)
    return rms(h, w("hnorm.weight")) @ w("h_proj.weight").T + \
        (rms(e, w("enorm.weight")) @ w("e_proj.weight").T)[:, None, :]


def reference_logits(t, x):
    """head(norm(hc_head(x))) with the checkpoint's hc_head_* and norm, in fp32."""
    w = lambda n: t[f"mtp.0.{n}"].float()  # noqa: E731
    flat = x.float()
    mix = rms(flat, torch.ones(HC * H)) @ w("hc_head_fn").T
    pre = torch.sigmoid(mix * w("hc_head_scale") + w("hc_head_base")) + 1e-6
    y = (pre[:, :, None] * flat.view(-1, HC, H)).sum(1)
    return rms(y, w("norm.weight")) @ t["head.weight"].float().T


def test_input_fusion_matches_the_formula_in_bf16(drafter, v4_tensors):
    ids, positions, hidden = inputs()
    layer = drafter.model.layer_for_step(0)
    fused = layer.fuse_inputs(positions, hidden, drafter.embed_input_ids(ids))
    assert fused.shape == (6, HC, H) and fused.dtype == torch.bfloat16
    expected = reference_fusion(v4_tensors, ids, positions, hidden)
    torch.testing.assert_close(fused.float(), expected, atol=0.05, rtol=0.02)
    # Position 0 gets no embedding term: its streams are h_proj(hnorm(h)) alone.
    h_only = rms(hidden.float().view(-1, HC, H)[0], v4_tensors["mtp.0.hnorm.weight"]) @ \
        v4_tensors["mtp.0.h_proj.weight"].float().T
    torch.testing.assert_close(fused[0].float(), h_only, atol=0.05, rtol=0.02)


def test_input_fusion_matches_the_formula_in_fp32(v4_config, v4_bf16_dir, v4_tensors):
    """The same layer built in fp32 (the V4 block itself only runs in bf16 on CPU)."""
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_mtp_plugin.models.v4 import DeepSeekV4MTP

    config32 = engine_config(v4_bf16_dir)
    config32.model_config.dtype = torch.float32
    with set_current_vllm_config(config32), set_default_torch_dtype(torch.float32):
        model = DeepSeekV4MTP(vllm_config=config32, prefix="")
        model.load_weights(v4_tensors.items())
        process_loaded_drafter(model, config32)
        layer = model.model.layer_for_step(0)
        ids, positions, hidden = inputs()
        embeds = v4_tensors["embed.weight"].float()[ids]
        fused = layer.fuse_inputs(positions, hidden.float(), embeds)
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused, reference_fusion(v4_tensors, ids, positions, hidden),
                               atol=1e-4, rtol=1e-4)


@needs_cpu(AVX512_BF16, part="vLLM's CPU V4 block (its kernels are in _C)")
def test_forward_is_fusion_then_vllms_block_flattened_and_feeds_back(drafter, v4_config):
    from vllm.forward_context import set_forward_context

    ids, positions, hidden = inputs()
    layer = drafter.model.layer_for_step(0)
    with set_forward_context(None, v4_config):
        out = drafter(input_ids=ids, positions=positions, hidden_states=hidden)
        x = layer.fuse_inputs(positions, hidden, drafter.embed_input_ids(ids))
        y, residual, post, comb = layer.mtp_block(x=x, positions=positions, input_ids=None)
        if residual is not None:
            y = layer.mtp_block.hc_post(y, residual, post, comb)
        # Step 2 is fed the flat residual of step 1, as vLLM's proposer does for k > 1.
        again = drafter(input_ids=ids, positions=positions + 1, hidden_states=out)
    assert out.shape == (6, HC * H) and out.dtype == torch.bfloat16
    assert torch.equal(out, y.flatten(1))
    assert not torch.equal(out.view(-1, HC, H), x)  # the block changed the streams
    assert again.shape == out.shape and torch.isfinite(again.float()).all()
    assert not torch.equal(again, out)


def test_compute_logits_is_hc_head_norm_and_the_targets_head(drafter, v4_tensors):
    _, _, hidden = inputs(seed=1)
    layer = drafter.model.layer_for_step(0)
    if not v4_kernels_missing():
        assert layer.hc_head._forward_method == layer.hc_head.forward_cpu  # vLLM's CPU kernel
    logits = drafter.compute_logits(hidden)
    assert logits.shape == (6, 2048)
    expected = reference_logits(v4_tensors, hidden)
    torch.testing.assert_close(logits.float(), expected, atol=0.05, rtol=0.05)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


# ---------------------------------------------------------------------------------------------
# The tiny checkpoints' norms and hc_head are random: a wrong mapping shows in the output.
# ---------------------------------------------------------------------------------------------


def swapped_norms_map(weight_map):
    """The V4 map with ``enorm`` and ``hnorm`` exchanged (the first matching prefix rule wins)."""
    import dataclasses

    from vllm_mtp_plugin.weights.rules import Rule

    swap = (Rule(r"^mtp\.\d+\.enorm\.", "model.layers.{layer}.hnorm."),
            Rule(r"^mtp\.\d+\.hnorm\.", "model.layers.{layer}.enorm."))
    return dataclasses.replace(weight_map, prefix_rules=(*swap, *weight_map.prefix_rules))


def reload(drafter, v4_tensors, names, weight_map=None):
    """Load ``names`` again (a partial load, as vLLM's weight sync does) through ``weight_map``."""
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

    from vllm_mtp_plugin.weights.loader import load_mtp_weights

    layer = drafter.model.layer_for_step(0)
    with disable_mtp_completeness_check():
        load_mtp_weights(weight_map or drafter.weight_map(), [(n, v4_tensors[n]) for n in names],
                         dict(drafter.named_parameters()), list(drafter.model.layer_indices()),
                         num_experts=64)
    return layer


def test_the_tiny_checkpoints_norms_and_hc_head_are_not_trivial(v4_tensors):
    for name in ("norm.weight", "mtp.0.enorm.weight", "mtp.0.hnorm.weight", "mtp.0.norm.weight",
                 "mtp.0.attn_norm.weight", "mtp.0.ffn_norm.weight", "layers.0.attn_norm.weight"):
        assert v4_tensors[name].float().std() > 0.2, name  # uniform in [0.5, 1.5]
    assert not torch.equal(v4_tensors["mtp.0.enorm.weight"], v4_tensors["mtp.0.hnorm.weight"])
    assert v4_tensors["mtp.0.hc_head_base"].abs().mean() > 0.3
    assert not torch.equal(v4_tensors["mtp.0.hc_head_fn"], v4_tensors["hc_head_fn"])


def test_swapped_enorm_hnorm_mapping_changes_the_drafters_output(drafter, v4_tensors):
    norms = ["mtp.0.enorm.weight", "mtp.0.hnorm.weight"]
    ids, positions, hidden = inputs(seed=2)
    embeds = drafter.embed_input_ids(ids)
    layer = drafter.model.layer_for_step(0)
    right = layer.fuse_inputs(positions, hidden, embeds)
    right_tokens = drafter.compute_logits(right.flatten(1)).argmax(-1)
    try:
        reload(drafter, v4_tensors, norms, swapped_norms_map(drafter.weight_map()))
        assert torch.equal(layer.enorm.weight, v4_tensors["mtp.0.hnorm.weight"])
        wrong = layer.fuse_inputs(positions, hidden, embeds)
        wrong_tokens = drafter.compute_logits(wrong.flatten(1)).argmax(-1)
    finally:
        reload(drafter, v4_tensors, norms)
    assert torch.equal(layer.fuse_inputs(positions, hidden, embeds), right)  # restored
    assert (wrong.float() - right.float()).abs().mean() > 0.1 * right.float().abs().mean()
    assert (wrong_tokens != right_tokens).sum() >= 3  # of 6 drafted tokens


def test_the_targets_hc_head_loaded_as_the_drafters_changes_the_logits(drafter, v4_tensors):
    """A mapping that takes the top-level ``hc_head_*`` (the target's) for ``mtp.0.hc_head_*``."""
    own = ["mtp.0.hc_head_fn", "mtp.0.hc_head_base", "mtp.0.hc_head_scale"]
    _, _, hidden = inputs(seed=3)
    right = drafter.compute_logits(hidden)
    target_as_own = {n: v4_tensors[n.removeprefix("mtp.0.")] for n in own}
    try:
        reload(drafter, target_as_own, own)
        wrong = drafter.compute_logits(hidden)
    finally:
        reload(drafter, v4_tensors, own)
    assert torch.equal(drafter.compute_logits(hidden), right)
    assert (wrong.argmax(-1) != right.argmax(-1)).sum() >= 3
