"""The served drafts against the layer's own, position by position.

Two acceptance rates measured on different draws differ by sampling noise: a few hundred drafts
each give 95 % intervals about 0.05 wide on either side, so a serving fault that costs 0.05 to
0.10 of first-position acceptance can hide between them. Here both figures come from the same
positions of the same text. vLLM records, per request, how many drafts each verify step accepted
(``per_request_spec_decode_metrics="detailed"``); with one draft per step (k = 1) that fixes where
every served draft was made: the first at the prompt's last token, the next one position later
after a rejection and two after an acceptance. The reference knows, at each position, whether the
layer from the files drafts the token that followed (``reference._own_drafts``). A served layer
that computes what the files say is accepted exactly where the layer's own draft is right (up to
near-ties between the served dtype and the reference's float32); a fault shows as positions where
the layer is right and the served draft was rejected (``lost``) outnumbering the reverse
(``gained``). The drop ``(lost - gained) / pairs`` has a 95 % interval from the discordant pairs
alone, narrow wherever serving is faithful.
"""

from __future__ import annotations

import math

# The smallest serving drop (absolute first-position acceptance) doctor is sized to tell, and the
# estimate from which it calls one (half-way, so a drop of DETECTABLE_DROP is not missed by noise).
DETECTABLE_DROP = 0.05
SERVING_DROP = 0.025
MIN_PAIRS = 100  # below this the paired figure is not used (the unpaired rule decides)


def served_positions(prompt_length: int, accepted_per_step: list[int],
                     drafted_per_step: list[int]):
    """``(position, accepted)`` of each step's first draft: made at the prompt's last token, then
    one position further per token the step emitted (its accepted drafts and the target's own)."""
    position = prompt_length - 1
    for accepted, drafted in zip(accepted_per_step, drafted_per_step):
        if drafted < 1:
            continue
        yield position, accepted >= 1
        position += accepted + 1


def pair(by_sequence: list[dict], served: list[dict]) -> dict | None:
    """Pair every served draft with the layer's own at the same position of the same text.

    ``by_sequence``: the reference's sequences (``tokens``, ``start``, ``agree``); ``served``: the
    probe's requests (``prompt_token_ids``, ``token_ids``, ``accepted_per_step``,
    ``drafted_per_step``). A request pairs with the sequence of the same prompt, up to the first
    token where the two texts part (past it the drafter saw other inputs). None when nothing
    pairs."""
    by_prompt = {}
    for sequence in by_sequence:
        by_prompt.setdefault(tuple(sequence["tokens"][:sequence["start"] + 1]), sequence)
    counts = {"both": 0, "lost": 0, "gained": 0, "neither": 0}
    requests = 0
    for request in served:
        prompt = request["prompt_token_ids"]
        sequence = by_prompt.get(tuple(prompt))
        if sequence is None:
            continue
        requests += 1
        text = list(prompt) + list(request["token_ids"])
        same = _common_length(text, sequence["tokens"])
        for position, accepted in served_positions(len(prompt), request["accepted_per_step"],
                                                   request["drafted_per_step"]):
            index = position - sequence["start"]
            if position + 2 >= same or not 0 <= index < len(sequence["agree"]):
                break
            own = sequence["agree"][index]
            counts[("both" if own else "gained") if accepted else ("lost" if own else "neither")] += 1
    pairs = sum(counts.values())
    if not pairs:
        return None
    lost, gained = counts["lost"], counts["gained"]
    return {"pairs": pairs, "requests": requests, "of_requests": len(served), **counts,
            "served": (counts["both"] + gained) / pairs, "own": (counts["both"] + lost) / pairs,
            "drop": (lost - gained) / pairs, "drop_interval": drop_interval(lost, gained, pairs),
            "detectable_drop": DETECTABLE_DROP}


def _common_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def drop_interval(lost: int, gained: int, pairs: int, z: float = 1.96) -> list[float]:
    """95 % interval of the paired difference of two proportions (Wald, with half a pair added
    to each of the four cells, Agresti and Min 2005), from the discordant counts."""
    n = pairs + 2
    b, c = lost + 0.5, gained + 0.5
    diff = (b - c) / n
    spread = z * math.sqrt(max((b + c) / n - diff * diff, 0.0) / n)
    return [diff - spread, diff + spread]


def tells_a_serving_drop(paired: dict | None) -> bool | None:
    """True: the served drafts lose at least ``SERVING_DROP`` against the layer's own, surely
    (interval above 0); False: they do not; None: too few pairs to say."""
    if paired is None or paired["pairs"] < MIN_PAIRS:
        return None
    return paired["drop"] >= SERVING_DROP and paired["drop_interval"][0] > 0
