"""The V3 weight-map rules on their own, against the real DeepSeek-V3/R1 MTP tensor list."""

from collections import Counter

import pytest
import torch
from support.loader_fakes import (
    EXPERT_PARAMS,
    MoELayer,
    RecordingParam,
    load,
    moe_params,
    small_checkpoint,
    small_params,
)
from support.name_lists import DATA, name_list_rows

from vllm_mtp_plugin.weights.loader import CheckpointError
from vllm_mtp_plugin.weights.v3 import v3_weight_map


def real_v3_names() -> list[tuple[str, tuple[int, ...]]]:
    return [(name, shape) for name, shape, _ in name_list_rows("deepseek_v3_mtp_layer61_names.txt")]


@pytest.fixture(scope="module")
def weight_map():
    return v3_weight_map(EXPERT_PARAMS)


def fused(name: str) -> bool:
    return "fused_qkv_a_proj" in name


def test_every_real_v3_tensor_is_classified(weight_map):
    names = real_v3_names()
    assert len(names) == 1564
    targets = {n: weight_map.resolve(n, fused) for n, _ in names}
    skipped = sorted(n for n, t in targets.items() if t is None)
    assert skipped == ["model.layers.61.embed_tokens.weight", "model.layers.61.shared_head.head.weight"]
    experts = [t for t in targets.values() if t and t.expert_id is not None]
    assert len(experts) == 256 * 6  # weight + weight_scale_inv for gate/up/down of 256 experts
    assert Counter(t.shard for t in experts) == {"w1": 512, "w3": 512, "w2": 512}
    assert sorted({t.expert_id for t in experts}) == list(range(256))
    assert {t.param for t in experts} == {
        "model.layers.61.mtp_block.mlp.experts.routed_experts.w13_weight",
        "model.layers.61.mtp_block.mlp.experts.routed_experts.w13_weight_scale_inv",
        "model.layers.61.mtp_block.mlp.experts.routed_experts.w2_weight",
        "model.layers.61.mtp_block.mlp.experts.routed_experts.w2_weight_scale_inv",
    }


@pytest.mark.parametrize("name, param, shard", [
    ("model.layers.61.enorm.weight", "model.layers.61.enorm.weight", None),
    ("model.layers.61.hnorm.weight", "model.layers.61.hnorm.weight", None),
    ("model.layers.61.eh_proj.weight", "model.layers.61.eh_proj.weight", None),
    ("model.layers.61.shared_head.norm.weight", "model.layers.61.shared_head.norm.weight", None),
    ("model.layers.61.input_layernorm.weight", "model.layers.61.mtp_block.input_layernorm.weight", None),
    ("model.layers.61.self_attn.q_a_proj.weight",
     "model.layers.61.mtp_block.self_attn.fused_qkv_a_proj.weight", 0),
    ("model.layers.61.self_attn.kv_a_proj_with_mqa.weight_scale_inv",
     "model.layers.61.mtp_block.self_attn.fused_qkv_a_proj.weight_scale_inv", 1),
    ("model.layers.61.self_attn.kv_b_proj.weight_scale_inv",
     "model.layers.61.mtp_block.self_attn.kv_b_proj.weight_scale_inv", None),
    ("model.layers.61.mlp.shared_experts.gate_proj.weight",
     "model.layers.61.mtp_block.mlp.shared_experts.gate_up_proj.weight", 0),
    ("model.layers.61.mlp.shared_experts.up_proj.weight_scale_inv",
     "model.layers.61.mtp_block.mlp.shared_experts.gate_up_proj.weight_scale_inv", 1),
    ("model.layers.61.mlp.shared_experts.down_proj.weight",
     "model.layers.61.mtp_block.mlp.shared_experts.down_proj.weight", None),
    ("model.layers.61.mlp.gate.e_score_correction_bias",
     "model.layers.61.mtp_block.mlp.gate.e_score_correction_bias", None),
])
def test_v3_rename_rules(weight_map, name, param, shard):
    target = weight_map.resolve(name, fused)
    assert (target.param, target.shard, target.expert_id) == (param, shard, None)


def test_expert_rule_keeps_the_expert_index(weight_map):
    target = weight_map.resolve("model.layers.61.mlp.experts.137.down_proj.weight_scale_inv", fused)
    assert (target.param, target.shard, target.expert_id) == (
        "model.layers.61.mtp_block.mlp.experts.routed_experts.w2_weight_scale_inv", "w2", 137)


def test_unfused_attention_keeps_separate_projections(weight_map):
    # Without a q LoRA vLLM has no fused_qkv_a_proj: the optional stacking rule steps aside.
    target = weight_map.resolve("model.layers.61.self_attn.kv_a_proj_with_mqa.weight", lambda n: False)
    assert (target.param, target.shard) == (
        "model.layers.61.mtp_block.self_attn.kv_a_proj_with_mqa.weight", None)


