"""What ``vllm-mtp tune`` concludes, in memory: concurrencies and k are ints throughout.

JSON object keys are text, so ``tune.json`` stores them as text; ``to_json`` writes them so and
``from_json`` reads them back to ints, and nothing else converts. The JSON layout is the one
``tune.json`` has always had (vLLM's schedule key first, the chosen draft method's figures at the
top level, every method's under ``draft_methods`` when several were measured).
"""

from __future__ import annotations

import dataclasses


def int_keys(mapping: dict) -> dict:
    """``{"4": x}`` (as JSON stores it) -> ``{4: x}``, one level deep."""
    return {int(key): value for key, value in mapping.items()}


def text_keys(mapping: dict) -> dict:
    """``{4: x}`` -> ``{"4": x}``, as JSON stores it, one level deep."""
    return {str(key): value for key, value in mapping.items()}


@dataclasses.dataclass
class Acceptance:
    """Acceptance of one draft method, from the counters of its k = max-k engine."""

    acceptance_lengths: list[float]  # tau_0 .. tau_max_k
    counters_at_max_k: dict  # vLLM's spec-decode counters, summed

    @property
    def per_position(self) -> list[float]:
        """The acceptance rate of each draft position: tau_i - tau_(i-1)."""
        taus = self.acceptance_lengths
        return [b - a for a, b in zip(taus, taus[1:])]

    def to_json(self) -> dict:
        return {"acceptance_lengths": self.acceptance_lengths, "per_position": self.per_position,
                "counters_at_max_k": self.counters_at_max_k}

    @classmethod
    def from_json(cls, data: dict) -> Acceptance:
        return cls(data["acceptance_lengths"], data["counters_at_max_k"])


@dataclasses.dataclass
class MethodChoice:
    """One draft method's expected throughput per (concurrency, k) and its best k per
    concurrency."""

    best_fixed_k: dict[int, int]  # {concurrency: k}
    expected_tok_s: dict[int, dict[int, float]]  # {concurrency: {k: tokens/s}}
    acceptance: Acceptance
    # Mean over concurrencies of the best k's speed-up over k = 0 (of the best k > 0); stored
    # per method only when several were measured.
    mean_best_speedup: float | None = None
    mean_best_speculative_speedup: float | None = None

    @property
    def expected_speedup(self) -> dict[int, dict[int, float]]:
        """Expected tokens/s over k = 0's, where k = 0 was measured."""
        return {c: {k: v / by_k[0] for k, v in by_k.items()}
                for c, by_k in self.expected_tok_s.items() if by_k.get(0)}

    def to_json(self, means: bool = True) -> dict:
        figures = {"best_fixed_k": text_keys(self.best_fixed_k),
                   "expected_tok_s": {str(c): text_keys(by_k)
                                      for c, by_k in self.expected_tok_s.items()},
                   "expected_speedup": {str(c): text_keys(by_k)
                                        for c, by_k in self.expected_speedup.items()}}
        if means:
            figures.update(mean_best_speedup=self.mean_best_speedup,
                           mean_best_speculative_speedup=self.mean_best_speculative_speedup)
        return {**figures, "acceptance": self.acceptance.to_json()}

    @classmethod
    def from_json(cls, data: dict) -> MethodChoice:
        return cls(best_fixed_k=int_keys(data["best_fixed_k"]),
                   expected_tok_s={int(c): int_keys(by_k)
                                   for c, by_k in data["expected_tok_s"].items()},
                   acceptance=Acceptance.from_json(data["acceptance"]),
                   mean_best_speedup=data.get("mean_best_speedup"),
                   mean_best_speculative_speedup=data.get("mean_best_speculative_speedup"))


@dataclasses.dataclass
class TuneResult:
    """``tune.json``: the recommendation and what it was derived from."""

    schedule: list[list[int]] | None  # vLLM's num_speculative_tokens_per_batch_size
    speculative_config: dict | None
    draft_sample_method: str  # the chosen one
    choices: dict[str, MethodChoice]  # every draft method measured
    measurements: list[dict]  # tune/measure.py's points
    compilation: list[str]
    ks_measured: list[int] | None
    settings: dict
    plausibility: dict | None = None  # how many measurements, the problems of the last
    refused: list[str] | None = None  # why nothing is recommended
    machine: dict | None = None

    @property
    def chosen(self) -> MethodChoice:
        return self.choices[self.draft_sample_method]

    @property
    def several_methods(self) -> bool:
        return len(self.choices) > 1

    def to_json(self) -> dict:
        top = self.chosen.to_json(means=False)
        data = {"num_speculative_tokens_per_batch_size": self.schedule,
                "speculative_config": self.speculative_config,
                "draft_sample_method": self.draft_sample_method, **top,
                "draft_methods": {m: c.to_json() for m, c in self.choices.items()}
                if self.several_methods else None,
                "measurements": self.measurements, "compilation": self.compilation,
                "ks_measured": self.ks_measured, "settings": self.settings}
        for name in ("plausibility", "refused", "machine"):
            if getattr(self, name) is not None:
                data[name] = getattr(self, name)
        return data

    @classmethod
    def from_json(cls, data: dict) -> TuneResult:
        method = data.get("draft_sample_method") or "greedy"
        choices = ({m: MethodChoice.from_json(c) for m, c in data["draft_methods"].items()}
                   if data.get("draft_methods") else {method: MethodChoice.from_json(data)})
        return cls(schedule=data.get("num_speculative_tokens_per_batch_size"),
                   speculative_config=data.get("speculative_config"),
                   draft_sample_method=method, choices=choices,
                   measurements=data["measurements"], compilation=data.get("compilation") or [],
                   ks_measured=data.get("ks_measured"), settings=data["settings"],
                   plausibility=data.get("plausibility"), refused=data.get("refused"),
                   machine=data.get("machine"))


@dataclasses.dataclass
class Verdict:
    """``tune check``'s finding at one concurrency: tune's k against a fixed-k sweep's best."""

    concurrency: int
    tuned_k: int
    measured_best_k: int
    tok_s: dict[int, dict]  # {k: {"median", "low", "high", "passes"}}, k ascending
    tuned_over_best: float
    tuned_over_no_speculation: float
    pick: str  # "best", "within noise" or "missed"
    slower_than_no_speculation: bool
    # one pass has no range: a pick a hair below the best then counts as missed
    single_pass: bool

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "tok_s": text_keys(self.tok_s)}
