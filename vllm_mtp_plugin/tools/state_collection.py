"""Collect training data through vLLM: the target's continuations and the drafter's inputs.

Two passes on one engine, per chunk of prompts (one data shard each, so a stopped collection
resumes at the first missing shard):

1. the target continues each prompt (``temperature``: self-distillation samples the target's own
   distribution; per-request seeds make a re-run produce the same text);
2. each prompt + continuation is prefilled once more while the plugin's drafter records what it
   receives (``vllm_mtp_plugin.recording``): the hidden state vLLM hands the MTP drafter at every
   position, byte for byte what the drafter gets when serving.

The engine drafts with MTP (k = 1) so that vLLM builds the drafter: a target without an MTP layer
is served for collection with the layer training starts from (a scaffold checkpoint); its drafts
do not matter, only its inputs. It runs eagerly (recording is a Python side effect that a captured
graph would skip), without prefix caching (a cached prefix never reaches the drafter) and without
chunked prefill (the last row of a partial prefill carries a placeholder token, not the next one).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path

from .mtp_layer.drafter_inputs import assemble, encode_prompts, load_training_prompts
from .mtp_layer.shard_format import write_shard

MANIFEST = "manifest.json"


@dataclasses.dataclass
class CollectSettings:
    temperature: float = 1.0
    max_new_tokens: int = 128
    samples_per_prompt: int = 1
    max_len: int = 512  # prompt + continuation, in tokens
    sequences_per_shard: int = 256
    seed: int = 0
    # Store what the served MTP layer returned too (``vllm-mtp doctor``'s layer comparison).
    record_outputs: bool = False


@dataclasses.dataclass
class CollectJob:
    """One collection, as ``vllm-mtp train`` and ``vllm-mtp doctor`` hand it to a process of its
    own (``main``)."""

    model_dir: str  # the target
    prompts: str  # the prompt file
    data_dir: str  # where the shards go
    settings: CollectSettings
    dtype: str = "auto"  # vLLM's --dtype
    serve_dir: str | None = None  # the checkpoint the engine loads, when not the target
    engine_kwargs: dict | None = None  # more ``LLM(...)`` keywords


def _fingerprint(target: Path, prompts_path: Path, settings: CollectSettings) -> dict:
    digest = hashlib.sha256(prompts_path.read_bytes()).hexdigest()
    return {"target": str(target.resolve()), "prompts_sha256": digest,
            "settings": {k: v for k, v in dataclasses.asdict(settings).items()
                         if k != "sequences_per_shard"}}


MAX_NUM_SEQS = 256  # vLLM's default batch


def cpu_kv_cache_bytes(config: dict, max_len: int) -> int | None:
    """On CPUs vLLM sizes the KV cache at most of the machine's memory unless told (allocating
    20 GiB took 50 s on a 24 GiB machine): the collecting engine needs a full batch of sequences
    of ``max_len`` - MLA's latent (kv_lora_rank + qk_rope_head_dim) per layer and token, bf16 or
    fp32, with a quarter to spare. None on other platforms (vLLM's own sizing) or when
    ``VLLM_CPU_KVCACHE_SPACE`` says."""
    import os

    from ..platform import platform_family

    if platform_family() != "cpu" or "VLLM_CPU_KVCACHE_SPACE" in os.environ:
        return None
    per_token = (config.get("kv_lora_rank", 512) + config.get("qk_rope_head_dim", 64)) * 4 * (
        config["num_hidden_layers"] + 1)
    return int(1.25 * MAX_NUM_SEQS * (max_len + 1) * per_token)


def cpu_without_bf16() -> bool:
    from ..platform import platform_family
    from .cpu_features import AVX512_BF16, host_cpu_flags

    return platform_family() == "cpu" and AVX512_BF16 not in host_cpu_flags()


def _engine(model_dir: Path, dtype: str, max_len: int, engine_kwargs: dict):
    from vllm import LLM

    from .engine.eager_reasons import eager_for

    if dtype == "auto" and cpu_without_bf16():
        dtype = "float32"  # bf16 is compute-bound there (docs/platforms.md: "On CPU")
    extra = {}
    kv_bytes = cpu_kv_cache_bytes(json.loads((model_dir / "config.json").read_text()), max_len)
    if kv_bytes is not None:
        extra["kv_cache_memory_bytes"] = kv_bytes
    return LLM(str(model_dir), speculative_config={"method": "mtp", "num_speculative_tokens": 1},
               enforce_eager=eager_for("training-collection"),
               enable_prefix_caching=False, enable_chunked_prefill=False,
               max_model_len=max_len + 1, dtype=dtype, disable_log_stats=False,
               worker_extension_cls="vllm_mtp_plugin.recording.RecordingWorkerExtension",
               **{**extra, **engine_kwargs})


def _record_prefills(llm, sequences: list[list[int]], raw: Path, outputs: bool = False
                     ) -> tuple[list, list[int]]:
    """Prefill ``sequences`` with recording on; returns the recorded calls and each sequence's
    next token (the target's greedy choice)."""
    from safetensors.torch import load_file
    from vllm import SamplingParams, TokensPrompt

    writers = llm.collective_rpc("start_mtp_recording", args=(str(raw), outputs))
    if not any(writers):
        raise RuntimeError("no vLLM worker recorded the drafter's inputs")
    outputs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences],
                           SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    llm.collective_rpc("stop_mtp_recording")
    calls = [load_file(str(f)) for f in sorted(raw.glob("call-*.safetensors"))]
    return calls, [o.outputs[0].token_ids[0] for o in outputs]


def collect(model_dir: str | Path, prompts_path: str | Path, data_dir: str | Path,
            settings: CollectSettings, dtype: str = "auto", serve_dir: str | Path | None = None,
            engine_kwargs: dict | None = None, progress=print) -> dict:
    """Fill ``data_dir`` with shards (``mtp_layer/shard_format.py``); returns the manifest.
    ``serve_dir`` is the
    checkpoint the engine loads (a scaffold with an MTP layer), ``model_dir`` the target."""
    from vllm import SamplingParams, TokensPrompt

    from .engine.metrics import counters_from_llm_metrics

    model_dir, data_dir, prompts_path = Path(model_dir), Path(data_dir), Path(prompts_path)
    data_dir.mkdir(parents=True, exist_ok=True)
    prompts = load_training_prompts(prompts_path)
    fingerprint = _fingerprint(model_dir, prompts_path, settings)
    manifest_path = data_dir / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else None
    if manifest is not None and manifest["fingerprint"] != fingerprint:
        raise ValueError(f"{data_dir} holds data collected from another target, prompt file or "
                         "settings; give a new work directory or the same options.")
    manifest = manifest or {"fingerprint": fingerprint, "shards": []}
    done = {s["first"] for s in manifest["shards"]}
    items = [(p, k) for p in range(len(prompts)) for k in range(settings.samples_per_prompt)]
    chunks = [items[i:i + settings.sequences_per_shard]
              for i in range(0, len(items), settings.sequences_per_shard)]
    if all(i * settings.sequences_per_shard in done for i in range(len(chunks))):
        return manifest
    llm = _engine(Path(serve_dir or model_dir), dtype, settings.max_len, engine_kwargs or {})
    encoded = encode_prompts(llm.get_tokenizer(), prompts, str(prompts_path))
    skipped = sum(len(ids) >= settings.max_len for ids in encoded)
    for n, chunk in enumerate(chunks):
        first = n * settings.sequences_per_shard
        if first in done:
            continue
        chunk = [(p, k) for p, k in chunk if len(encoded[p]) < settings.max_len]
        if not chunk:  # every prompt of this chunk is longer than --max-len
            manifest["shards"].append({"file": None, "first": first, "sequences": 0,
                                       "tokens": 0})
            continue
        params = [SamplingParams(temperature=settings.temperature, seed=settings.seed + p * 1000
                                 + k, max_tokens=min(settings.max_new_tokens,
                                                     settings.max_len - len(encoded[p])))
                  for p, k in chunk]
        started = time.monotonic()
        before = counters_from_llm_metrics(llm.get_metrics())
        generated = llm.generate([TokensPrompt(prompt_token_ids=encoded[p]) for p, _ in chunk],
                                 params, use_tqdm=False)
        sequences = [encoded[p] + list(g.outputs[0].token_ids) for (p, _), g in
                     zip(chunk, generated)]
        generating = time.monotonic() - started
        # The drafts this engine made while generating (k = 1): its served acceptance.
        drafting = (counters_from_llm_metrics(llm.get_metrics()) - before).summary()
        with tempfile.TemporaryDirectory(dir=data_dir, prefix=".raw-") as raw:
            calls, next_tokens = _record_prefills(llm, sequences, Path(raw),
                                                  settings.record_outputs)
            fed = [s[1:] + [t] for s, t in zip(sequences, next_tokens)]
            hidden = assemble(calls, fed)
            outputs = assemble(calls, fed, "output") if settings.record_outputs else None
        name = f"shard-{n:05d}.safetensors"
        write_shard(data_dir / name, sequences, next_tokens, hidden,
                    [len(encoded[p]) for p, _ in chunk],
                    {"prompts": [p for p, _ in chunk], "target": str(model_dir)}, outputs)
        manifest["shards"].append({"file": name, "first": first, "sequences": len(sequences),
                                   "tokens": sum(map(len, sequences)), "spec_decode": drafting})
        manifest["skipped_long_prompts"] = skipped
        manifest_path.write_text(json.dumps(manifest, indent=1))
        progress(f"collected shard {n + 1}/{len(chunks)}: {len(sequences)} sequences, "
                 f"{sum(map(len, sequences))} tokens ({generating:.0f} s generating, "
                 f"{time.monotonic() - started - generating:.0f} s recording)")
    del llm
    shutil.rmtree(data_dir / ".scaffold", ignore_errors=True)
    return manifest


def main(argv: list[str]) -> int:
    """``python -m vllm_mtp_plugin.tools.state_collection JOB.json``: one collection in a process of
    its own (the engine's memory goes with it before training starts)."""
    from .job_files import read_job

    job = read_job(CollectJob, argv[0])
    collect(job.model_dir, job.prompts, job.data_dir, job.settings, dtype=job.dtype,
            serve_dir=job.serve_dir, engine_kwargs=job.engine_kwargs)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