def test_layer_detection(weight_map):
    assert weight_map.mtp_layer("model.layers.61.enorm.weight") == 61
    assert weight_map.mtp_layer("model.layers.3.mlp.gate.weight") == 3
    assert weight_map.mtp_layer("model.embed_tokens.weight") is None
    assert weight_map.mtp_layer("lm_head.weight") is None
    assert weight_map.checkpoint_name("model.layers.61.mtp_block.mlp.gate.weight") == \
        "model.layers.61.mlp.gate.weight"


# ---------------------------------------------------------------- the loader, with recorded params


def test_loader_returns_every_parameter_and_skips_shared_copies():
    params = small_params()
    loaded = load(small_checkpoint(), params)
    assert loaded == set(params)
    w13 = params["model.layers.4.mtp_block.mlp.experts.routed_experts.w13_weight"].calls
    assert sorted((c[2]["expert_id"], c[2]["shard_id"]) for c in w13) == [
        (0, "w1"), (0, "w3"), (1, "w1"), (1, "w3")]


def test_loader_names_a_missing_tensor():
    weights = small_checkpoint()
    del weights["model.layers.4.enorm.weight"]
    with pytest.raises(CheckpointError, match=r"no tensor was found for 1 tensor\(s\): "
                                              r"model\.layers\.4\.enorm\.weight"):
        load(weights, small_params())


def test_loader_names_a_missing_shard_and_expert():
    weights = small_checkpoint()
    del weights["model.layers.4.mlp.experts.1.up_proj.weight"]
    del weights["model.layers.4.mlp.shared_experts.up_proj.weight"]
    with pytest.raises(CheckpointError) as info:
        load(weights, small_params())
    assert "experts.routed_experts.w13_weight [expert 1 shard w3]" in str(info.value)
    assert "shared_experts.gate_up_proj.weight [shard 1]" in str(info.value)


def test_loader_reports_a_wrong_shape():
    weights = small_checkpoint()
    weights["model.layers.4.eh_proj.weight"] = torch.zeros(8, 8)
    with pytest.raises(CheckpointError, match=r"/ckpt: tensor 'model\.layers\.4\.eh_proj\.weight' has "
                                              r"shape \[8, 8\], but parameter .* expects \[8, 16\]"):
        load(weights, small_params())


def test_loader_reports_a_checkpoint_without_mtp_layer():
    weights = {k: v for k, v in small_checkpoint().items() if not k.startswith("model.layers.4.")}
    with pytest.raises(CheckpointError, match=r"/ckpt has no tensors for MTP layer 0 "
                                              r"\(model\.layers\.4\.\*, deepseek_v3 \(Hugging "
                                              r"Face\)\).* quantized or exported without its MTP "
                                              "layers"):
        load(weights, small_params())


def test_loader_accepts_partial_chunks_inside_vllms_weight_sync_scope():
    """Weight sync (RL) loads one chunk at a time inside vLLM's ``disable_mtp_completeness_check``;
    the completeness checks wait for a load outside it, as vLLM's own MTP loaders do."""
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

    weights = small_checkpoint()
    chunk = {k: v for k, v in weights.items() if ".experts." not in k}
    with pytest.raises(CheckpointError, match="no tensor was found"):
        load(chunk, small_params())
    params = small_params()
    with disable_mtp_completeness_check():
        first = load(chunk, params)
        rest = load({k: v for k, v in weights.items() if k not in chunk}, params)
        assert load({"model.layers.0.mlp.gate.weight": torch.zeros(2, 8)}, params) == set()
    assert first | rest == set(params)
    with pytest.raises(CheckpointError, match="has shape"):  # names and shapes are still checked
        with disable_mtp_completeness_check():
            load({"model.layers.4.eh_proj.weight": torch.zeros(8, 8)}, small_params())


# ------------------------------------------- expert parallelism and fused shared experts (ROCm AITER)


def test_an_expert_parallel_rank_loads_its_experts_from_vllms_ep_filtered_stream():
    """``--enable-ep-weight-filter``: vLLM's iterator drops other ranks' expert weights unread."""
    from vllm.model_executor.model_loader.ep_weight_filter import (
        compute_local_expert_ids,
        should_skip_weight,
    )

    local = compute_local_expert_ids(4, ep_size=2, ep_rank=1)
    stream = {n: t for n, t in small_checkpoint(experts=4).items() if not should_skip_weight(n, local)}
    assert local == {2, 3} and not [n for n in stream if ".experts.0." in n or ".experts.1." in n]
    layer = MoELayer(4, size=2, rank=1)
    params = moe_params(layer)
    assert load(stream, params, num_experts=4) == set(params)
    assert sorted((e, s) for w, e, s, _ in layer.calls if w == "w13_weight") == [
        (2, "w1"), (2, "w3"), (3, "w1"), (3, "w3")]
    # The same stream without one of this rank's own experts is still incomplete.
    del stream["model.layers.4.mlp.experts.3.up_proj.weight"]
    with pytest.raises(CheckpointError) as info:
        load(stream, moe_params(MoELayer(4, size=2, rank=1)), num_experts=4)
    assert "no tensor was found for 1 tensor(s): " in str(info.value)
    assert "experts.routed_experts.w13_weight [expert 3 shard w3]" in str(info.value)


