"""``vllm-mtp graft SOURCE TARGET --out DIR``: give a checkpoint the MTP layer(s) of another.

For targets that lost their MTP layers (a quantized or re-exported copy that dropped
``model.layers.{num_hidden_layers}.*``, or DeepSeek-V4's ``mtp.{j}.*``) or never had them: the MTP
layer of the original checkpoint fits the copy unchanged when both have the same architecture and
store it the same way (unquantized, or FP8 blocks / V4-Flash FP4 experts with the same scales). The result is a new
directory: the target's files linked (or copied) untouched, the grafted layer(s) in shards of their
own, the shard index and ``num_nextn_predict_layers`` updated. Nothing of the target is rewritten,
and the output is checked with the plugin's start-up check before the command reports success.

Memory: tensors are copied one source shard at a time (a DeepSeek-V3 shard is ~4 GB).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..weights.layers import LAYER_DESCRIPTIONS
from .cli_help import HelpFormatter, examples
from ..weights.preflight import tensor_problems
from .checkpoint.files import CheckpointWriteError, assemble
from .checkpoint.quantize import v4_keeps_float32
from .checkpoint.target import TargetCheckpoint, TargetCheckpointError

# Config fields that decide the MTP layer's tensor shapes, its position and its router: SOURCE and
# TARGET must agree on all of them (absent on both sides counts as agreeing).
ARCHITECTURE_FIELDS = (
    "model_type", "hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "n_routed_experts", "n_shared_experts", "moe_intermediate_size", "intermediate_size",
    "num_experts_per_tok", "n_group", "topk_group", "topk_method", "scoring_func",
    "norm_topk_prob", "routed_scaling_factor",
)
# DeepSeek-V4's as well: attention, hyper-connections, the MTP block's attention kind, expert
# storage. Compared for V4 only: transformers writes ``head_dim`` into a V3 config it saves, where
# the original has none, and the layer fits all the same.
V4_ARCHITECTURE_FIELDS = (
    "head_dim", "o_groups", "o_lora_rank", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
    "sliding_window", "index_n_heads", "index_head_dim", "index_topk", "compress_ratios",
    "swiglu_limit", "expert_dtype",
)
# Quantization fields that decide how the layer's tensors are stored (FP8 blocks and their scales;
# V4-Flash: UE8M0 scales).
QUANTIZATION_FIELDS = ("quant_method", "fmt", "weight_block_size", "activation_scheme",
                       "scale_fmt")

FLOAT_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


class GraftError(ValueError):
    """A checkpoint that cannot take part in a graft; the message names it and what to do."""


def open_checkpoint(model_dir: Path, role: str) -> TargetCheckpoint:
    """``model_dir`` read once (config.json, headers), or ``GraftError`` naming ``role``."""
    try:
        checkpoint = TargetCheckpoint(model_dir)
    except TargetCheckpointError as exc:
        raise GraftError(f"{role} {exc}") from None
    config = checkpoint.config
    if config.get("model_type") not in LAYER_DESCRIPTIONS:
        raise GraftError(
            f"{checkpoint.config_path}: model_type {config.get('model_type')!r} is not a "
            f"DeepSeek model with MTP layers ({', '.join(sorted(LAYER_DESCRIPTIONS))}); graft "
            "copies model.layers.{num_hidden_layers + j}.* (V3 layout) or mtp.{j}.* (V4) "
            "between such checkpoints.")
    if checkpoint.file_problems:
        raise GraftError("\n".join(checkpoint.file_problems))
    return checkpoint


def _quantization(config: dict) -> dict:
    q = config.get("quantization_config") or {}
    return {f: q.get(f) for f in QUANTIZATION_FIELDS if q.get(f) is not None}


def incompatibilities(source: dict, target: dict) -> list[str]:
    """Every field on which the two configs disagree, as ``field: SOURCE x, TARGET y``."""
    v4 = "deepseek_v4" in (source.get("model_type"), target.get("model_type"))
    fields = ARCHITECTURE_FIELDS + (V4_ARCHITECTURE_FIELDS if v4 else ())
    out = [f"{f}: SOURCE {source.get(f)!r}, TARGET {target.get(f)!r}"
           for f in fields if source.get(f) != target.get(f)]
    if _quantization(source) != _quantization(target):
        out.append(f"quantization_config: SOURCE {_quantization(source) or 'none'}, TARGET "
                   f"{_quantization(target) or 'none'} (the layer's tensors are copied as stored: "
                   "both must be unquantized, or quantized the same way)")
    return out


def plan(source_dir: Path, target_dir: Path
         ) -> tuple[TargetCheckpoint, TargetCheckpoint, dict[str, dict]]:
    """Check SOURCE and TARGET; returns (source, target, the source tensors to copy)."""
    source_ckpt = open_checkpoint(source_dir, "SOURCE")
    target_ckpt = open_checkpoint(target_dir, "TARGET")
    source, target = source_ckpt.config, target_ckpt.config
    layers = int(source.get("num_nextn_predict_layers") or 0)
    if layers == 0:
        raise GraftError(f"SOURCE {source_dir}: config.json declares no MTP layer "
                         "(num_nextn_predict_layers is 0 or absent); give the checkpoint the "
                         "layer comes from (e.g. the original, unquantized release).")
    problems = tensor_problems(source_ckpt.tensors, source, source_dir)
    if problems:
        raise GraftError(f"SOURCE {source_dir}: its MTP layer(s) are not usable:\n"
                         + "\n".join(f"- {p}" for p in problems))
    mismatched = incompatibilities(source, target)
    if mismatched:
        raise GraftError(
            f"SOURCE {source_dir} and TARGET {target_dir} are not the same architecture, so the "
            "layer would not fit:\n" + "\n".join(f"- {m}" for m in mismatched)
            + "\nGraft between checkpoints of one model (e.g. its original release and a copy).")
    present = target_ckpt.mtp_tensors()
    if present:
        first = sorted(present)[0]
        raise GraftError(
            f"TARGET {target_dir} already has MTP-layer tensors ({len(present)}, e.g. {first} in "
            f"{present[first]['file']}); graft only into a checkpoint without them.")
    wanted = {n: i for n, i in source_ckpt.mtp_tensors().items()
              if source_ckpt.layout.layer_of(n) < layers}
    return source_ckpt, target_ckpt, wanted


def _write_layer_shards(source_dir: Path, wanted: dict[str, dict], out: Path,
                        dtype: str | None, v4: bool = False) -> dict[str, str]:
    """Copy ``wanted`` from SOURCE, one output shard per source shard; returns name -> shard.
    Unquantized floating tensors take the target's dtype (``dtype``; with ``v4``, not those V4
    keeps in float32), everything else is copied as stored (FP8/FP4 weights with their scales)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    by_file: dict[str, list[str]] = {}
    for name, info in sorted(wanted.items()):
        by_file.setdefault(info["file"], []).append(name)
    cast = getattr(torch, dtype) if dtype in FLOAT_DTYPES else None
    weight_map = {}
    for i, (file, names) in enumerate(sorted(by_file.items()), start=1):
        shard = f"mtp-{i:05d}-of-{len(by_file):05d}.safetensors"
        tensors = {}
        with safe_open(str(source_dir / file), framework="pt") as f:
            for name in names:
                t = f.get_tensor(name)
                # DeepSeek-V4 keeps its mixers, sinks and router biases float32 in any checkpoint
                float32_kind = v4 and v4_keeps_float32(name)
                if (cast is not None and not float32_kind
                        and t.dtype in (torch.float32, torch.bfloat16, torch.float16)):
                    t = t.to(cast)
                tensors[name] = t.contiguous()
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        os.chmod(out / shard, 0o644)
        weight_map.update(dict.fromkeys(names, shard))
        del tensors
    return weight_map


