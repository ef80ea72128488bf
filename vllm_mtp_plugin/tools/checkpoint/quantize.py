"""The quantisation maths of DeepSeek checkpoints, once for every tool that reads or writes them.

Block FP8 (DeepSeek-V3/R1, V4 linears): ``float8_e4m3fn`` weights with one scale per block (128 x
128 in DeepSeek's releases), stored as ``weight_scale_inv`` (V3, float32) or ``.scale`` (V4, UE8M0
powers of two where the experts are FP4): ``weight ~= fp8 * scale``. FP4 (V4 routed experts):
e2m1 codes packed two per byte with one UE8M0 scale per 32 values.
"""

from __future__ import annotations

import math

import torch

FP8_MAX = 448.0  # largest float8_e4m3fn value
FP8_BLOCK = (128, 128)  # DeepSeek's weight_block_size
FP4_GROUP = 32
# The magnitudes FP4 (e2m1) can hold; the code of a value is its index (sign in bit 3).
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest power of two ``s`` with ``amax / s <= qmax`` (what a UE8M0 scale can hold)."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-30) / qmax)))


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int] = FP8_BLOCK,
                        pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8, scale)`` with ``weight ~= fp8 * scale`` per ``block``: the scale is ``amax / 448``
    in float32 (DeepSeek-V3's ``weight_scale_inv``, which multiplies on the way back) or, with
    ``pow2``, the power of two above it in UE8M0 (``float8_e8m0fnu``, DeepSeek-V4's FP4 builds)."""
    rows, cols = weight.shape
    br, bc = block
    padded = torch.zeros(math.ceil(rows / br) * br, math.ceil(cols / bc) * bc)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(padded.shape[0] // br, br, padded.shape[1] // bc, bc)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = pow2_scale(amax, FP8_MAX) if pow2 else amax.clamp(min=1e-12) / FP8_MAX
    quantized = (blocks / scale[:, None, :, None]).view_as(padded)[:rows, :cols]
    quantized = quantized.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).contiguous()
    return quantized, scale.to(torch.float8_e8m0fnu if pow2 else torch.float32)


def dequantize_fp8_blocks(weight: torch.Tensor, scale: torch.Tensor,
                          block: tuple[int, int] = FP8_BLOCK) -> torch.Tensor:
    """``weight`` (fp8) times its per-block scale, in float32."""
    rows, cols = weight.shape
    full = scale.float().repeat_interleave(block[0], 0)[:rows]
    full = full.repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * full


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed e2m1 (``int8``, element ``2k`` in the low nibble) and 1x32 UE8M0 scales."""
    out_dim, in_dim = weight.shape
    groups = weight.float().view(out_dim, in_dim // FP4_GROUP, FP4_GROUP)
    scale = pow2_scale(groups.abs().amax(-1), float(FP4_VALUES[-1]))
    scaled = groups / scale[..., None]
    midpoints = (FP4_VALUES[1:] + FP4_VALUES[:-1]) / 2  # round to the nearest e2m1 magnitude
    codes = torch.bucketize(scaled.abs(), midpoints)
    codes = (codes | ((scaled < 0) & (codes > 0)).long() << 3).view(out_dim, in_dim)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.to(torch.uint8).view(torch.int8), scale.to(torch.float8_e8m0fnu)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize_fp4``, in float32."""
    raw = packed.view(torch.uint8).long()
    codes = torch.stack([raw & 0xF, raw >> 4], dim=-1).flatten(-2)
    values = FP4_VALUES[codes & 0x7] * torch.where(codes >= 8, -1.0, 1.0)
    return (values.view(*codes.shape[:-1], -1, FP4_GROUP) * scale.float()[..., None]).flatten(-2)


# What a DeepSeek-V4 tensor is, for how it is stored: a quantizable linear, a routed expert's
# projection (FP4 in V4-Flash), or anything else (stored as it is).
LINEAR, EXPERT, PLAIN = "linear", "expert", "plain"


def v4_keeps_float32(name: str) -> bool:
    """Tensors DeepSeek keeps in float32: hyper-connection mixers, attention sinks, gate bias."""
    return ".hc_" in f".{name}" or name.endswith(("attn_sink", "gate.bias"))


def encode_v4(tensors: dict, quantization: str | None, expert_dtype: str
              ) -> dict[str, torch.Tensor]:
    """Store each tensor as DeepSeek does: FP8/FP4 + ``.scale`` or bf16/float32."""
    out: dict[str, torch.Tensor] = {}
    e8m0 = expert_dtype == "fp4"
    for name, (value, kind) in tensors.items():
        stem = name.removesuffix(".weight")
        if quantization == "fp8" and kind == EXPERT and expert_dtype == "fp4":
            out[name], out[f"{stem}.scale"] = quantize_fp4(value)
        elif quantization == "fp8" and kind in (LINEAR, EXPERT):
            out[name], out[f"{stem}.scale"] = quantize_fp8_blocks(value, pow2=e8m0)
        else:
            dtype = torch.float32 if v4_keeps_float32(name) else torch.bfloat16
            out[name] = value.to(dtype).contiguous()
    return out
