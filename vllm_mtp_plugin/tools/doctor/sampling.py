"""Are two sets of sampled tokens drawn from the same distribution? A chi-square test of
homogeneity, summed over independent groups.

Speculative decoding with rejection sampling is lossless in distribution: with MTP, the token a
request samples at an output position has the distribution it has without MTP (not the same token:
the random draws are consumed differently). Tokens of one request depend on each other, so a group
holds one token per request (one output position of one prompt, over many seeds); groups are
independent, so their statistics and degrees of freedom add up.
"""

from __future__ import annotations

from collections import Counter

MIN_COUNT = 10  # tokens seen fewer times (both sides together) are pooled into one category


def group_statistic(a: list[int], b: list[int]) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of the 2 x C table of token counts."""
    ca, cb = Counter(a), Counter(b)
    kept = [t for t in set(ca) | set(cb) if ca[t] + cb[t] >= MIN_COUNT]
    rows_a = [ca[t] for t in kept] + [sum(ca[t] for t in ca if t not in kept)]
    rows_b = [cb[t] for t in kept] + [sum(cb[t] for t in cb if t not in kept)]
    columns = [(x, y) for x, y in zip(rows_a, rows_b) if x + y > 0]
    na, nb = sum(x for x, _ in columns), sum(y for _, y in columns)
    if len(columns) < 2 or not na or not nb:
        return 0.0, 0
    total = na + nb
    stat = 0.0
    for x, y in columns:
        ea, eb = (x + y) * na / total, (x + y) * nb / total
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    return stat, len(columns) - 1


def chi_square_p(stat: float, dof: int) -> float:
    """P(chi-square with ``dof`` degrees of freedom >= stat)."""
    if dof <= 0:
        return 1.0
    import torch

    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def homogeneity(groups: list[tuple[list[int], list[int]]]) -> dict:
    """The summed test over ``groups`` of (tokens without, tokens with): statistic, degrees of
    freedom, p-value, and each side's share of its group's most frequent token (a sampler that
    accepts drafts it should reject moves mass to the drafted, likeliest tokens)."""
    stat, dof = 0.0, 0
    for a, b in groups:
        s, d = group_statistic(a, b)
        stat, dof = stat + s, dof + d

    def top_share(side: int) -> float | None:
        tops = [Counter(g[side]).most_common(1)[0][1] / len(g[side]) for g in groups if g[side]]
        return sum(tops) / len(tops) if tops else None

    return {"chi_square": stat, "dof": dof, "p_value": chi_square_p(stat, dof),
            "groups": len(groups), "samples": sum(len(a) for a, _ in groups),
            "top_token_share": [top_share(0), top_share(1)]}
