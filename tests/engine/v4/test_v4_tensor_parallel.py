"""Tensor parallelism of the V4 drafter, at construction: on each rank of TP = 2 our drafter holds
exactly the shards vLLM's own V4 drafter holds, and the two ranks together hold the checkpoint.

vLLM's V4 drafter (``models/deepseek_v4/nvidia/mtp.py``, ``DeepSeekV4MTP``) narrows ``attn_sink``
itself in ``load_weights`` (lines 389-395: ``head_rank_start = n_local_head * tp_rank``; 493-498:
``loaded_weight[head_rank_start:head_rank_end]`` into the first ``n`` slots). Every other split is
done by the weight loaders of the layers ``models/deepseek_v4/attention.py`` and the MoE create:
``wq_b`` (heads) and ``wo_a`` (output groups) are column-parallel, ``wo_b`` and the shared experts'
``down_proj`` row-parallel, the shared experts' ``gate_up_proj`` merged column-parallel, the routed
experts' intermediate dimension split by ``FusedMoE``; ``fused_wqa_wkv`` is replicated
(``disable_tp=True``), as are the norms, the gate and the hyper-connection mixers.

Both drafters are built in this process and loaded from the same bf16 tiny checkpoint, rank by rank,
under a tensor-parallel group that reports 2 ranks and this rank (``support.tp_groups.fake_tp``):
the layers create, and the loaders narrow to, the shards of rank r of a real TP = 2 run; nothing
is communicated while building or loading.

vLLM's class is its CUDA one (its CPU one refuses MTP). It builds on CPU except for one probe: its
FlashMLA attention asks the GPU's compute capability for the recipe of its FP8 output projection
(``nvidia/ops/o_proj.py: compute_fp8_einsum_recipe``, an assert without CUDA); the recipe only feeds
the forward, so it is answered with Hopper's while the class is built. FlashMLA pads ``attn_sink``
to 64 heads, vLLM's CPU block (ours here) to none: the loaded heads are compared, and vLLM's padding
must have stayed ``-inf``.
"""

import pytest
import torch
from support.tp_groups import fake_tp, tp_rank_functions
from support.drafters import (
    build_drafter,
    engine_config,
    single_process_vllm,
)

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

L = 2  # the tiny target has 2 layers: mtp.0 is layer 2
HEADS = 4  # TinyV4Arch.num_attention_heads: 2 per rank
TP = 2
OWN, BLOCK = f"model.layers.{L}.", f"model.layers.{L}.mtp_block."
SINK = BLOCK + "attn.attn_sink"
# vLLM's drafter allocates the target's embedding and head too; vLLM's proposer replaces both with
# the target's at load time, and ours never allocates them.
IN_TREE_ONLY = {"model.embed_tokens.weight", OWN + "shared_head.head.weight"}
HOPPER_FP8_EINSUM_RECIPE = ((1, 128, 128), False)  # what compute_fp8_einsum_recipe gives on SM90


@pytest.fixture(scope="module")
def tp2_config(v4_bf16_dir):
    with single_process_vllm(engine_config(v4_bf16_dir)) as config:
        config.parallel_config.tensor_parallel_size = TP
        yield config


def load_ours(config, tensors, rank: int, sink_rank: int | None = None) -> dict[str, torch.Tensor]:
    """Our drafter on ``rank``; ``sink_rank``: the sink is narrowed as on that rank (a fault)."""
    import vllm.distributed

    with fake_tp(TP, rank), pytest.MonkeyPatch.context() as patch:
        drafter = build_drafter(config)
        if sink_rank is not None:
            tp_rank_functions(patch, vllm.distributed, TP, sink_rank)
        loaded = drafter.load_weights(tensors.items())
    params = dict(drafter.named_parameters())
    assert loaded == set(params)
    return params


