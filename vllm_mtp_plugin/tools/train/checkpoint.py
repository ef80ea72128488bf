"""Read what training needs from a DeepSeek-V3-layout target: config, embedding, head, one layer.

Tensors are read one at a time from their shard (``safe_open``), so a 163-shard DeepSeek-V3 costs
the layer's and the embedding/head's bytes only. FP8 block-quantized weights (DeepSeek's
``weight`` ``float8_e4m3fn`` + ``weight_scale_inv`` per 128 x 128 block) are dequantized to the
training dtype; ``quantize_fp8_blocks`` writes them back the same way for export.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ...weights.headers import read_checkpoint

V3_MODEL_TYPES = ("deepseek_v3",)
V3_ARCHITECTURE = "DeepseekV3ForCausalLM"  # also Kimi K2 (model_type kimi_k2) and other derivatives
SCALE_SUFFIX = "_scale_inv"
FP8_MAX = 448.0  # largest float8_e4m3fn value


class TrainInputError(ValueError):
    """A target, prompt file or option the trainer cannot use; the message says what to do."""


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor,
                          block: tuple[int, int]) -> torch.Tensor:
    """``weight`` (fp8) times its per-block ``weight_scale_inv``, in float32."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows]
    scale = scale.repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block FP8: per ``block`` the scale ``amax / 448`` (stored as
    ``weight_scale_inv``, which multiplies on the way back) and ``weight / scale`` in e4m3."""
    rows, cols = weight.shape
    br, bc = block
    padded = torch.zeros(math.ceil(rows / br) * br, math.ceil(cols / bc) * bc)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(padded.shape[0] // br, br, padded.shape[1] // bc, bc)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    quantized = (blocks / scale[:, None, :, None]).view_as(padded)[:rows, :cols]
    return quantized.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale.float()


class TargetCheckpoint:
    """A DeepSeek-V3-layout checkpoint directory, read lazily."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        path = self.dir / "config.json"
        if not path.is_file():
            raise TrainInputError(f"{self.dir}: no config.json; give a Hugging Face checkpoint "
                                  "directory of a DeepSeek-V3-layout model (config.json and "
                                  "*.safetensors).")
        self.config = json.loads(path.read_text())
        if (self.config.get("model_type") not in V3_MODEL_TYPES
                and V3_ARCHITECTURE not in (self.config.get("architectures") or [])):
            raise TrainInputError(
                f"{path}: model_type {self.config.get('model_type')!r} is not a DeepSeek-V3-layout "
                f"model (model_type deepseek_v3 or architecture {V3_ARCHITECTURE}); vllm-mtp train trains the V3 MTP layer "
                "(enorm/hnorm/eh_proj + MLA/MoE block). DeepSeek-V3.2 (sparse attention) and V4 "
                "are not supported yet.")
        self.tensors, problems = read_checkpoint(self.dir)
        if problems:
            raise TrainInputError("\n".join(problems))
        if not self.tensors:
            raise TrainInputError(f"{self.dir}: no *.safetensors files.")
        self.num_hidden_layers = int(self.config["num_hidden_layers"])
        quant = self.config.get("quantization_config") or {}
        self.fp8_block = (tuple(quant["weight_block_size"])
                          if quant.get("quant_method") == "fp8" and quant.get("weight_block_size")
                          else None)
        if quant and self.fp8_block is None:
            raise TrainInputError(
                f"{path}: quantization {quant.get('quant_method')!r} is not supported for "
                "training; supported: unquantized and DeepSeek's block FP8 (quant_method fp8 "
                "with weight_block_size).")

    @property
    def dtype(self) -> torch.dtype:
        name = self.config.get("torch_dtype") or self.config.get("dtype") or "bfloat16"
        return getattr(torch, name)

    def mtp_layers(self) -> list[int]:
        """Indices of the MTP layers the checkpoint holds (``eh_proj`` present)."""
        return sorted(int(n.split(".")[2]) for n in self.tensors
                      if n.startswith("model.layers.") and n.endswith(".eh_proj.weight")
                      and int(n.split(".")[2]) >= self.num_hidden_layers)

    def tensor(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        info = self.tensors.get(name)
        if info is None:
            raise TrainInputError(f"{self.dir}: no tensor {name!r} in the checkpoint; it is "
                                  "needed for training (is this a complete DeepSeek-V3 export?).")
        with safe_open(str(self.dir / info["file"]), framework="pt") as f:
            return f.get_tensor(name)

    def float_tensor(self, name: str) -> torch.Tensor:
        """``name`` in float32, dequantized when stored as block FP8."""
        tensor = self.tensor(name)
        if tensor.dtype == torch.float8_e4m3fn:
            scale = self.tensor(name + SCALE_SUFFIX)
            return dequantize_fp8_blocks(tensor, scale, self.fp8_block or (128, 128))
        return tensor.float()

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        """Layer ``index``'s tensors (names below ``model.layers.{index}.``) in float32; scales
        are folded in, not returned."""
        prefix = f"model.layers.{index}."
        names = [n for n in self.tensors if n.startswith(prefix) and not n.endswith(SCALE_SUFFIX)]
        if not names:
            raise TrainInputError(f"{self.dir}: no tensors of layer {index} "
                                  f"(model.layers.{index}.*) in the checkpoint.")
        return {n.removeprefix(prefix): self.float_tensor(n) for n in names}

    def quantized_names(self, index: int) -> set[str]:
        """Names (below the layer prefix) stored as FP8 in layer ``index``: what an exported
        layer quantizes the same way."""
        prefix = f"model.layers.{index}."
        return {n.removeprefix(prefix) for n, info in self.tensors.items()
                if n.startswith(prefix) and info["dtype"] == "F8_E4M3"}
