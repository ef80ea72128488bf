"""The V4 weight-map rules on their own, against the real DeepSeek-V4-Flash MTP tensor list.

No model is built here (test_v4_model.py loads real tensors into the drafter): these tests pin what
each real checkpoint name becomes, and that the tiny checkpoints have every kind of tensor the real
one has.
"""

import json
import re
from collections import Counter

import pytest
import torch
from support.name_lists import DATA, name_list_rows
from support.tp_groups import tp_rank_functions

from vllm_mtp_plugin.tools.tiny.v4 import TinyV4Arch, build_tensors, encode
from vllm_mtp_plugin.weights.v4 import attn_sink_for_rank, dspark_hint, raw_bytes, v4_weight_map

CONFIG = json.loads((DATA / "deepseek_v4_config.json").read_text())
L = CONFIG["num_hidden_layers"]  # 43: mtp.0 is layer 43
EXPERT_PARAMS = {"gate_proj": "experts.routed_experts.w13_", "up_proj": "experts.routed_experts.w13_",
                 "down_proj": "experts.routed_experts.w2_"}
BLOCK = f"model.layers.{L}.mtp_block"


def real_v4_names() -> list[tuple[str, tuple[int, ...], str]]:
    return name_list_rows("deepseek_v4_mtp_names.txt")


def flash_map(expert_dtype="fp4"):
    return v4_weight_map(EXPERT_PARAMS, expert_dtype, L, CONFIG["num_attention_heads"])


def resolve_all(weight_map, names):
    return {n: weight_map.resolve(n, lambda _: True) for n in names}


def test_every_real_v4_flash_tensor_is_classified():
    rows = real_v4_names()
    assert len(rows) == 1581
    weight_map = flash_map()
    mtp = [n for n, _, _ in rows if weight_map.mtp_layer(n) is not None]
    assert len(mtp) == 1575 and {weight_map.mtp_layer(n) for n in mtp} == {L}
    # The top-level embed/head/norm/hc_head_* are the target's: not MTP-layer tensors at all.
    assert sorted(n for n, _, _ in rows if weight_map.mtp_layer(n) is None) == [
        "embed.weight", "hc_head_base", "hc_head_fn", "hc_head_scale", "head.weight", "norm.weight"]
    targets = resolve_all(weight_map, mtp)
    assert all(t is not None and t.param.startswith(f"model.layers.{L}.") for t in targets.values())
    experts = [t for t in targets.values() if t.expert_id is not None]
    assert len(experts) == 256 * 6
    assert Counter(t.shard for t in experts) == {"w1": 512, "w3": 512, "w2": 512}
    assert sorted({t.expert_id for t in experts}) == list(range(256))
    assert {t.param for t in experts} == {f"{BLOCK}.ffn.experts.routed_experts.{p}" for p in (
        "w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")}
    # Every expert tensor (int8 FP4, UE8M0 scale) goes through the byte view.
    assert all(t.transform is raw_bytes for t in experts)
    plain = {t.param for t in targets.values() if t.expert_id is None}
    # 39 non-expert tensors; wq_a+wkv and shared w1+w3 (weights and scales) stack into 4 params.
    assert len(plain) == 35


@pytest.mark.parametrize("name, param, shard", [
    ("mtp.0.enorm.weight", f"model.layers.{L}.enorm.weight", None),
    ("mtp.0.hnorm.weight", f"model.layers.{L}.hnorm.weight", None),
    ("mtp.0.e_proj.weight", f"model.layers.{L}.e_proj.weight", None),
    ("mtp.0.e_proj.scale", f"model.layers.{L}.e_proj.weight_scale_inv", None),
    ("mtp.0.h_proj.scale", f"model.layers.{L}.h_proj.weight_scale_inv", None),
    ("mtp.0.norm.weight", f"model.layers.{L}.shared_head.norm.weight", None),
    ("mtp.0.hc_head_fn", f"model.layers.{L}.hc_head_fn", None),
    ("mtp.0.hc_head_base", f"model.layers.{L}.hc_head_base", None),
    ("mtp.0.hc_head_scale", f"model.layers.{L}.hc_head_scale", None),
    ("mtp.0.hc_attn_fn", f"{BLOCK}.hc_attn_fn", None),
    ("mtp.0.hc_ffn_scale", f"{BLOCK}.hc_ffn_scale", None),
    ("mtp.0.attn_norm.weight", f"{BLOCK}.attn_norm.weight", None),
    ("mtp.0.attn.wq_a.weight", f"{BLOCK}.attn.fused_wqa_wkv.weight", 0),
    ("mtp.0.attn.wq_a.scale", f"{BLOCK}.attn.fused_wqa_wkv.weight_scale_inv", 0),
    ("mtp.0.attn.wkv.weight", f"{BLOCK}.attn.fused_wqa_wkv.weight", 1),
    ("mtp.0.attn.wkv.scale", f"{BLOCK}.attn.fused_wqa_wkv.weight_scale_inv", 1),
    ("mtp.0.attn.wq_b.scale", f"{BLOCK}.attn.wq_b.weight_scale_inv", None),
    ("mtp.0.attn.wo_a.weight", f"{BLOCK}.attn.wo_a.weight", None),
    ("mtp.0.attn.kv_norm.weight", f"{BLOCK}.attn.kv_norm.weight", None),
    ("mtp.0.attn.attn_sink", f"{BLOCK}.attn.attn_sink", None),
    ("mtp.0.ffn.gate.weight", f"{BLOCK}.ffn.gate.weight", None),
    ("mtp.0.ffn.gate.bias", f"{BLOCK}.ffn.gate.e_score_correction_bias", None),
    ("mtp.0.ffn.shared_experts.w1.weight", f"{BLOCK}.ffn.shared_experts.gate_up_proj.weight", 0),
    ("mtp.0.ffn.shared_experts.w3.scale",
     f"{BLOCK}.ffn.shared_experts.gate_up_proj.weight_scale_inv", 1),
    ("mtp.0.ffn.shared_experts.w2.weight", f"{BLOCK}.ffn.shared_experts.down_proj.weight", None),
    ("mtp.0.ffn.shared_experts.w2.scale",
     f"{BLOCK}.ffn.shared_experts.down_proj.weight_scale_inv", None),
    ("mtp.0.ffn.experts.7.w1.weight", f"{BLOCK}.ffn.experts.routed_experts.w13_weight", "w1"),
    ("mtp.0.ffn.experts.7.w3.scale", f"{BLOCK}.ffn.experts.routed_experts.w13_weight_scale", "w3"),
    ("mtp.0.ffn.experts.255.w2.scale", f"{BLOCK}.ffn.experts.routed_experts.w2_weight_scale", "w2"),
])
def test_real_name_targets(name, param, shard):
    target = flash_map().resolve(name, lambda _: True)
    assert (target.param, target.shard) == (param, shard)
    if ".experts." in name and ".shared_experts." not in name:
        assert target.expert_id == int(name.split(".")[4])


