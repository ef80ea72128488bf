"""Probes and replacements that must stay safe when vLLM changes around them."""

import sys

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
