"""The checkpoint's MTP layer evaluated outside vLLM, on the hidden states vLLM handed the drafter.

The data come from ``vllm-mtp train``'s collection (``state_collection.py``) with the served layer's
output recorded too: per sequence (a prompt and the target's greedy continuation), the hidden
state and token the drafter received at every position, and what the served layer returned. The
layer is Hugging Face transformers' DeepSeek-V3 layer loaded from the checkpoint's files, as the
trainer loads it (``trainable.py``), run on those inputs. Three figures come out of it, over the
continuation's positions (where a served draft is made):

* ``agreement``: the layer's top-1 draft equals the target's next-next token (what greedy
  acceptance counts), per draft depth as the runner unrolls the layer, and ``accepted_by_k``:
  the draft tokens a step with k drafts would have accepted (the leading agreeing depths);
* ``served_output``: the same agreement for the served layer's output (through the same head),
  and its distance from the files' layer output on the same input: the served layer computes
  what the files say, or not;
* ``sampled``: at temperature T, the expected acceptance of greedy drafts (the target's
  probability of the draft) and of probabilistic drafts (the overlap of the two distributions);
* ``by_sequence`` (when asked): per sequence, whether the layer's own first draft at each
  position is the token that followed (for ``paired.py``; not part of the report).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from . import evaluation_figures

SAMPLED_TEMPERATURE = 1.0


@torch.no_grad()
def evaluate(model_dir: Path, data_dir: Path, depth: int, unroll: str,
             temperature: float = SAMPLED_TEMPERATURE, device: str | None = None,
             by_sequence: bool = False) -> dict:
    """The figures above for the layer(s) of ``model_dir`` on the data in ``data_dir``, ``depth``
    drafts deep. One sequence at a time: a full-size head makes ``[T, 129280]`` logits per depth.
    On an accelerator when there is one (the layer in float32: ~46 GB for DeepSeek-V3's)."""
    from .shard_format import SequenceStore
    from .trainable import MtpTrainModel
    from .v3_target import open_target

    from ..checkpoint.target import model_type

    if model_type(model_dir) == "deepseek_v4":
        from .evaluation_v4 import evaluate_v4

        return evaluate_v4(model_dir, data_dir, depth, temperature, by_sequence)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    store = SequenceStore(data_dir)
    model = MtpTrainModel(open_target(model_dir), "checkpoint", depth, unroll).eval().to(device)
    head = model.target.lm_head
    sums = evaluation_figures.new_sums(depth)
    sequences = []
    for i in range(len(store)):
        tokens, hidden, lengths = (t.to(device) for t in store.batch([i]))
        start = max(store.prompt_lengths[i] - 1, 0)  # the first served draft is made here
        model.lengths = lengths
        walk = evaluation_figures.new_walk(hidden.shape[1] - 1, device)
        for s, out in model.depth_outputs(tokens, hidden):
            n = out.shape[1] - 1
            j = torch.arange(n, device=device)
            valid = (j + s + 2 <= int(lengths[0])) & (j >= start)
            draft = head(out[0, :n]).float()
            teacher = head(hidden[0, s + 1:s + 1 + n]).float()
            evaluation_figures.count_depth(sums, walk, s, draft, teacher, valid)
            if s == 0:
                if by_sequence:
                    sequences.append(evaluation_figures.own_drafts(
                        tokens[0, :int(lengths[0])], start, draft.argmax(-1)))
                evaluation_figures.served(sums, store.outputs[i] if store.outputs else None,
                                          out[0, :n], teacher, valid, head)
                evaluation_figures.sampled(sums, draft[valid], teacher[valid], temperature)
    figures = evaluation_figures.figures(sums, depth, unroll, temperature, len(store))
    return {**figures, "by_sequence": sequences} if by_sequence else figures


def expected_tokens_per_step(accepted_by_k: list[float | None]) -> list[float | None]:
    """Tokens a step emits with k drafts: one from the target plus the drafts accepted, summed
    over depths 1..k (``accepted_by_k[s]``: the share of steps whose first s + 1 drafts agree)."""
    out, total = [], 1.0
    for share in accepted_by_k:
        total = total + share if share is not None and not math.isnan(share) else float("nan")
        out.append(None if math.isnan(total) else total)
    return out
