"""Probes and replacements that must stay safe when vLLM changes around them."""

import sys

import pytest
import torch

from vllm_mtp_plugin import patches

SAMPLER = "vllm.v1.sample.ops.topk_topp_sampler"


def test_top_k_replacement_passes_new_arguments_through(monkeypatch):
    seen = []
    monkeypatch.setattr(patches, "_vllm_apply_top_k_only",
                        lambda logits, k, *a, **kw: seen.append((a, kw)) or logits * 2)
    logits = torch.ones(2, 4)
    assert torch.equal(patches.apply_top_k_only(logits, torch.tensor([1, 2]), "mask", fill=-1.0),
                       logits * 2)
    assert seen == [(("mask",), {"fill": -1.0})]
    empty = torch.empty(0, 4)
    assert patches.apply_top_k_only(empty, torch.empty(0), "mask") is empty and len(seen) == 1


def test_top_k_probe_leaves_the_sampler_unimported_where_triton_runs(monkeypatch):
    import vllm.triton_utils

    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", True)
    monkeypatch.delitem(sys.modules, SAMPLER, raising=False)
    assert patches._probe_top_k_on_empty_batch() == "Triton's top-k/top-p kernel runs here"
    assert SAMPLER not in sys.modules


def test_expert_names_are_read_by_projection_and_a_renamed_helper_is_refused(monkeypatch):
    from vllm.model_executor.layers.fused_moe import layer

    from vllm_mtp_plugin import platform

    platform.fused_moe_expert_params.cache_clear()
    assert platform.fused_moe_expert_params() == {
        "gate_proj": "experts.routed_experts.w13_", "down_proj": "experts.routed_experts.w2_",
        "up_proj": "experts.routed_experts.w13_"}  # vLLM 0.32's names, from its helper
    monkeypatch.setattr(layer, "fused_moe_make_expert_params_mapping",
                        lambda **kw: [("moe.w13_", "gate_proj.0.", 0, "w1"),
                                      ("moe.w2_", "down_proj.0.", 0, "w2"),
                                      ("moe.w13_", "up_proj.0.", 0, "w3")])
    platform.fused_moe_expert_params.cache_clear()
    assert platform.fused_moe_expert_params() == {"gate_proj": "moe.w13_", "down_proj": "moe.w2_",
                                                 "up_proj": "moe.w13_"}  # found wherever it sits
    monkeypatch.setattr(layer, "fused_moe_make_expert_params_mapping",
                        lambda **kw: [("moe.w13_", "experts.0.w1.", 0, "w1")])
    platform.fused_moe_expert_params.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"moe\.w13_.*MTP_PLUGIN=off"):
            platform.fused_moe_expert_params()
    finally:
        platform.fused_moe_expert_params.cache_clear()


def test_precedence_survives_a_renamed_model_table(monkeypatch):
    from vllm.model_executor.models import registry

    from vllm_mtp_plugin import ARCHITECTURES, precedence

    monkeypatch.delattr(registry, "_VLLM_MODELS")
    monkeypatch.setattr(precedence, "_warned", set())
    assert precedence.in_tree_qualname("DeepSeekMTPModel") is None
    assert precedence.apply(ARCHITECTURES)["DeepSeekMTPModel"] == "ours"
    assert precedence._warned == {"in-tree table"}  # warned once, plugin still registered