def load_in_tree(config, tensors, rank: int) -> dict[str, torch.Tensor]:
    """vLLM's ``nvidia/mtp.py:DeepSeekV4MTP`` on ``rank``, loaded by its own ``load_weights``."""
    from vllm.models.deepseek_v4.nvidia import flashmla
    from vllm.models.deepseek_v4.nvidia.mtp import DeepSeekV4MTP
    from vllm.utils.torch_utils import set_default_torch_dtype

    config.compilation_config.static_forward_context.clear()
    with fake_tp(TP, rank), pytest.MonkeyPatch.context() as patch, \
            set_default_torch_dtype(torch.bfloat16):
        patch.setattr(flashmla, "compute_fp8_einsum_recipe", lambda: HOPPER_FP8_EINSUM_RECIPE)
        drafter = DeepSeekV4MTP(vllm_config=config, prefix="")
        loaded = drafter.load_weights(tensors.items())
    params = dict(drafter.named_parameters())
    assert loaded == set(params) - IN_TREE_ONLY  # the checkpoint has no mtp.0.emb/head copies
    return params


@pytest.fixture(scope="module")
def ranks(tp2_config, v4_tensors):
    """``{rank: (our parameters, vLLM's parameters)}`` for both ranks of TP = 2."""
    return {rank: (load_ours(tp2_config, v4_tensors, rank),
                   load_in_tree(tp2_config, v4_tensors, rank))
            for rank in range(TP)}


