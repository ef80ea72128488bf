"""A DeepSeek-V4 checkpoint's MTP layer evaluated outside vLLM on the states vLLM handed its
drafter: the figures of ``evaluation.py`` (agreement per draft depth, ``accepted_by_k``, the served
layer's output against the files', expected acceptance when sampling).

The layer is the V4 reference (``transformers_v4_layer.py``: transformers' V4 modules, FP8/FP4
tensors dequantized) and the target is read without its blocks: a recorded row is the target's
residual before its ``hc_head`` (``hc_mult`` streams of ``hidden_size``, flattened), the target's
own distribution of the next-next token is its head on the next row, and the layer's drafts are
its ``hc_head``, norm and the target's head on its output streams. Deeper drafts feed the layer's
streams back as the next depth's state, as vLLM's proposer runs one V4 layer k times.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from . import evaluation_figures
from . import transformers_v4_layer as reference


@torch.no_grad()
def evaluate_v4(model_dir: Path, data_dir: Path, depth: int, temperature: float = 1.0,
                by_sequence: bool = False) -> dict:
    """``evaluation.evaluate``'s figures for ``model_dir``'s ``mtp.0`` on ``data_dir``'s shards,
    ``depth`` drafts deep (one sequence at a time, on the CPU)."""
    from .shard_format import SequenceStore
    from .v3_target import TrainInputError

    config = json.loads((Path(model_dir) / "config.json").read_text())
    streams, hidden_size = int(config.get("hc_mult", 1)), int(config["hidden_size"])
    store = SequenceStore(data_dir)
    if store.hidden_size != streams * hidden_size:
        raise TrainInputError(f"{data_dir}: states of width {store.hidden_size}; {model_dir}'s "
                              f"drafter reads {streams * hidden_size} (hc_mult {streams} x "
                              f"hidden_size {hidden_size}): recorded from another model.")
    target = reference.load_target(model_dir, torch.float32, blocks=False)
    layer = reference.load_layer(model_dir, target.config, 0, torch.float32)

    def drafts(rows: torch.Tensor) -> torch.Tensor:  # the layer's logits of streams [n, hc*H]
        rows = rows.view(1, -1, streams, hidden_size)  # transformers' hc_head reads [B, T, hc, H]
        return reference.streams_logits(target, layer, rows)[0].float()

    sums = evaluation_figures.new_sums(depth)
    sequences = []
    for i in range(len(store)):
        tokens = store.tokens[i].long()[None]
        hidden = store.hidden[i].float().view(1, -1, streams, hidden_size)
        length = hidden.shape[1]
        start = max(store.prompt_lengths[i] - 1, 0)  # the first served draft is made here
        walk = evaluation_figures.new_walk(length - 1, "cpu")
        previous = hidden
        for s in range(min(depth, length - 1)):
            n = length - s
            positions = (torch.arange(n) + s)[None]
            out = reference.layer_streams(target, layer, previous[:, :n],
                                          tokens[:, s + 1:s + 1 + n], positions)
            m = n - 1  # the last row has no next state to give the target's distribution
            j = torch.arange(m)
            valid = (j + s + 2 <= length) & (j >= start)
            draft = reference.streams_logits(target, layer, out[:, :m])[0].float()
            teacher = reference.target_logits(target, hidden[:, s + 1:s + 1 + m])[0]
            evaluation_figures.count_depth(sums, walk, s, draft, teacher, valid)
            if s == 0:
                if by_sequence:
                    sequences.append(evaluation_figures.own_drafts(tokens[0, :length], start,
                                                                   draft.argmax(-1)))
                evaluation_figures.served(sums, store.outputs[i] if store.outputs else None,
                                          out[0, :m].flatten(-2), teacher, valid, drafts)
                evaluation_figures.sampled(sums, draft[valid], teacher[valid], temperature)
            previous = out
    figures = evaluation_figures.figures(sums, depth, "recursive", temperature, len(store))
    return {**figures, "by_sequence": sequences} if by_sequence else figures

