"""Speculative-decoding figures from vLLM's Prometheus counters (``/metrics``).

Definitions are vLLM's (``v1/spec_decode/metrics.py``): acceptance rate = accepted / draft tokens,
mean acceptance length = 1 + accepted / drafts, per-position rate = accepted at position i / drafts.
Counters are cumulative, so a run is measured as the difference of two scrapes.
"""

from __future__ import annotations

import dataclasses
import urllib.request
from collections.abc import Iterable

import regex as re

PREFIX = "vllm:spec_decode_"
_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)"
)
_LABEL = re.compile(r'(?P<key>[a-zA-Z_][a-zA-Z0-9_]*)="(?P<value>(?:[^"\\]|\\.)*)"')


@dataclasses.dataclass(frozen=True)
class SpecDecodeCounters:
    """Cumulative counters of one server (summed over engines and models)."""

    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_position: tuple[float, ...] = ()

    def __sub__(self, earlier: "SpecDecodeCounters") -> "SpecDecodeCounters":
        n = max(len(self.accepted_per_position), len(earlier.accepted_per_position))
        pad = lambda v: tuple(v) + (0.0,) * (n - len(v))  # noqa: E731
        return SpecDecodeCounters(
            self.num_drafts - earlier.num_drafts,
            self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
            tuple(a - b for a, b in zip(pad(self.accepted_per_position),
                                        pad(earlier.accepted_per_position))),
        )

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def per_position_acceptance(self) -> list[float]:
        if not self.num_drafts:
            return []
        return [a / self.num_drafts for a in self.accepted_per_position]

    def summary(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance": self.per_position_acceptance,
        }


def parse_prometheus(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``(metric name, sorted labels) -> value`` for every sample line of a text exposition."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        labels = tuple(sorted((lm["key"], lm["value"]) for lm in _LABEL.finditer(m["labels"] or "")))
        samples[(m["name"], labels)] = float(m["value"])
    return samples


def counters_from_prometheus(text: str) -> SpecDecodeCounters:
    """The spec-decode counters of a ``/metrics`` page (``_total`` suffix optional)."""
    totals: dict[str, float] = {}
    per_position: dict[int, float] = {}
    for (name, labels), value in parse_prometheus(text).items():
        if not name.startswith(PREFIX) or name.endswith("_created"):
            continue
        key = name[len(PREFIX):].removesuffix("_total")
        if key == "num_accepted_tokens_per_pos":
            position = int(dict(labels).get("position", "0"))
            per_position[position] = per_position.get(position, 0.0) + value
        else:
            totals[key] = totals.get(key, 0.0) + value
    positions = tuple(per_position.get(i, 0.0) for i in range(max(per_position, default=-1) + 1))
    return SpecDecodeCounters(
        totals.get("num_drafts", 0.0),
        totals.get("num_draft_tokens", 0.0),
        totals.get("num_accepted_tokens", 0.0),
        positions,
    )


def counters_from_llm_metrics(metrics) -> SpecDecodeCounters:
    """The same counters from ``LLM.get_metrics()`` (offline engines; no ``_total`` suffix)."""
    values: dict[str, object] = {}
    for metric in metrics:
        if metric.name.startswith(PREFIX):
            values[metric.name[len(PREFIX):]] = getattr(metric, "values", None) or getattr(
                metric, "value", 0)
    return SpecDecodeCounters(
        float(values.get("num_drafts", 0) or 0),
        float(values.get("num_draft_tokens", 0) or 0),
        float(values.get("num_accepted_tokens", 0) or 0),
        tuple(float(v) for v in (values.get("num_accepted_tokens_per_pos") or ())),
    )


def counters_from_summary(summary: dict | None) -> SpecDecodeCounters:
    """Invert ``SpecDecodeCounters.summary()``."""
    if not summary:
        return SpecDecodeCounters()
    return SpecDecodeCounters(summary["num_drafts"], summary["num_draft_tokens"],
                              summary["num_accepted_tokens"],
                              tuple(summary.get("accepted_per_position") or ()))


def total_counters(summaries: Iterable[dict | None]) -> SpecDecodeCounters:
    """Counters of several runs added up (a ratio of sums, not a mean of ratios)."""
    drafts = draft_tokens = accepted = 0.0
    per_position: list[float] = []
    for c in map(counters_from_summary, summaries):
        drafts += c.num_drafts
        draft_tokens += c.num_draft_tokens
        accepted += c.num_accepted_tokens
        per_position += [0.0] * (len(c.accepted_per_position) - len(per_position))
        for i, value in enumerate(c.accepted_per_position):
            per_position[i] += value
    return SpecDecodeCounters(drafts, draft_tokens, accepted, tuple(per_position))


def page(base_url: str, timeout: float = 10.0) -> str:
    """The ``/metrics`` text of a server (``base_url`` with or without ``/v1``)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/metrics", timeout=timeout) as response:
        return response.read().decode()


def scrape(base_url: str, timeout: float = 10.0) -> SpecDecodeCounters:
    """Read the spec-decode counters of a server's ``/metrics``."""
    return counters_from_prometheus(page(base_url, timeout))


def format_table(counters: SpecDecodeCounters) -> str:
    """A small text table: overall figures, then acceptance per draft position."""
    s = counters.summary()
    if not counters.num_drafts:
        return "no drafts were made (is speculative decoding on?)"
    rows = [
        ("drafts", f"{s['num_drafts']:.0f}"),
        ("draft tokens", f"{s['num_draft_tokens']:.0f}"),
        ("accepted tokens", f"{s['num_accepted_tokens']:.0f}"),
        ("acceptance rate", f"{s['acceptance_rate']:.1%}"),
        ("mean acceptance length", f"{s['mean_acceptance_length']:.2f}"),
    ]
    rows += [(f"  position {i}", f"{rate:.1%}") for i, rate in enumerate(s["per_position_acceptance"])]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v:>8}" for k, v in rows)
