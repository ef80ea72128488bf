"""The V3 drafter loading what real deployments hand it, next to vLLM's own ``DeepSeekMTP``.

Both drafters are built here as vLLM's worker builds them (``tests/support/drafters.py``), from the
repo's tiny V3 checkpoint; the weights come through vLLM's own safetensors iterator:

* a quantized export (a copy of the checkpoint with ModelOpt KV-cache scales, a deprecated
  ``kv_scale`` and GPTQ-style ``.bias`` tensors), into drafters whose MLA attention has the KV-cache
  scale parameters a ModelOpt FP8/NVFP4 config gives it (``ModelOptKVCacheMethod``);
* an expert-parallel rank with ``--enable-ep-weight-filter`` (vLLM's ``local_expert_ids`` filter),
  the MoE layer switched to EP rank 1 of 2 with vLLM's own ``ExpertMapManager``.
"""

import dataclasses

import pytest
import torch
from support.drafters import build_drafter, engine_config, single_process_vllm
from support.name_lists import tensor_names

from vllm_mtp_plugin.weights.loader import CheckpointError

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

L = 2  # the tiny target has 2 layers: the MTP layer is layer 2
ATTN = f"model.layers.{L}.mtp_block.self_attn.mla_attn.mla_attn."


@pytest.fixture(scope="module")
def v3_dir(checkpoints):
    return checkpoints("random")


@pytest.fixture(scope="module")
def vllm_config(v3_dir):
    with single_process_vllm(engine_config(v3_dir)) as config:
        yield config


def build(vllm_config, in_tree=False, kv_cache_scales=False):
    """Our drafter (or vLLM's ``DeepSeekMTP``); ``kv_cache_scales``: MLA attention gets the
    parameters ModelOpt FP8/NVFP4 configs create on it (``get_quant_method`` answers
    ``ModelOptKVCacheMethod`` for ``MLAAttention``, whose ``create_weights`` adds them)."""
    from vllm.model_executor.layers.attention import MLAAttention
    from vllm.model_executor.layers.quantization.modelopt import ModelOptKVCacheMethod
    from vllm.model_executor.models.deepseek_mtp import DeepSeekMTP

    model = build_drafter(vllm_config, DeepSeekMTP if in_tree else None)
    if kv_cache_scales:
        for module in model.modules():
            if isinstance(module, MLAAttention):
                module.quant_method = ModelOptKVCacheMethod(None)
                module.quant_method.create_weights(module)
    return model


def stream(path, local_expert_ids=None):
    """The tensors of ``path`` as vLLM's default loader reads them (EP filter included)."""
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    return safetensors_weights_iterator([str(path)], False, local_expert_ids=local_expert_ids)


@pytest.fixture(scope="module")
def quantized_export(v3_dir, tmp_path_factory):
    """The tiny checkpoint's tensors plus what quantized exports add to its MTP layer."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(v3_dir / "model.safetensors"))
    p = f"model.layers.{L}."
    tensors |= {
        # ModelOpt's KV-cache scales, and the deprecated fused form.
        p + "self_attn.k_proj.k_scale": torch.tensor(0.5), p + "self_attn.v_proj.v_scale":
            torch.tensor(0.25), p + "self_attn.kv_scale": torch.tensor(4.0),
        # GPTQ exports: biases of layers built without one (a stacked, a fused and a plain layer).
        p + "mlp.shared_experts.gate_proj.bias": torch.ones(128),
        p + "self_attn.q_a_proj.bias": torch.ones(128), p + "self_attn.o_proj.bias": torch.ones(256),
    }
    path = tmp_path_factory.mktemp("quantized-export") / "model.safetensors"
    save_file(tensors, str(path))
    return path


def test_a_quantized_export_loads_as_into_vllms_own_drafter(vllm_config, quantized_export):
    ours = build(vllm_config, kv_cache_scales=True)
    loaded = ours.load_weights(stream(quantized_export))
    params = dict(ours.named_parameters())
    # The KV-cache parameters no tensor fills (q_scale, prob_scale) keep vLLM's defaults and are
    # not required, as vLLM's own completeness check does not require them.
    assert set(params) - loaded == {ATTN + "q_scale", ATTN + "prob_scale"}
    assert params[ATTN + "k_scale"].item() == 0.5 and params[ATTN + "v_scale"].item() == 0.25
    assert params[ATTN + "q_scale"].item() == -1.0  # vLLM's "not loaded" sentinel
    theirs = build(vllm_config, in_tree=True, kv_cache_scales=True)
    theirs.load_weights(stream(quantized_export))
    reference = dict(theirs.named_parameters())
    common = set(params) & set(reference)
    assert len(common) == len(params) == 22  # 18 block and layer tensors + 4 KV-cache scales
    for name in sorted(common):
        assert torch.equal(params[name], reference[name]), name


def test_without_kv_cache_quantization_the_scales_are_skipped_as_vllm_skips_them(
        vllm_config, quantized_export):
    ours = build(vllm_config)
    assert ours.load_weights(stream(quantized_export)) == {n for n, _ in ours.named_parameters()}


def as_expert_parallel_rank(model, rank: int, size: int = 2) -> None:
    """Switch the MTP layer's MoE to EP rank ``rank`` of ``size`` with vLLM's own expert map."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager

    experts = model.model.layers[str(L)].mtp_block.mlp.experts.routed_experts
    old = experts.expert_map_manager
    ep = dataclasses.replace(old.moe_parallel_config, ep_size=size, ep_rank=rank, use_ep=True)
    experts.expert_map_manager = ExpertMapManager(
        max_num_batched_tokens=old.max_num_batched_tokens, top_k=old.top_k,
        global_num_experts=old.global_num_experts, num_redundant_experts=0, num_expert_group=None,
        moe_parallel_config=ep, placement_strategy="linear", enable_eplb=False)
    experts.update_expert_map_info()


