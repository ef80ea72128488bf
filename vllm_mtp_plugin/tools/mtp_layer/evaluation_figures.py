"""The figures of an MTP layer's evaluation on recorded drafter inputs, shared by the V3
(``evaluation.py``) and V4 (``evaluation_v4.py``) evaluations."""

from __future__ import annotations

import torch

from ..stats import wilson


def new_sums(depth: int) -> dict:
    return {"agree": [0] * depth, "count": [0] * depth, "served_agree": 0, "served_count": 0,
            "distance": 0.0, "greedy_t": 0.0, "probabilistic_t": 0.0, "by_k": [0] * depth,
            "steps": 0}


def new_walk(width: int, device) -> dict:
    """One sequence's state across depths: which positions' drafts all agreed so far."""
    return {"leading": torch.ones(width, dtype=torch.long, device=device), "base": None}


def count_depth(sums: dict, walk: dict, s: int, draft: torch.Tensor, teacher: torch.Tensor,
                valid: torch.Tensor) -> None:
    """Depth ``s``'s drafts (logits ``[n, V]``) against the target's (``teacher``) at the
    ``valid`` positions; a step with s + 1 drafts accepts depth s only after every shallower
    depth (``accepted_by_k``)."""
    agree = (draft.argmax(-1) == teacher.argmax(-1)) & valid
    sums["agree"][s] += int(agree.sum())
    sums["count"][s] += int(valid.sum())
    if s == 0:
        walk["base"] = valid
        sums["steps"] += int(valid.sum())
    width = walk["leading"].shape[0]
    walk["leading"] = torch.nn.functional.pad(walk["leading"][:draft.shape[0]] * agree.long(),
                                              (0, width - draft.shape[0]))
    sums["by_k"][s] += int(walk["leading"][walk["base"]].sum())


def own_drafts(tokens: torch.Tensor, start: int, drafts: torch.Tensor) -> dict:
    """One sequence's tokens and, for each position j a served draft can be made at (from the
    prompt's last token to the third-last token), whether the layer's own first draft there is
    the token the target put at j + 2 (``doctor/paired.py`` pairs them with the served drafts)."""
    last = tokens.numel() - 3
    own = (drafts[start:last + 1] == tokens[start + 2:last + 3]).tolist() if last >= start else []
    return {"tokens": tokens.tolist(), "start": start, "agree": own}


def served(sums: dict, recorded: torch.Tensor | None, reference: torch.Tensor,
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


def sampled(sums: dict, draft: torch.Tensor, teacher: torch.Tensor, temperature: float) -> None:
    p = torch.softmax(teacher / temperature, -1)
    q = torch.softmax(draft / temperature, -1)
    sums["greedy_t"] += float(p.gather(-1, draft.argmax(-1, keepdim=True)).sum())
    sums["probabilistic_t"] += float(torch.minimum(p, q).sum())


def figures(sums: dict, depth: int, unroll: str, temperature: float, sequences: int) -> dict:
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