def test_fused_shared_experts_fill_the_slots_after_the_routed_experts():
    """ROCm AITER: two shared experts stored as one widened MLP go to experts 2 and 3, split
    along the intermediate axis (dim 0 of gate/up, dim 1 of down), as vLLM's DeepSeekMTP does."""
    weights = small_checkpoint(experts=2)
    L = "model.layers.4.mlp.shared_experts."
    gate, up = torch.arange(64.).view(8, 8), torch.arange(64.).view(8, 8) + 100
    down = torch.arange(64.).view(8, 8) + 200
    weights.update({L + "gate_proj.weight": gate, L + "up_proj.weight": up,
                    L + "down_proj.weight": down})
    layer = MoELayer(2, fused_shared=2)
    params = moe_params(layer, shared_mlp=False)
    assert load(weights, params) == set(params)
    shared = {(e, s): t for w, e, s, t in layer.calls if e >= 2}
    assert sorted(shared) == [(2, "w1"), (2, "w2"), (2, "w3"), (3, "w1"), (3, "w2"), (3, "w3")]
    assert torch.equal(shared[2, "w1"], gate[:4]) and torch.equal(shared[3, "w3"], up[4:])
    assert torch.equal(shared[2, "w2"], down[:, :4]) and torch.equal(shared[3, "w2"], down[:, 4:])
    # The fused slots belong to every rank: a missing one is reported like a routed expert.
    del weights[L + "up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"w13_weight \[expert 2 shard w3\].*"
                                              r"w13_weight \[expert 3 shard w3\]"):
        load(weights, moe_params(MoELayer(2, fused_shared=2), shared_mlp=False))


def test_shared_experts_with_neither_an_mlp_nor_fused_slots_say_what_disagrees():
    weights = small_checkpoint()
    with pytest.raises(CheckpointError, match=r"'model\.layers\.4\.mlp\.shared_experts\.gate_proj"
                                              r"\.weight' holds the layer's shared experts.*"
                                              r"n_shared_experts disagrees"):
        load(weights, moe_params(MoELayer(2), shared_mlp=False))


def test_vllm_ascend_cache_scales_land_where_its_quantization_config_puts_them():
    """vllm-ascend's modelslim KV-cache (FA) scales, renamed as its cache-scale mapper does."""
    attn = "model.layers.4.mtp_block.self_attn.mla_attn.mla_attn."
    weights = {**small_checkpoint(), "model.layers.4.self_attn.fa_k.scale": torch.ones(1),
               "model.layers.4.self_attn.fa_q.offset": torch.zeros(1)}
    params = {**small_params(), attn + "fa_k.scale": RecordingParam(1),
              attn + "fa_q.offset": RecordingParam(1)}
    assert load(weights, params) == set(params)
    assert len(params[attn + "fa_k.scale"].calls) == len(params[attn + "fa_q.offset"].calls) == 1


# ------------------------------------------------------- the layer description the rules come from


def test_the_v3_description_is_the_real_layer():
    """``weights.layers.V3_LAYER`` under DeepSeek-V3's config.json requires exactly the real
    layer's tensors less its FP8 scales, the copies of the target's and the optional router bias."""
    import json

    from vllm_mtp_plugin.weights.layers import V3_LAYER

    layout = V3_LAYER.layout(json.loads((DATA / "deepseek_v3_config.json").read_text()))
    real = [n for n, _ in real_v3_names()]
    optional = {"model.layers.61.embed_tokens.weight", "model.layers.61.shared_head.head.weight",
                "model.layers.61.mlp.gate.e_score_correction_bias"}
    assert {n for n, _ in layout.required(0)} == {
        n for n in real if not n.endswith("_scale_inv")} - optional
    entries = {n: layout.entry_of(0, n) for n in real}
    assert [n for n, e in entries.items() if e is None] == []
    assert sorted(n for n, e in entries.items() if e[2]) == sorted(
        n for n in real if n.endswith("_scale_inv"))


def test_the_v3_rules_place_what_the_description_says(weight_map):
    from vllm_mtp_plugin.weights.layers import V3_LAYER

    for t in V3_LAYER.tensors:
        name = "model.layers.61." + t.name.format(e=0)
        target = weight_map.resolve(name, fused)
        if t.shared:
            assert target is None, name
        elif t.own:
            assert target.param == name, name
        else:
            assert target.param.startswith("model.layers.61.mtp_block."), name


def test_loader_reads_only_the_tensors_it_loads():
    """Tensors given as readers (``reload.mtp_weights``) are read when loaded: the MTP layer's
    copies of the embedding and head (skipped: the drafter shares the target's) and the
    target's own tensors are never read."""
    read = []

    def reader(name, tensor):
        def read_it():
            read.append(name)
            return tensor
        return read_it

    weights = {name: reader(name, t) for name, t in small_checkpoint().items()}
    params = small_params()
    assert load(weights, params) == set(params)
    assert read and not [n for n in read if n.endswith(("embed_tokens.weight", "head.weight"))
                         or not n.startswith("model.layers.4.")]
    assert len(read) == len(small_checkpoint()) - 4
