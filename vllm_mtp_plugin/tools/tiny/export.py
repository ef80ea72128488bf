"""Write a transformers-trained target and MTP layer as a DeepSeek-V3 checkpoint vLLM loads.

The layout is DeepSeek's (notes in ``weights/v3.py``): the target's tensors as transformers saves
them (per-expert names), and the MTP layer as ``model.layers.{L}.*`` with ``enorm``, ``hnorm``,
``eh_proj``, ``shared_head.norm`` and the decoder block's tensors under the block's own names.
The MTP block is saved through a target with one more layer, so its experts get the same
per-expert names as the target's (transformers converts its fused expert tensors on save).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch


def mtp_layer_tensors(model, layer_index: int) -> dict[str, torch.Tensor]:
    """The MTP layer's tensors under ``model.layers.{layer_index}.`` in DeepSeek's names."""
    from safetensors.torch import load_file
    from transformers import DeepseekV3ForCausalLM

    config = model.config.__class__(**{**model.config.to_dict(),
                                       "num_hidden_layers": layer_index + 1})
    with torch.device("meta"):
        carrier = DeepseekV3ForCausalLM(config)
    block = model.mtp.mtp_block
    carrier.model.layers[layer_index] = block
    prefix = f"model.layers.{layer_index}."
    with tempfile.TemporaryDirectory() as tmp:
        # Only the block's own tensors are real; save those alone.
        state = {k: v for k, v in carrier.state_dict().items() if k.startswith(prefix)}
        carrier.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        saved = {}
        for shard in Path(tmp).glob("*.safetensors"):
            saved.update(load_file(str(shard)))
    tensors = {k: v for k, v in saved.items() if k.startswith(prefix)}
    tensors[prefix + "enorm.weight"] = model.mtp.enorm.weight.detach()
    tensors[prefix + "hnorm.weight"] = model.mtp.hnorm.weight.detach()
    tensors[prefix + "eh_proj.weight"] = model.mtp.eh_proj.weight.detach()
    tensors[prefix + "shared_head.norm.weight"] = model.mtp.post_norm.weight.detach()
    return tensors


def target_tensors(model) -> dict[str, torch.Tensor]:
    """The target's tensors as transformers saves them (per-expert names, router bias included)."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        model.target.save_pretrained(tmp, safe_serialization=True)
        tensors = {}
        for shard in Path(tmp).glob("*.safetensors"):
            tensors.update(load_file(str(shard)))
    return tensors


def shared_copies(tensors: dict[str, torch.Tensor], layer_index: int) -> dict[str, torch.Tensor]:
    """The copies of the target's embedding and head that DeepSeek stores in each MTP layer."""
    prefix = f"model.layers.{layer_index}."
    return {prefix + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
            prefix + "shared_head.head.weight": tensors["lm_head.weight"].clone()}


def checkpoint_tensors(model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Everything the shipped file holds: the target and its MTP layer, without the copies."""
    layer_index = model.config.num_hidden_layers
    tensors = {**target_tensors(model), **mtp_layer_tensors(model, layer_index)}
    return {k: v.detach().to(dtype if v.is_floating_point() else v.dtype).contiguous()
            for k, v in tensors.items()}
