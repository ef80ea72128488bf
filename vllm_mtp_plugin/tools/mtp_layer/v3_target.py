"""The target as ``vllm-mtp train`` accepts it: a DeepSeek-V3-layout checkpoint, unquantized or in
DeepSeek's block FP8 (``weight`` ``float8_e4m3fn`` + ``weight_scale_inv`` per 128 x 128 block,
dequantized to the training dtype on reading, quantized the same way on export).

Reading is ``tools/checkpoint``'s (``TargetCheckpoint``: config and headers once, one tensor at a
time); this adds what training needs of it, refused with ``TrainInputError`` in its own words.
"""

from __future__ import annotations

from pathlib import Path

from ..checkpoint.target import TargetCheckpoint, TargetCheckpointError

V3_MODEL_TYPES = ("deepseek_v3",)
V3_ARCHITECTURE = "DeepseekV3ForCausalLM"  # also Kimi K2 (model_type kimi_k2) and other derivatives


class TrainInputError(ValueError):
    """A target, prompt file or option the trainer cannot use; the message says what to do."""


def open_target(model_dir: str | Path) -> TargetCheckpoint:
    """``model_dir`` read once, or ``TrainInputError`` saying why training cannot use it."""
    try:
        target = TargetCheckpoint(model_dir)
    except TargetCheckpointError as exc:
        raise TrainInputError(str(exc)) from None
    config, path = target.config, target.config_path
    if (config.get("model_type") not in V3_MODEL_TYPES
            and V3_ARCHITECTURE not in (config.get("architectures") or [])):
        raise TrainInputError(
            f"{path}: model_type {config.get('model_type')!r} is not a DeepSeek-V3-layout "
            f"model (model_type deepseek_v3 or architecture {V3_ARCHITECTURE}); vllm-mtp train "
            "trains the V3 MTP layer (enorm/hnorm/eh_proj + MLA/MoE block). DeepSeek-V3.2 "
            "(sparse attention) and V4 are not supported yet.")
    try:
        target.require_readable()
    except TargetCheckpointError as exc:
        raise TrainInputError(str(exc)) from None
    if target.quantization and target.fp8_block is None:
        raise TrainInputError(
            f"{path}: quantization {target.quantization.get('quant_method')!r} is not supported "
            "for training; supported: unquantized and DeepSeek's block FP8 (quant_method fp8 "
            "with weight_block_size).")
    return target
