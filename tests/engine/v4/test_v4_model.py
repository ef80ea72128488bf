"""Our V4 drafter built on this CPU with vLLM's own V4 block, loaded from a full FP8 tiny checkpoint.

The checkpoint is stored as DeepSeek stores V4-Flash (FP8 e4m3 linears with UE8M0 block scales,
packed-FP4 experts with UE8M0 1x32 scales, ``mtp.0.*`` names). Every parameter of the drafter is
compared, byte for byte, with the checkpoint tensors it must hold, composed here by hand (not by the
weight map). Building an FP8 drafter needs vLLM's CPU FP8 linear kernel to accept this CPU: see
``support/drafters.py`` (``cpu_quantized_kernels_selected``); no FP8 matmul runs in this file.
"""

import pytest
import torch
from support.drafters import (
    build_drafter,
    checkpoint_tensors,
    tiny_v4_checkpoint,
)

from vllm_mtp_plugin.weights.loader import CheckpointError

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

L = 2  # the tiny target has 2 layers: mtp.0 is layer 2


@pytest.fixture
def drafter(v4_fp8_config):
    return build_drafter(v4_fp8_config, quantized=True)


def expected_parameters(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What each drafter parameter must hold, from the checkpoint tensors ``t`` (names by hand)."""
    own, block = f"model.layers.{L}.", f"model.layers.{L}.mtp_block."

    def ck(name):
        return t[f"mtp.0.{name}"]

    def cat(*names):
        return torch.cat([ck(n).view(torch.uint8) if ck(n).element_size() == 1 else ck(n)
                          for n in names])

    experts = range(64)
    exp = {own + n: ck(n) for n in ("enorm.weight", "hnorm.weight", "e_proj.weight",
                                    "h_proj.weight", "hc_head_fn", "hc_head_base", "hc_head_scale")}
    exp[own + "e_proj.weight_scale_inv"] = ck("e_proj.scale")
    exp[own + "h_proj.weight_scale_inv"] = ck("h_proj.scale")
    exp[own + "shared_head.norm.weight"] = ck("norm.weight")
    for n in ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base",
              "hc_ffn_scale", "attn_norm.weight", "ffn_norm.weight", "attn.attn_sink",
              "attn.q_norm.weight", "attn.kv_norm.weight", "ffn.gate.weight"):
        exp[block + n] = ck(n)
    for n in ("attn.wq_b", "attn.wo_a", "attn.wo_b"):
        exp[f"{block}{n}.weight"], exp[f"{block}{n}.weight_scale_inv"] = ck(f"{n}.weight"), ck(f"{n}.scale")
    exp[block + "ffn.gate.e_score_correction_bias"] = ck("ffn.gate.bias")
    exp[block + "attn.fused_wqa_wkv.weight"] = cat("attn.wq_a.weight", "attn.wkv.weight")
    exp[block + "attn.fused_wqa_wkv.weight_scale_inv"] = cat("attn.wq_a.scale", "attn.wkv.scale")
    shared = block + "ffn.shared_experts."
    exp[shared + "gate_up_proj.weight"] = cat("ffn.shared_experts.w1.weight", "ffn.shared_experts.w3.weight")
    exp[shared + "gate_up_proj.weight_scale_inv"] = cat("ffn.shared_experts.w1.scale",
                                                        "ffn.shared_experts.w3.scale")
    exp[shared + "down_proj.weight"] = ck("ffn.shared_experts.w2.weight")
    exp[shared + "down_proj.weight_scale_inv"] = ck("ffn.shared_experts.w2.scale")
    routed = block + "ffn.experts.routed_experts."
    for suffix, kind in (("weight", "weight"), ("weight_scale", "scale")):
        exp[f"{routed}w13_{suffix}"] = torch.stack(
            [cat(f"ffn.experts.{e}.w1.{kind}", f"ffn.experts.{e}.w3.{kind}") for e in experts])
        exp[f"{routed}w2_{suffix}"] = torch.stack(
            [ck(f"ffn.experts.{e}.w2.{kind}").view(torch.uint8) for e in experts])
    return exp


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(torch.uint8).flatten()


def test_full_fp8_checkpoint_loads_every_parameter_byte_for_byte(drafter, v4_fp8_dir):
    tensors = checkpoint_tensors(v4_fp8_dir)
    loaded = drafter.load_weights(tensors.items())
    params = dict(drafter.named_parameters())
    expected = expected_parameters(tensors)
    assert loaded == set(params) == set(expected)
    assert len(params) == 39  # 35 plain/stacked + 4 fused-MoE tensors, as for V4-Flash
    for name, value in expected.items():
        assert tuple(params[name].shape) == tuple(value.shape), name
        assert torch.equal(as_bytes(params[name]), as_bytes(value)), name
    # UE8M0 scales stay UE8M0 (linears) or their raw bytes (experts): nothing was converted.
    assert params[f"model.layers.{L}.e_proj.weight_scale_inv"].dtype == torch.float8_e8m0fnu
    scale = params[f"model.layers.{L}.mtp_block.ffn.experts.routed_experts.w13_weight_scale"]
    # Scales below 1 (bytes under 127): a numeric copy into uint8 would have made them 0.
    assert scale.dtype == torch.uint8 and 0 < scale.min() <= scale.max() < 127
    numeric = torch.zeros_like(scale[0, :128]).copy_(tensors["mtp.0.ffn.experts.0.w1.scale"])
    assert numeric.max() == 0


def test_drafter_allocates_no_vocab_sized_matrix_and_skips_checkpoint_copies(drafter, v4_fp8_dir):
    tensors = checkpoint_tensors(v4_fp8_dir)
    vocab, hidden = tensors["embed.weight"].shape
    # Some exports also keep copies of the target's embedding and head under mtp.0.
    with_copies = {**tensors, "mtp.0.emb.tok_emb.weight": tensors["embed.weight"],
                   "mtp.0.head.weight": tensors["head.weight"]}
    loaded = drafter.load_weights(with_copies.items())
    assert loaded == {n for n, _ in drafter.named_parameters()}
    assert not [n for n, p in drafter.named_parameters() if tuple(p.shape[-2:]) == (vocab, hidden)]


def test_checkpoint_without_mtp_tensors_says_so(drafter, v4_fp8_dir):
    tensors = checkpoint_tensors(v4_fp8_dir)
    target_only = {n: t for n, t in tensors.items() if not n.startswith("mtp.")}
    with pytest.raises(CheckpointError) as err:
        drafter.load_weights(target_only.items())
    message = str(err.value)
    assert "has no tensors for MTP layer 0 (mtp.0.*, deepseek_v4 (DeepSeek naming))" in message
    assert "quantized or exported without its MTP layers" in message


def test_dspark_drafter_under_mtp_points_to_the_dspark_method(drafter):
    dspark = checkpoint_tensors(tiny_v4_checkpoint("random", dspark=True))
    assert "mtp.0.main_proj.weight" in dspark and "mtp.0.enorm.weight" not in dspark
    with pytest.raises(CheckpointError) as err:
        drafter.load_weights(dspark.items())
    message = str(err.value)
    assert "mtp.0.* has " in message and "tensors but no enorm/hnorm" in message
    assert "DSpark tensors (main_norm, main_proj): it is a DSpark drafter" in message
    assert "--speculative-config '{\"method\": \"dspark\", ...}'" in message


def test_wrong_shape_names_tensor_parameter_and_both_shapes(drafter, v4_fp8_dir):
    tensors = checkpoint_tensors(v4_fp8_dir)
    tensors["mtp.0.h_proj.weight"] = torch.zeros(256, 384, dtype=torch.float8_e4m3fn)
    with pytest.raises(CheckpointError) as err:
        drafter.load_weights(tensors.items())
    message = str(err.value)
    assert "tensor 'mtp.0.h_proj.weight' has shape [256, 384]" in message
    assert f"parameter 'model.layers.{L}.h_proj.weight' expects [256, 256]" in message
    assert message.startswith(str(v4_fp8_dir / "model.safetensors"))


def test_missing_tensor_is_named_by_its_checkpoint_name(drafter, v4_fp8_dir):
    tensors = checkpoint_tensors(v4_fp8_dir)
    del tensors["mtp.0.attn.wo_b.scale"], tensors["mtp.0.ffn.experts.5.w3.weight"]
    with pytest.raises(CheckpointError) as err:
        drafter.load_weights(tensors.items())
    message = str(err.value)
    assert "no tensor was found for 2 tensor(s)" in message
    assert "mtp.0.attn.wo_b.scale" in message
    assert "w13_weight [expert 5 shard w3]" in message