def test_fp8_expert_checkpoints_map_expert_scales_to_weight_scale_inv():
    """V4-Flash-Base (``expert_dtype: fp8``): FP8 block experts, whose scales vLLM names _inv."""
    target = flash_map("fp8").resolve("mtp.0.ffn.experts.3.w2.scale", lambda _: True)
    assert target.param == f"{BLOCK}.ffn.experts.routed_experts.w2_weight_scale_inv"
    assert (target.shard, target.expert_id) == ("w2", 3)


def test_checkpoint_copies_of_embedding_and_head_are_skipped():
    weight_map = flash_map()
    for name in ("mtp.0.emb.tok_emb.weight", "mtp.0.head.weight", "mtp.1.head.weight"):
        assert weight_map.mtp_layer(name) is not None
        assert weight_map.resolve(name, lambda _: True) is None


def test_parameter_names_read_back_as_checkpoint_names():
    weight_map = flash_map()
    assert weight_map.checkpoint_name(f"{BLOCK}.attn.wo_b.weight") == "mtp.0.attn.wo_b.weight"
    assert weight_map.checkpoint_name(f"model.layers.{L + 1}.shared_head.norm.weight") == \
        "mtp.1.norm.weight"
    assert weight_map.checkpoint_name(f"model.layers.{L}.hnorm.weight") == "mtp.0.hnorm.weight"
    assert weight_map.checkpoint_name(f"model.layers.{L}.e_proj.weight_scale_inv") == "mtp.0.e_proj.scale"


def templates(names) -> set[str]:
    return {re.sub(r"\.experts\.\d+\.", ".experts.{e}.", n) for n in names if n.startswith("mtp.0.")}


def test_tiny_checkpoints_have_every_kind_of_real_tensor_with_its_dtype():
    spec = TinyV4Arch(n_routed_experts=2, num_experts_per_tok=1)
    tensors, _ = build_tensors(spec, "random", 0)
    tiny = encode(tensors, "fp8", "fp4")
    real = {n: dtype for n, _, dtype in real_v4_names()}
    assert templates(tiny) == templates(real)
    dtype_name = {torch.bfloat16: "bf16"}
    for name, tensor in tiny.items():
        if name.startswith("mtp.0.") and ".experts.1." not in name:
            assert dtype_name.get(tensor.dtype, str(tensor.dtype).removeprefix("torch.")) == \
                real[name], name


def test_byte_view_keeps_ue8m0_and_fp4_bytes():
    scale = torch.tensor([2.0**-7, 1.0, 8.0]).to(torch.float8_e8m0fnu)
    param = torch.zeros(3, dtype=torch.uint8)
    viewed = raw_bytes(scale, param)
    assert viewed.dtype == torch.uint8 and viewed.tolist() == [120, 127, 130]
    # A numeric copy would have destroyed the small exponent; the view does not.
    assert torch.zeros(3, dtype=torch.uint8).copy_(scale).tolist() != [120, 127, 130]
    packed = torch.tensor([-3, 17], dtype=torch.int8)
    assert raw_bytes(packed, param[:2]).tolist() == [253, 17]
    same = torch.ones(2, dtype=torch.bfloat16)
    assert raw_bytes(same, torch.zeros(2, dtype=torch.bfloat16)) is same


