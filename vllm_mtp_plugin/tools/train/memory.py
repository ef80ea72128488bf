"""Memory plan for training one MTP layer of a given config on one node, counted on the meta device.

The layer is built exactly as the trainer builds it (transformers' ``MtpLayer`` with a DeepSeek-V3
decoder block) on ``torch.device("meta")``: its parameter count is the real one, and no memory is
allocated. Per GPU, with AdamW in fp32 (``vllm-mtp train`` keeps fp32 master weights):

* trained parameters: weights 4 B + gradients 4 B + Adam moments 8 B = 16 B each, divided by the
  number of ranks under FSDP2 (``--sharding fsdp``), whole on every rank under DDP;
* frozen parameters (``--train-only`` leaves routed experts frozen): 4 B each, sharded alike;
* the target's embedding and head, frozen and replicated: 2 x vocab x hidden x 4 B;
* FSDP2 gathers one layer's weights for compute, in bf16 on GPUs (2 B per parameter);
* activations: a rough bound per token of the local batch (hidden states, MLA projections, the
  chosen experts' intermediate activations, and the fp32 logits over the vocabulary, which
  dominate: vocab x 4 B x 3 for logits, softmax and gradient).

A DeepSeek-V4 layer (``v4_memory_plan``) is counted the same way from the reference layer its
trainer builds (``mtp_layer/transformers_v4_layer.V4MtpLayer``), with ``hc_mult`` streams in its
activations. Collecting from prompts, its trainer holds the whole target (transformers generates
and gives the states), so the plan counts that target on the meta device too and says what it
weighs; from recorded states (``--data``) training reads the target's embedding and head only.
"""

from __future__ import annotations

import dataclasses

import torch

from ..mtp_layer.transformers_layer import transformers_config
from ..mtp_layer.trainable import PARAMETER_GROUPS


@dataclasses.dataclass
class MemoryPlan:
    parameters: int
    trained_parameters: int
    per_gpu_bytes: dict[str, int]
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def total_per_gpu(self) -> int:
        return sum(self.per_gpu_bytes.values())

    def describe(self) -> str:
        rows = [f"  {k}: {v / 2**30:.1f} GiB" for k, v in self.per_gpu_bytes.items()]
        return (f"MTP layer: {self.parameters / 1e9:.2f} B parameters, {self.trained_parameters / 1e9:.2f}"
                f" B trained\nper GPU:\n" + "\n".join(rows)
                + f"\n  total: {self.total_per_gpu / 2**30:.1f} GiB"
                + "".join(f"\n{note}" for note in self.notes))


def count_layer_parameters(config_json: dict, train_only: list[str] | None = None
                           ) -> tuple[int, int]:
    """(all, trained) parameters of one MTP layer, built on the meta device."""
    config = transformers_config(config_json)
    with torch.device("meta"):
        layer = new_layer_on_meta(config, int(config_json["num_hidden_layers"]))
    fragments = [f for g in train_only for f in PARAMETER_GROUPS[g]] if train_only else None
    total = trained = 0
    for name, param in layer.named_parameters():
        total += param.numel()
        if fragments is None or any(f in name for f in fragments):
            trained += param.numel()
    return total, trained


def new_layer_on_meta(config, index: int):
    """The layer without transformers' initialisation (which would touch meta tensors)."""
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RMSNorm,
    )

    return MtpLayer(config, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, layer_idx=index)


def memory_plan(config_json: dict, gpus: int = 8, sharding: str = "fsdp",
                tokens_per_gpu: int = 8192, train_only: list[str] | None = None) -> MemoryPlan:
    total, trained = count_layer_parameters(config_json, train_only)
    hidden, vocab = config_json["hidden_size"], config_json["vocab_size"]
    heads = config_json["num_attention_heads"]
    qk = config_json.get("qk_nope_head_dim", 0) + config_json.get("qk_rope_head_dim", 0)
    per_token = 4 * (12 * hidden + 3 * heads * qk + 3 * _experts_width(config_json)) + 4 * 3 * vocab
    return MemoryPlan(total, trained, _per_gpu(total, trained, gpus, sharding, hidden, vocab,
                                               per_token * tokens_per_gpu))


def _experts_width(config_json: dict) -> int:
    """Intermediate width of the experts one token runs (routed top-k + shared)."""
    experts = config_json.get("num_experts_per_tok", 1) + config_json.get("n_shared_experts", 0)
    return experts * config_json.get("moe_intermediate_size", config_json.get("intermediate_size"))


def _per_gpu(total: int, trained: int, gpus: int, sharding: str, hidden: int, vocab: int,
             activations: int) -> dict[str, int]:
    shards = gpus if sharding == "fsdp" else 1
    plan = {
        "trained weights, gradients, Adam": 16 * trained // shards,
        "frozen layer weights": 4 * (total - trained) // shards,
        "target embedding + head (frozen, replicated)": 2 * vocab * hidden * 4,
        "activations": activations,
    }
    if sharding == "fsdp" and gpus > 1:
        plan["gathered layer for compute (bf16)"] = 2 * total
    return plan


def v4_memory_plan(config_json: dict, gpus: int = 8, sharding: str = "fsdp",
                   tokens_per_gpu: int = 8192, source: str = "config") -> MemoryPlan:
    """The plan for a DeepSeek-V4 target's ``mtp.0`` (every parameter trained), and what the
    frozen target its trainer runs weighs."""
    from ..mtp_layer import transformers_v4_layer as reference

    raw = {k: v for k, v in config_json.items() if k != "quantization_config"}  # meta: no dtype
    index = int(raw["num_hidden_layers"])
    with torch.device("meta"):
        layer = reference.V4MtpLayer(reference.config_for_block(raw, index, source), index)
        target = _v4_target_on_meta(raw)
    total = sum(p.numel() for p in layer.parameters())
    target_total = sum(p.numel() for p in target.parameters())
    hidden, vocab, streams = raw["hidden_size"], raw["vocab_size"], int(raw.get("hc_mult", 1))
    attention = raw["num_attention_heads"] * raw.get("head_dim", target.config.head_dim)
    per_token = 4 * (12 * streams * hidden + 3 * attention + 3 * _experts_width(raw)) + 12 * vocab
    plan = _per_gpu(total, total, gpus, sharding, hidden, vocab, per_token * tokens_per_gpu)
    notes = [f"the frozen target whose forward gives the layer its inputs: "
             f"{target_total / 1e9:.2f} B parameters, {4 * target_total / 2**30:.1f} GiB in fp32 "
             f"as `vllm-mtp train` holds it to collect from prompts (one process; "
             f"{2 * target_total / 2**30:.1f} GiB in bf16); with --data DIR (states recorded "
             f"while vLLM serves the target) training reads its embedding and head only",
             f"its states for the layer: {2 * streams * hidden} bytes per token in bf16 "
             f"({streams} streams of {hidden})"]
    return MemoryPlan(total, total, plan, notes)


def _v4_target_on_meta(raw: dict):
    from transformers.models.deepseek_v4 import DeepseekV4Config, DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM(DeepseekV4Config.from_dict(raw))
