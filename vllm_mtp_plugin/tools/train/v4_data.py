"""What ``vllm-mtp train`` on a DeepSeek-V4 target trains from: the target and its layer (transformers'
V4 modules, ``mtp_layer/transformers_v4_layer.py``), continuations the target samples and its
states at them, or states recorded while vLLM served (``shard_format.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..mtp_layer import transformers_v4_layer as reference
from ..mtp_layer.v3_target import TrainInputError
from .v4_loop import Sequence, V4TrainSettings


def open_v4_target(model_dir: Path, init: str, blocks: bool = True, seed: int = 0):
    """(target, layer, config.json) from ``model_dir``: the checkpoint's ``mtp.0`` or (``scratch``,
    or ``auto`` without one) a new layer initialised as transformers initialises the target,
    drawn from ``seed`` (every rank draws the same layer). ``blocks=False``: the target without
    its blocks (training from recorded states)."""
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("quantization_config") and blocks:
        raise TrainInputError(
            f"{model_dir}: a quantized DeepSeek-V4 checkpoint; collecting from prompts runs the "
            "target in bf16 or fp32 here. Record its states while vLLM serves it (vllm-mtp serve "
            "--record DIR) and train with --data DIR: the layer is then read dequantized and "
            "written back in the checkpoint's FP8/FP4 format.")
    has_layer = int(config.get("num_nextn_predict_layers") or 0) > 0 and has_mtp(model_dir)
    if init == "checkpoint" and not has_layer:
        raise TrainInputError(f"--init checkpoint: {model_dir} has no mtp.0.* tensors; use "
                              "--init scratch (or auto).")
    try:
        target = reference.load_target(model_dir, torch.float32, blocks=blocks)
        if has_layer and init in ("auto", "checkpoint"):
            return target, reference.load_layer(model_dir, target.config, 0, torch.float32), config
    except (ValueError, KeyError) as exc:  # the reference names the file and tensor
        raise TrainInputError(str(exc).strip("'\"")) from None
    index = target.config.num_hidden_layers
    unquantized = {k: v for k, v in config.items() if k != "quantization_config"}
    block = reference.config_for_block(unquantized, index, f"{model_dir}/config.json")
    for kind in ("_attn_implementation", "_experts_implementation"):
        setattr(block, kind, getattr(target.config, kind, None))
    layer = reference.V4MtpLayer(block, index)
    torch.manual_seed(seed)
    layer.apply(target._init_weights)
    for name in reference.FLOAT32_MODULES:
        layer.get_submodule(name).float()
    return target, layer, config


def has_mtp(model_dir: Path) -> bool:
    from safetensors import safe_open

    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            if any(name.startswith("mtp.0.") for name in f.keys()):
                return True
    return False


@torch.no_grad()
def collect(target, prompt_ids: list[list[int]], settings: V4TrainSettings) -> list[torch.Tensor]:
    """Prompt + sampled continuation, ``samples_per_prompt`` per prompt (drawn together, one seed
    per prompt), ``max_new_tokens`` each."""
    sequences = []
    sampling = ({"do_sample": True, "temperature": settings.temperature, "top_k": 0, "top_p": 1.0}
                if settings.temperature > 0 else {"do_sample": False})
    for p, ids in enumerate(prompt_ids):
        torch.manual_seed(settings.seed * 1_000_003 + p)
        samples = settings.samples_per_prompt if settings.temperature > 0 else 1
        out = target.generate(torch.tensor([ids]), num_return_sequences=samples,
                              max_new_tokens=settings.max_new_tokens,
                              min_new_tokens=settings.max_new_tokens, **sampling)
        sequences += list(out)
    return sequences


@torch.no_grad()
def target_states(target, sequences: list[torch.Tensor]) -> list[Sequence]:
    """Each sequence with the target's residual before its ``hc_head`` at every token
    (``[T, hc_mult, H]``, bf16: what vLLM hands the drafter and a recording stores)."""
    out = []
    for ids in sequences:
        with reference.residual_before_hc_head(target) as caught:
            target(ids[None], use_cache=False)
        out.append((ids, caught["hidden"][0].to(torch.bfloat16)))
    return out


def recorded_summary(data_dir: Path, config: dict) -> dict:
    """``shard_summary`` of recorded shards (read from their headers), refused where they cannot
    be this target's: another format, or another width than ``hc_mult`` x ``hidden_size``."""
    from ..mtp_layer.shard_format import SHARD_FORMATS, shard_summary

    summary = shard_summary(data_dir)
    if summary["formats"] - SHARD_FORMATS:
        raise TrainInputError(f"--data {data_dir}: shards of format "
                              f"{', '.join(sorted(summary['formats'] - SHARD_FORMATS))}, not "
                              f"{', '.join(sorted(SHARD_FORMATS))}.")
    streams, hidden = int(config.get("hc_mult", 1)), int(config["hidden_size"])
    if summary["hidden_size"] != streams * hidden:
        raise TrainInputError(
            f"--data {data_dir}: the shards hold states of width {summary['hidden_size']} "
            f"({summary['first']}); this DeepSeek-V4 target's drafter reads {streams * hidden} "
            f"(hc_mult {streams} x hidden_size {hidden}): they were recorded from another model.")
    return summary


def recorded_sequences(data_dir: Path, config: dict) -> list[Sequence]:
    """The sequences and states of recorded shards (``shard_format.py``), refused where they
    cannot be this target's (``recorded_summary``), or with tokens outside its vocabulary."""
    from ..mtp_layer.shard_format import SequenceStore

    recorded_summary(data_dir, config)
    streams, hidden = int(config.get("hc_mult", 1)), int(config["hidden_size"])
    store = SequenceStore(data_dir)
    out = []
    for tokens, states in zip(store.tokens, store.hidden):
        if int(tokens.max()) >= int(config["vocab_size"]):
            raise TrainInputError(f"--data {data_dir}: token {int(tokens.max())} is outside this "
                                  f"target's vocabulary ({config['vocab_size']}).")
        if len(tokens) >= 3:  # a draft needs a state, the next token and the one after it
            out.append((tokens.long(), states.view(len(states), streams, hidden)))
    return out
