"""The trainable MTP layer: Hugging Face transformers' DeepSeek-V3 modules, in DeepSeek's names.

One layer is transformers' generic ``MtpLayer`` (``enorm``, ``hnorm``, ``eh_proj`` over
``cat(enorm(e), hnorm(h))``, a ``DeepseekV3DecoderLayer`` as ``mtp_block``, ``post_norm``) — the
same computation the plugin serves (``models/v3.py``; ``post_norm`` is the checkpoint's
``shared_head.norm``). ``tests/engine/train/test_train_data.py`` checks that the layer's forward
equals the
served layer on the same weights and inputs (``test_trainer_layer_computes_the_served_layer``).

Names: a checkpoint stores ``model.layers.{L}.<block tensor>`` per expert
(``mlp.experts.{e}.gate_proj.weight``), transformers keeps the experts fused
(``mlp.experts.gate_up_proj[e] = cat(gate, up)``, ``mlp.experts.down_proj[e]``).
``to_module_state`` and ``to_checkpoint_tensors`` convert both ways: the trained layers are
renamed once, from the trainer's modules to the checkpoint's full names (``model.layers.{L+j}.``),
and keep those through the work directory to the export. FP8 block-quantized checkpoints are
dequantized before they get here, as they are read (``checkpoint/target.py:
TargetCheckpoint.float_tensor``).
"""

from __future__ import annotations

import re

import torch
from torch import nn

# Checkpoint name (below ``model.layers.{L}.``) -> MtpLayer name, for the layer's own tensors.
OWN_TENSORS = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
               "eh_proj.weight": "eh_proj.weight", "shared_head.norm.weight": "post_norm.weight"}
# The checkpoint's copies of the target's embedding and head: never trained, never exported.
SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")
EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def transformers_config(config_json: dict):
    """transformers' ``DeepseekV3Config`` with the checkpoint's numbers (quantization dropped:
    the trainer works in floating point)."""
    from transformers import DeepseekV3Config

    skip = ("architectures", "model_type", "torch_dtype", "dtype", "quantization_config",
            "auto_map")
    config = DeepseekV3Config(**{k: v for k, v in config_json.items() if k not in skip})
    config._attn_implementation = "sdpa"
    return config


def new_layer(config, layer_index: int) -> nn.Module:
    """A freshly initialised MTP layer (transformers' DeepSeek-V3 initialisation)."""
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3PreTrainedModel,
        DeepseekV3RMSNorm,
    )

    layer = MtpLayer(config, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, layer_idx=layer_index,
                     use_post_norm=True)
    initialiser = DeepseekV3PreTrainedModel(config)
    layer.apply(initialiser._init_weights)
    return layer


def to_module_state(tensors: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of one layer (names below ``model.layers.{L}.``) -> MtpLayer state."""
    state, experts, block = sort_layer_tensors(tensors, SHARED_COPIES, OWN_TENSORS, EXPERT)
    state.update({"mtp_block." + name: tensor for name, tensor in block.items()})
    if experts:
        gate_up, down = fused_experts(experts, num_experts, ("gate_proj", "up_proj", "down_proj"),
                                      "mlp.experts.{}.{}.weight")
        state["mtp_block.mlp.experts.gate_up_proj"] = gate_up
        state["mtp_block.mlp.experts.down_proj"] = down
    return state


def sort_layer_tensors(tensors: dict[str, torch.Tensor], copies: tuple[str, ...],
                       own: dict[str, str], expert: re.Pattern) -> tuple[dict, dict, dict]:
    """One layer's tensors, sorted: its own (renamed by ``own``), its experts by (index, part)
    (``expert`` matches them: index, part), the rest of its block; the target's copies dropped."""
    state, experts, block = {}, {}, {}
    for name, tensor in tensors.items():
        if name in copies:
            continue
        if name in own:
            state[own[name]] = tensor
        elif match := expert.match(name):
            experts[(int(match[1]), match[2])] = tensor
        else:
            block[name] = tensor
    return state, experts, block


def fused_experts(experts: dict[tuple[int, str], torch.Tensor], num_experts: int,
                  parts: tuple[str, str, str], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert tensors ``{(e, part): tensor}`` -> transformers' fused ``gate_up_proj``
    (``[E, 2I, H]``, gate then up) and ``down_proj``; ``parts``: the checkpoint's (gate, up,
    down) names, ``name``: how a missing one is named (``name.format(e, part)``)."""
    gate, up, down = parts
    missing = [name.format(e, p) for e in range(num_experts) for p in parts
               if (e, p) not in experts]
    if missing:
        raise KeyError(f"expert tensors missing: {', '.join(missing[:3])}"
                       + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""))
    return (torch.stack([torch.cat([experts[(e, gate)], experts[(e, up)]])
                         for e in range(num_experts)]),
            torch.stack([experts[(e, down)] for e in range(num_experts)]))


def to_checkpoint_tensors(state: dict[str, torch.Tensor], prefix: str = ""
                          ) -> dict[str, torch.Tensor]:
    """MtpLayer state dict -> checkpoint tensors, per expert, named ``prefix`` + the name below
    ``model.layers.{L}.`` (``prefix`` ``model.layers.{L}.``: the checkpoint's full names)."""
    back = {v: k for k, v in OWN_TENSORS.items()}
    out = {}
    for name, tensor in state.items():
        tensor = tensor.detach()
        if name in back:
            out[prefix + back[name]] = tensor
        elif name == "mtp_block.mlp.experts.gate_up_proj":
            for e, fused in enumerate(tensor):
                gate, up = fused.chunk(2, dim=0)
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up
        elif name == "mtp_block.mlp.experts.down_proj":
            for e, down in enumerate(tensor):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = down
        else:
            out[prefix + name.removeprefix("mtp_block.")] = tensor
    return out


def layer_index(name: str) -> int:
    """``model.layers.{i}.<tensor>`` -> i."""
    return int(name.split(".", 3)[2])


def below_layer(name: str) -> str:
    """``model.layers.{i}.<tensor>`` -> ``<tensor>``, the name ``TargetCheckpoint.layer`` uses."""
    return name.split(".", 3)[3]


class FrozenTarget(nn.Module):
    """The target's embedding, rotary embedding and head: shared with the MTP layers, frozen, as
    when serving (vLLM attaches the target's embedding and head to the drafter)."""

    def __init__(self, config, embedding: torch.Tensor, head: torch.Tensor):
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3RotaryEmbedding,
        )

        self.embed_tokens = nn.Embedding.from_pretrained(embedding, freeze=True)
        self.lm_head = nn.Linear(head.shape[1], head.shape[0], bias=False)
        self.lm_head.weight = nn.Parameter(head, requires_grad=False)
        self.rotary_emb = DeepseekV3RotaryEmbedding(config)


def mtp_forward(layer: nn.Module, target: FrozenTarget, hidden: torch.Tensor,
                next_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One MTP layer on a batch ``[B, T]``: hidden state h_i, token t_{i+1}, position i; the
    embedding is zeroed at position 0, as vLLM serves it. Causal attention over T (sdpa without
    a mask); right padding is therefore harmless. Returns the post-norm output."""
    embeds = target.embed_tokens(next_ids)
    embeds = torch.where(positions.unsqueeze(-1) == 0, 0, embeds)
    rotary = target.rotary_emb(embeds, positions)
    return layer(embeds, hidden, position_embeddings=rotary, attention_mask=None,
                 position_ids=positions, past_key_values=None)
