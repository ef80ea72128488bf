"""One checkpoint directory as every tool reads it: config.json and the safetensors headers read
once, tensors read one at a time on demand.

``vllm-mtp train``, ``graft`` and ``inspect`` pass this object along instead of a path, so a
163-shard DeepSeek-V3 has its headers read once per command and a tensor costs its own bytes only
(``safe_open``). What a tool accepts beyond that (train: DeepSeek-V3 layout, unquantized or block
FP8; graft: V3 or V3.2) it checks itself and says in its own words.
"""

from __future__ import annotations

import json
from pathlib import Path

from ...weights.headers import read_checkpoint
from ...weights.preflight import layout_for
from .quantize import FP8_BLOCK, dequantize_fp8_blocks

SCALE_SUFFIX = "_scale_inv"  # DeepSeek-V3's per-block FP8 scale: ``<weight>_scale_inv``


class TargetCheckpointError(ValueError):
    """A checkpoint directory that cannot be read; the message names the file and what to do."""


def model_type(model_dir: Path) -> str | None:
    """config.json's model_type, or None where it cannot be read (the tool that opens the
    checkpoint then says why)."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def read_config(model_dir: Path) -> dict:
    """``model_dir/config.json`` as a dict, or ``TargetCheckpointError`` saying what is wrong."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise TargetCheckpointError(
            f"{model_dir}: no config.json; give a Hugging Face checkpoint directory "
            "(config.json and *.safetensors).")
    try:
        config = json.loads(path.read_text())
    except ValueError as exc:
        raise TargetCheckpointError(f"{path}: not valid JSON ({exc}).") from exc
    if not isinstance(config, dict):
        raise TargetCheckpointError(f"{path}: not a JSON object.")
    return config


class TargetCheckpoint:
    """A checkpoint directory: ``config`` and every tensor's header entry (``tensors``), read once;
    the problems of its files (absent shards, unreadable headers) in ``file_problems``."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        self.config = read_config(self.dir)
        self.tensors, self.file_problems = read_checkpoint(self.dir)
        self.num_hidden_layers = int(self.config.get("num_hidden_layers") or 0)
        self.layout = layout_for(self.config)

    @property
    def config_path(self) -> Path:
        return self.dir / "config.json"

    @property
    def quantization(self) -> dict:
        return self.config.get("quantization_config") or {}

    @property
    def fp8_block(self) -> tuple[int, int] | None:
        """The FP8 block size of DeepSeek's block quantization, ``None`` for other checkpoints."""
        quant = self.quantization
        if quant.get("quant_method") == "fp8" and quant.get("weight_block_size"):
            return tuple(quant["weight_block_size"])
        return None

    @property
    def dtype(self):
        import torch

        name = self.config.get("torch_dtype") or self.config.get("dtype") or "bfloat16"
        return getattr(torch, name)

    def require_readable(self) -> None:
        """``TargetCheckpointError`` naming every problem of the files, or no tensor at all."""
        if self.file_problems:
            raise TargetCheckpointError("\n".join(self.file_problems))
        if not self.tensors:
            raise TargetCheckpointError(f"{self.dir}: no *.safetensors files.")

    def mtp_tensors(self) -> dict[str, dict]:
        """``name -> header entry`` of the MTP-layer tensors the checkpoint holds."""
        if self.layout is None:
            return {}
        return {name: info for name, info in self.tensors.items()
                if (j := self.layout.layer_of(name)) is not None and j >= 0}

    def mtp_layers(self) -> list[int]:
        """Absolute indices of the MTP layers the checkpoint holds (``eh_proj`` present)."""
        return sorted(int(n.split(".")[2]) for n in self.tensors
                      if n.startswith("model.layers.") and n.endswith(".eh_proj.weight")
                      and int(n.split(".")[2]) >= self.num_hidden_layers)

    def tensor(self, name: str):
        from safetensors import safe_open

        info = self.tensors.get(name)
        if info is None:
            raise TargetCheckpointError(
                f"{self.dir}: no tensor {name!r} in the checkpoint (is this a complete export?).")
        with safe_open(str(self.dir / info["file"]), framework="pt") as f:
            return f.get_tensor(name)

    def float_tensor(self, name: str):
        """``name`` in float32, dequantized when stored as block FP8."""
        import torch

        tensor = self.tensor(name)
        if tensor.dtype == torch.float8_e4m3fn:
            scale = self.tensor(name + SCALE_SUFFIX)
            return dequantize_fp8_blocks(tensor, scale, self.fp8_block or FP8_BLOCK)
        return tensor.float()

    def layer(self, index: int) -> dict:
        """Layer ``index``'s tensors (names below ``model.layers.{index}.``) in float32; scales
        are folded in, not returned."""
        prefix = f"model.layers.{index}."
        names = [n for n in self.tensors if n.startswith(prefix) and not n.endswith(SCALE_SUFFIX)]
        if not names:
            raise TargetCheckpointError(f"{self.dir}: no tensors of layer {index} "
                                        f"(model.layers.{index}.*) in the checkpoint.")
        return {n.removeprefix(prefix): self.float_tensor(n) for n in names}

    def quantized_names(self, index: int) -> set[str]:
        """Names (below the layer prefix) stored as FP8 in layer ``index``: what an exported
        layer quantizes the same way."""
        prefix = f"model.layers.{index}."
        return {n.removeprefix(prefix) for n, info in self.tensors.items()
                if n.startswith(prefix) and info["dtype"] == "F8_E4M3"}