def graft(source_dir: str | Path, target_dir: str | Path, out_dir: str | Path,
          copy: bool = False) -> dict:
    """Write TARGET + SOURCE's MTP layer(s) into ``out_dir``; returns a summary."""
    source_dir, target_dir, out = Path(source_dir), Path(target_dir), Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise GraftError(f"--out {out} exists and is not empty; give a new directory.")
    source, target, wanted = plan(source_dir, target_dir)
    out.mkdir(parents=True, exist_ok=True)
    quantized = bool(_quantization(target.config))
    dtype = None if quantized else (target.config.get("torch_dtype") or target.config.get("dtype"))
    layer_map = _write_layer_shards(source_dir, wanted, out, dtype,
                                    v4=target.config.get("model_type") == "deepseek_v4")
    layers = int(source.config["num_nextn_predict_layers"])
    try:
        assemble(target, out, layer_map, layers, copy)
    except CheckpointWriteError as exc:
        raise GraftError(str(exc)) from exc
    return {"out": str(out), "mtp_layers": layers, "tensors": len(layer_map),
            "shards": sorted(set(layer_map.values())), "linked": not copy}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="vllm-mtp graft", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter,
        epilog=examples("vllm-mtp graft /models/DeepSeek-R1 /models/DeepSeek-R1-quantized "
                        "--out /models/DeepSeek-R1-quantized-mtp",
                        "vllm-mtp graft /models/DeepSeek-V4-Flash /models/V4-Flash-no-mtp "
                        "--out /models/V4-Flash-mtp"))
    p.add_argument("source", help="checkpoint directory whose MTP layer(s) to take")
    p.add_argument("target", help="checkpoint directory without MTP layers (same architecture)")
    p.add_argument("--out", required=True, metavar="DIR", help="new directory for the result")
    p.add_argument("--copy", action="store_true",
                   help="copy the target's files instead of linking them")
    args = p.parse_args(argv)
    try:
        summary = graft(args.source, args.target, args.out, args.copy)
    except GraftError as exc:
        print(f"vllm-mtp graft: {exc}")
        return 2
    print(f"{summary['out']}: {summary['mtp_layers']} MTP layer(s), {summary['tensors']} tensors "
          f"in {', '.join(summary['shards'])}; the target's files "
          f"{'linked' if summary['linked'] else 'copied'} unchanged. Serve it with\n"
          f"  vllm-mtp serve {summary['out']} --speculative-config "
          f"'{{\"method\": \"mtp\", \"num_speculative_tokens\": {summary['mtp_layers']}}}'")
    return 0
