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

from ..stats import wilson

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

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    store = SequenceStore(data_dir)
    model = MtpTrainModel(open_target(model_dir), "checkpoint", depth, unroll).eval().to(device)
    head = model.target.lm_head
    sums = {"agree": [0] * depth, "count": [0] * depth, "served_agree": 0, "served_count": 0,
            "distance": 0.0, "greedy_t": 0.0, "probabilistic_t": 0.0, "by_k": [0] * depth,
            "steps": 0}
    sequences = []
    for i in range(len(store)):
        tokens, hidden, lengths = (t.to(device) for t in store.batch([i]))
        start = max(store.prompt_lengths[i] - 1, 0)  # the first served draft is made here
        model.lengths = lengths
        width = hidden.shape[1] - 1
        leading = torch.ones(width, dtype=torch.long, device=device)
        for s, out in model.depth_outputs(tokens, hidden):
            n = out.shape[1] - 1
            j = torch.arange(n, device=device)
            valid = (j + s + 2 <= int(lengths[0])) & (j >= start)
            draft = head(out[0, :n]).float()
            teacher = head(hidden[0, s + 1:s + 1 + n]).float()
            agree = (draft.argmax(-1) == teacher.argmax(-1)) & valid
            sums["agree"][s] += int(agree.sum())
            sums["count"][s] += int(valid.sum())
            if s == 0:
                base = valid
                sums["steps"] += int(base.sum())
                if by_sequence:
                    sequences.append(_own_drafts(tokens[0, :int(lengths[0])], start,
                                                 draft.argmax(-1)))
                _served(sums, store.outputs[i] if store.outputs else None, out[0, :n], teacher,
                        valid, head)
                _sampled(sums, draft[valid], teacher[valid], temperature)
            # A step with s + 1 drafts accepts depth s only after every shallower depth.
            leading = torch.nn.functional.pad(leading[:n] * agree.long(), (0, width - n))
            sums["by_k"][s] += int(leading[base].sum())
    figures = _figures(sums, depth, unroll, temperature, len(store))
    return {**figures, "by_sequence": sequences} if by_sequence else figures


def _own_drafts(tokens: torch.Tensor, start: int, drafts: torch.Tensor) -> dict:
    """One sequence's tokens and, for each position j a served draft can be made at (from the
    prompt's last token to the third-last token), whether the layer's own first draft there is
    the token the target put at j + 2 (``doctor/paired.py`` pairs them with the served drafts)."""
    last = tokens.numel() - 3
    own = (drafts[start:last + 1] == tokens[start + 2:last + 3]).tolist() if last >= start else []
    return {"tokens": tokens.tolist(), "start": start, "agree": own}


def _served(sums: dict, recorded: torch.Tensor | None, reference: torch.Tensor,
            teacher: torch.Tensor, valid: torch.Tensor, head) -> None:
    """The recorded served output next to the files' layer output at depth 0."""
    if recorded is None:
        return
    served = recorded[:reference.shape[0]].to(reference.device, torch.float32)[valid]
    reference = reference[valid]
    agree = head(served).float().argmax(-1) == teacher[valid].argmax(-1)
    sums["served_agree"] += int(agree.sum())
    sums["served_count"] += int(valid.sum())
    distance = (served - reference).norm(dim=-1) / reference.norm(dim=-1).clamp_min(1e-6)
    sums["distance"] += float(distance.sum())


def _sampled(sums: dict, draft: torch.Tensor, teacher: torch.Tensor, temperature: float) -> None:
    p = torch.softmax(teacher / temperature, -1)
    q = torch.softmax(draft / temperature, -1)
    sums["greedy_t"] += float(p.gather(-1, draft.argmax(-1, keepdim=True)).sum())
    sums["probabilistic_t"] += float(torch.minimum(p, q).sum())


def _figures(sums: dict, depth: int, unroll: str, temperature: float, sequences: int) -> dict:
    count = sums["count"][0]
    agreement = [a / c if c else None for a, c in zip(sums["agree"], sums["count"])]
    served = sums["served_count"]
    return {
        "sequences": sequences,
        "positions": count,
        "unroll": unroll,
        "agreement": agreement,
        "agreement_interval": wilson(sums["agree"][0], count),
        "accepted_by_k": [sums["by_k"][s] / sums["steps"] if sums["steps"] else None
                          for s in range(depth)],
        "served_output": None if not served else {
            "agreement": sums["served_agree"] / served,
            "agreement_interval": wilson(sums["served_agree"], served),
            "relative_distance": sums["distance"] / served},
        "sampled": {"temperature": temperature,
                    "greedy_drafts": sums["greedy_t"] / count if count else None,
                    "probabilistic_drafts": sums["probabilistic_t"] / count if count else None},
    }


def expected_tokens_per_step(accepted_by_k: list[float | None]) -> list[float | None]:
    """Tokens a step emits with k drafts: one from the target plus the drafts accepted, summed
    over depths 1..k (``accepted_by_k[s]``: the share of steps whose first s + 1 drafts agree)."""
    out, total = [], 1.0
    for share in accepted_by_k:
        total = total + share if share is not None and not math.isnan(share) else float("nan")
        out.append(None if math.isnan(total) else total)
    return out