def mismatches(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> list[str]:
    """Our parameters that differ from vLLM's: shape, dtype or any value (the sink: its loaded
    heads, and vLLM's padding must be untouched)."""
    bad = []
    for name, mine in ours.items():
        other = theirs[name]
        if name == SINK:
            heads = HEADS // TP
            same = (mine.shape == (heads,) and torch.equal(mine, other[:heads])
                    and bool((other[heads:] == float("-inf")).all()))
        else:
            same = (mine.shape == other.shape and mine.dtype == other.dtype
                    and torch.equal(mine, other))
        if not same:
            bad.append(name)
    return bad


@pytest.mark.parametrize("rank", range(TP))
def test_each_rank_holds_exactly_vllms_shards(ranks, rank):
    ours, theirs = ranks[rank]
    assert set(ours) == set(theirs) - IN_TREE_ONLY and len(ours) == 29
    assert mismatches(ours, theirs) == []
    # The shards are halves (else this compares two full copies): heads, groups, intermediates.
    assert ours[BLOCK + "attn.wq_b.weight"].shape == (HEADS // TP * 512, 128)
    assert ours[BLOCK + "attn.wo_a.weight"].shape == (2 // TP * 128, HEADS * 512 // 2)
    assert ours[BLOCK + "attn.wo_b.weight"].shape == (256, 2 * 128 // TP)
    assert ours[BLOCK + "ffn.experts.routed_experts.w13_weight"].shape == (64, 2 * 128 // TP, 256)
    assert ours[BLOCK + "ffn.shared_experts.down_proj.weight"].shape == (256, 128 // TP)


@pytest.mark.parametrize("rank", range(TP))
def test_sink_holds_this_ranks_heads(ranks, v4_tensors, rank):
    ours, theirs = ranks[rank]
    heads = v4_tensors["mtp.0.attn.attn_sink"][rank * 2:rank * 2 + 2]
    assert torch.equal(ours[SINK], heads)
    assert torch.equal(theirs[SINK][:2], heads) and theirs[SINK].shape == (64,)


def checkpoint_parameters(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full (TP = 1) value of each parameter, from the bf16 checkpoint (names by hand)."""

    def ck(name):
        return t[f"mtp.0.{name}"]

    own = ("enorm.weight", "hnorm.weight", "e_proj.weight", "h_proj.weight", "hc_head_fn",
           "hc_head_base", "hc_head_scale")
    full = {OWN + n: ck(n) for n in own}
    full[OWN + "shared_head.norm.weight"] = ck("norm.weight")
    for n in ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base",
              "hc_ffn_scale", "attn_norm.weight", "ffn_norm.weight", "attn.attn_sink",
              "attn.q_norm.weight", "attn.kv_norm.weight", "ffn.gate.weight", "attn.wq_b.weight",
              "attn.wo_a.weight", "attn.wo_b.weight"):
        full[BLOCK + n] = ck(n)
    full[BLOCK + "ffn.gate.e_score_correction_bias"] = ck("ffn.gate.bias")
    full[BLOCK + "attn.fused_wqa_wkv.weight"] = torch.cat([ck("attn.wq_a.weight"),
                                                         ck("attn.wkv.weight")])
    shared = BLOCK + "ffn.shared_experts."
    full[shared + "gate_up_proj.weight"] = torch.cat([ck("ffn.shared_experts.w1.weight"),
                                                      ck("ffn.shared_experts.w3.weight")])
    full[shared + "down_proj.weight"] = ck("ffn.shared_experts.w2.weight")
    routed = BLOCK + "ffn.experts.routed_experts."
    full[routed + "w13_weight"] = torch.stack([torch.cat([ck(f"ffn.experts.{e}.w1.weight"),
                                                          ck(f"ffn.experts.{e}.w3.weight")])
                                               for e in range(64)])
    full[routed + "w2_weight"] = torch.stack([ck(f"ffn.experts.{e}.w2.weight") for e in range(64)])
    return full


def merged_halves(r0: torch.Tensor, r1: torch.Tensor, dim: int) -> torch.Tensor:
    """``[a | b]`` stacked along ``dim`` on each rank (rank r: a's and b's r-th halves) -> full."""
    half = r0.shape[dim] // 2
    return torch.cat([r0.narrow(dim, 0, half), r1.narrow(dim, 0, half),
                      r0.narrow(dim, half, half), r1.narrow(dim, half, half)], dim)


def reassemble(name: str, r0: torch.Tensor, r1: torch.Tensor) -> torch.Tensor:
    """Parameter ``name`` of TP = 1 from its rank-0 and rank-1 shards."""
    if name == SINK:
        return torch.cat([r0[:HEADS // TP], r1[:HEADS // TP]])
    if name.endswith(("attn.wq_b.weight", "attn.wo_a.weight")):  # column-parallel
        return torch.cat([r0, r1])
    if name.endswith(("attn.wo_b.weight", "shared_experts.down_proj.weight")):  # row-parallel
        return torch.cat([r0, r1], 1)
    if name.endswith("shared_experts.gate_up_proj.weight"):
        return merged_halves(r0, r1, 0)
    if name.endswith("routed_experts.w13_weight"):
        return merged_halves(r0, r1, 1)
    if name.endswith("routed_experts.w2_weight"):
        return torch.cat([r0, r1], 2)
    assert torch.equal(r0, r1), f"{name} differs between the ranks but is not split"
    return r0


def test_both_ranks_together_hold_the_whole_checkpoint(ranks, v4_tensors):
    (ours0, _), (ours1, _) = ranks[0], ranks[1]
    expected = checkpoint_parameters(v4_tensors)
    assert set(expected) == set(ours0) == set(ours1)
    for name, value in expected.items():
        full = reassemble(name, ours0[name], ours1[name])
        assert full.shape == value.shape and torch.equal(full, value.to(full.dtype)), name


def test_rank0_sink_on_rank1_is_caught(tp2_config, v4_tensors, ranks):
    """A loader that narrows the sink with the wrong rank: every check above names the sink."""
    faulty = load_ours(tp2_config, v4_tensors, rank=1, sink_rank=0)
    assert mismatches(faulty, ranks[1][1]) == [SINK]
    assert torch.equal(faulty[SINK], v4_tensors["mtp.0.attn.attn_sink"][:2])
    assert not torch.equal(reassemble(SINK, ranks[0][0][SINK], faulty[SINK]),
                           v4_tensors["mtp.0.attn.attn_sink"])