def test_attn_sink_keeps_this_ranks_heads_and_minus_inf_padding(monkeypatch):
    import vllm.distributed as dist

    tp_rank_functions(monkeypatch, dist, 2, 1)
    sink = torch.arange(8, dtype=torch.float32)
    param = torch.zeros(6)  # 4 local heads padded to 6, as some attention backends do
    out = attn_sink_for_rank(8)(sink, param)
    assert out[:4].tolist() == [4.0, 5.0, 6.0, 7.0]
    assert out[4:].tolist() == [float("-inf")] * 2


def narrowing_sink_loader(param, loaded):
    """Like vLLM 0.33's ``load_attention_sink``: takes the full tensor, keeps this rank's heads."""
    import vllm.distributed as dist

    local = loaded.numel() // dist.get_tensor_model_parallel_world_size()
    start = local * dist.get_tensor_model_parallel_rank()
    param.data[:local].copy_(loaded.narrow(0, start, local))
    param.data[local:].fill_(float("-inf"))


def sink_parameters():
    """Parameters whose own loader narrows per rank: a stand-in, and vLLM's where it has one."""
    from vllm.model_executor.model_loader import weight_utils

    fake = torch.nn.Parameter(torch.zeros(6), requires_grad=False)
    fake.weight_loader = narrowing_sink_loader
    made = [fake]
    if hasattr(weight_utils, "make_attention_sink"):
        made.append(weight_utils.make_attention_sink(6, torch.float32))
    return made


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_attn_sink_is_narrowed_once_when_the_parameter_loader_narrows(monkeypatch, rank):
    import vllm.distributed as dist

    from vllm_mtp_plugin.platform import narrows_per_rank
    from vllm_mtp_plugin.weights.loader import load_mtp_weights

    tp_rank_functions(monkeypatch, dist, 4, rank)
    sink = torch.arange(16, dtype=torch.float32)  # 16 heads, 4 per rank, padded to 6
    for param in sink_parameters():
        assert narrows_per_rank(param)
        name = f"{BLOCK}.attn.attn_sink"
        loaded = load_mtp_weights(flash_map_heads(16), [("mtp.0.attn.attn_sink", sink)],
                                  {name: param}, mtp_layers=[L], num_experts=0)
        assert loaded == {name}
        assert param.tolist() == [4.0 * rank + i for i in range(4)] + [float("-inf")] * 2


def test_only_loaders_other_than_the_default_count_as_narrowing():
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    from vllm_mtp_plugin.platform import narrows_per_rank

    plain = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
    assert not narrows_per_rank(plain) and not narrows_per_rank(torch.zeros(4))
    plain.weight_loader = default_weight_loader
    assert not narrows_per_rank(plain)


def flash_map_heads(num_heads):
    return v4_weight_map(EXPERT_PARAMS, "fp4", L, num_heads)


class _Report:
    def __init__(self, loaded, skipped, count):
        self.loaded, self.shared_skipped, self.tensors_per_layer = loaded, skipped, {L: count}


def test_dspark_hint_names_the_dspark_method_and_stays_quiet_for_mtp_layers():
    hint = dspark_hint(L)
    dspark = hint(L, _Report({f"{BLOCK}.attn_norm.weight"}, ["mtp.0.main_proj.weight"], 40))
    assert "mtp.0.* has 40 tensors but no enorm/hnorm" in dspark
    assert "DSpark tensors (main_proj): it is a DSpark drafter" in dspark
    assert '"method": "dspark"' in dspark
    bare = hint(L, _Report(set(), [], 3))
    assert "it looks like a DSpark drafter" in bare
    assert hint(L, _Report({f"model.layers.{L}.enorm.weight"}, [], 50)) is None


def test_the_v4_description_is_the_real_layer():
    """``weights.layers.V4_LAYER`` under V4-Flash's config.json requires exactly the real
    ``mtp.0.*`` tensors less their ``.scale`` tensors and the optional router bias."""
    from vllm_mtp_plugin.weights.layers import V4_LAYER

    layout = V4_LAYER.layout(CONFIG)
    real = [n for n, _, _ in real_v4_names() if n.startswith("mtp.0.")]
    assert len(real) == 1575
    assert {n for n, _ in layout.required(0)} == {
        n for n in real if not n.endswith(".scale")} - {"mtp.0.ffn.gate.bias"}
    entries = {n: layout.entry_of(0, n) for n in real}
    assert [n for n, e in entries.items() if e is None] == []
    assert sorted(n for n, e in entries.items() if e[2]) == sorted(
        n for n in real if n.endswith(".scale"))


def test_the_v4_rules_place_what_the_description_says():
    from vllm_mtp_plugin.weights.layers import V4_LAYER

    weight_map = flash_map()
    for t in V4_LAYER.tensors:
        name = "mtp.0." + t.name.format(e=0)
        target = weight_map.resolve(name, lambda _: True)
        if t.shared:
            assert target is None, name
        elif t.name == "norm.weight":
            assert target.param == f"model.layers.{L}.shared_head.norm.weight"
        elif t.own:
            assert target.param == f"model.layers.{L}.{t.name}", name
        else:
            assert target.param.startswith(f"{BLOCK}."), name