def test_an_expert_parallel_rank_loads_only_its_experts_from_the_filtered_stream(
        vllm_config, v3_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    from vllm.model_executor.model_loader.ep_weight_filter import compute_local_expert_ids

    local = compute_local_expert_ids(4, ep_size=2, ep_rank=1)
    seen = []

    def filtered(path):
        for name, tensor in stream(path, local_expert_ids=local):
            seen.append(name)
            yield name, tensor

    model = build(vllm_config)
    as_expert_parallel_rank(model, rank=1)
    assert model.load_weights(filtered(v3_dir / "model.safetensors")) == \
        {n for n, _ in model.named_parameters()}
    assert f"model.layers.{L}.mlp.experts.0.gate_proj.weight" not in seen  # vLLM's filter ran
    t = load_file(str(v3_dir / "model.safetensors"))
    w13 = dict(model.named_parameters())[
        f"model.layers.{L}.mtp_block.mlp.experts.routed_experts.w13_weight"]
    for slot, expert in enumerate((2, 3)):  # this rank's local slots hold global experts 2 and 3
        e = f"model.layers.{L}.mlp.experts.{expert}."
        expected = torch.cat([t[e + "gate_proj.weight"], t[e + "up_proj.weight"]])
        assert torch.equal(w13[slot], expected.to(w13.dtype))
    # A rank whose own expert is missing from the checkpoint is still caught.
    del t[f"model.layers.{L}.mlp.experts.3.down_proj.weight"]
    save_file(t, str(tmp_path / "model.safetensors"))
    model = build(vllm_config)
    as_expert_parallel_rank(model, rank=1)
    with pytest.raises(CheckpointError) as err:
        model.load_weights(filtered(tmp_path / "model.safetensors"))
    assert "no tensor was found for 1 tensor(s)" in str(err.value)
    assert "experts.routed_experts.w2_weight [expert 3 shard w2]" in str(err.value)


def test_the_start_up_check_accepts_gptq_and_packed_exports_of_the_real_v3_layer():
    """GPTQ/AWQ exports store ``qweight`` (compressed-tensors ``weight_packed``) for a linear's
    ``weight``; the start-up check must not call such an MTP layer incomplete."""
    from pathlib import Path

    from vllm_mtp_plugin.weights.preflight import tensor_problems

    config = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "num_nextn_predict_layers": 1,
              "hidden_size": 7168, "n_routed_experts": 256, "q_lora_rank": 1536}
    real = tensor_names("deepseek_v3_mtp_layer61_names.txt")
    quantized = {}
    for i, name in enumerate(real):  # the block's linears in GPTQ or compressed-tensors form
        if name.endswith("_proj.weight") and ".eh_proj." not in name:
            module, packed = name.removesuffix(".weight"), ("qweight", "weight_packed")[i % 2]
            for leaf in ((packed, "weight_scale") if packed == "weight_packed"
                         else ("qweight", "qzeros", "scales", "g_idx", "bias")):
                quantized[f"{module}.{leaf}"] = {"shape": [1], "dtype": "I32", "file": "shard"}
        elif not name.endswith("_proj.weight_scale_inv"):
            shape = {"norm.weight": [7168], "eh_proj.weight": [7168, 2 * 7168]}
            quantized[name] = {"shape": next((v for k, v in shape.items() if name.endswith(k)), [1]),
                               "dtype": "BF16", "file": "shard"}
    assert "model.layers.61.mlp.experts.255.down_proj.weight" not in quantized
    assert tensor_problems(quantized, config, Path("R1-GPTQ")) == []
    # A linear that is really missing (no weight in any form) is still named.
    for leaf in ("qweight", "weight_packed", "qzeros", "scales", "g_idx", "bias", "weight_scale"):
        quantized.pop(f"model.layers.61.mlp.experts.7.up_proj.{leaf}", None)
    assert tensor_problems(quantized, config, Path("R1-GPTQ")) == [
        "R1-GPTQ: MTP layer 0 (model.layers.61.*) is incomplete: 1 tensor(s) missing: "
        "model.layers.61.mlp.experts.7.up_proj.weight. Re-export the checkpoint with every tensor "
        "of its MTP layers, or serve without --speculative-config."]
