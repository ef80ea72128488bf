"""Write trained MTP layers as a checkpoint the plugin (and vLLM's own class) serves.

The target's files are linked or copied untouched (``checkpoint/files.py: assemble``); the layers go
to ``mtp-00001-of-00001.safetensors`` as ``model.layers.{L + j}.*`` in DeepSeek's names, with the
copies of the target's embedding and head that DeepSeek stores in each MTP layer (vLLM's own MTP
class loads them; the plugin skips them). Floating tensors take the target's dtype. For a block-FP8
target every tensor the target's last layer stores in FP8 is quantized the same way (128 x 128
blocks, ``weight_scale_inv``); ``eh_proj``, the norms and the router stay unquantized, as DeepSeek
ships them.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..checkpoint.files import assemble
from ..checkpoint.quantize import quantize_fp8_blocks
from ..checkpoint.target import SCALE_SUFFIX, TargetCheckpoint
from ..mtp_layer.transformers_layer import below_layer, layer_index
from ..mtp_layer.v3_target import TrainInputError

LAYER_SHARD = "mtp-00001-of-00001.safetensors"


def layer_file_tensors(target: TargetCheckpoint, layers: dict[str, torch.Tensor]
                       ) -> dict[str, torch.Tensor]:
    """The trained layers' tensors (full names) as stored: dtype, FP8 blocks and the shared
    copies."""
    fp8 = target.quantized_names(target.num_hidden_layers - 1) if target.fp8_block else set()
    embedding = target.tensor("model.embed_tokens.weight")
    head = target.tensor("lm_head.weight")
    out = {}
    for name, tensor in layers.items():
        if below_layer(name) in fp8:
            weight, scale = quantize_fp8_blocks(tensor, target.fp8_block)
            out[name], out[name + SCALE_SUFFIX] = weight, scale
        else:
            out[name] = tensor.to(target.dtype)
    # One copy per layer: the file format stores no tensors that share memory (--depth 2+).
    for position, index in enumerate(sorted({layer_index(name) for name in layers})):
        out[f"model.layers.{index}.embed_tokens.weight"] = embedding.clone() if position else embedding
        out[f"model.layers.{index}.shared_head.head.weight"] = head.clone() if position else head
    return {k: v.contiguous() for k, v in out.items()}


def export(target: TargetCheckpoint, layers: dict[str, torch.Tensor], out_dir: str | Path,
           copy: bool = False, metadata: dict | None = None) -> dict:
    """``out_dir`` = the target + ``layers`` (the checkpoint's names, ``model.layers.{L+j}.*``)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise TrainInputError(f"--out {out} exists and is not empty; give a new directory.")
    out.mkdir(parents=True, exist_ok=True)
    tensors = layer_file_tensors(target, layers)
    save_file(tensors, str(out / LAYER_SHARD), metadata={"format": "pt", **(metadata or {})})
    os.chmod(out / LAYER_SHARD, 0o644)
    old = {n for n in target.tensors if n.startswith("model.layers.")
           and int(n.split(".")[2]) >= target.num_hidden_layers}
    count = len({layer_index(name) for name in layers})
    done = assemble(target, out, dict.fromkeys(tensors, LAYER_SHARD), count, copy, drop=old)
    return {"out": str(out), "mtp_layers": count, "tensors": len(tensors),
            "replaced": len(old), "rewritten": done["rewritten"]}
