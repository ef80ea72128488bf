"""Measure what ``vllm-mtp train`` does to acceptance, with vLLM's counters, on the trained tiny
DeepSeek and held-out prompts (``tools/data/trained_prompts.jsonl``, none of them used for
training). Writes ``benchmarks/results/training/<proof>.json``; ``docs/training.md`` shows them.

    python benchmarks/train_proofs.py graft      # (a) no MTP layer -> trained from scratch
    python benchmarks/train_proofs.py recursive  # (c) depth-3 recursive vs depth-1 training
    python benchmarks/train_proofs.py foreign    # (d) a target written by transformers

Each proof runs ``vllm-mtp train`` with its defaults (unless stated), then serves every
checkpoint at k = 1..3 (V1 runner, vLLM's default compilation, greedy, 4 held-out prompts per kind
x 64 tokens) and records per-position acceptance.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from vllm_mtp_plugin.tools.bench.prompts import load_prompt_groups
from vllm_mtp_plugin.tools.offline import OfflineConfig, run_config
from vllm_mtp_plugin.tools.tiny import trained

RESULTS = Path(__file__).parent / "results" / "training"
PROMPTS = trained.shipped_dir().parent / "trained_prompts.jsonl"


def acceptance(model: Path, ks=(1, 2, 3)) -> dict:
    """Per k: per-position acceptance and acceptance length, over all held-out prompts."""
    groups = load_prompt_groups(PROMPTS)
    prompts = [p for kind, ps in groups.items() if kind != "chat" for p in ps]
    rows = {}
    for k in ks:
        run = run_config(OfflineConfig(model=str(model), num_speculative_tokens=k, prompts=prompts,
                                       max_tokens=64, llm_kwargs={"dtype": "bfloat16"},
                                       default_process_mode=False))
        spec = run["spec_decode"]
        rows[k] = {"per_position": spec["per_position_acceptance"],
                   "acceptance_length": 1 + spec["num_accepted_tokens"] / spec["num_drafts"]}
        print(model.name, k, rows[k], flush=True)
    return rows


def train(target: Path, out: Path, *extra: str) -> dict:
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "vllm_mtp_plugin.tools.cli", "train", str(target),
                    "--out", str(out), "--quiet", *extra], check=True)
    record = json.loads((out / "training" / "training.json").read_text())
    return {"seconds": round(time.monotonic() - started), "options": list(extra),
            "held_out": record["held_out"], "sequences": record["sequences"],
            "tokens": record["tokens"]}


def graft(root: Path) -> dict:
    full = trained.write_checkpoint(root / "full", 1)
    bare = trained.write_checkpoint(root / "bare", 0)
    run = train(bare, root / "grafted")
    return {"train": run, "jointly_trained": acceptance(full),
            "trained_from_scratch": acceptance(root / "grafted"),
            "untrained_initial_layer": acceptance(root / "grafted.work" / "scaffold", ks=(1,))}


def recursive(root: Path) -> dict:
    bare = trained.write_checkpoint(root / "bare", 0)
    one = train(bare, root / "depth1")
    three = train(bare, root / "depth3", "--depth", "3", "--unroll", "recursive")
    return {"train_depth1": one, "train_depth3_recursive": three,
            "depth1": acceptance(root / "depth1"), "depth3_recursive": acceptance(root / "depth3")}


def foreign(root: Path) -> dict:
    """The trained target re-saved by transformers (its own file names, 2 MB shards, an index,
    its config writer) without the MTP layer: a checkpoint the project did not write."""
    import torch
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    full = trained.write_checkpoint(root / "full", 1)
    model = DeepseekV3ForCausalLM.from_pretrained(full, dtype=torch.bfloat16)
    model.config.num_nextn_predict_layers = 0
    model.save_pretrained(root / "foreign", max_shard_size="2MB")
    AutoTokenizer.from_pretrained(full).save_pretrained(root / "foreign")
    files = sorted(p.name for p in (root / "foreign").iterdir())
    run = train(root / "foreign", root / "foreign-trained")
    return {"files": files, "train": run, "trained": acceptance(root / "foreign-trained")}


PROOFS = {"graft": graft, "recursive": recursive, "foreign": foreign}


def main(argv: list[str]) -> int:
    import tempfile

    RESULTS.mkdir(parents=True, exist_ok=True)
    for name in argv or list(PROOFS):
        with tempfile.TemporaryDirectory() as tmp:
            result = {"date": time.strftime("%Y-%m-%d"), "machine": _machine(),
                      **PROOFS[name](Path(tmp))}
        (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1))
        print(f"wrote {RESULTS / f'{name}.json'}")
    return 0


def _machine() -> str:
    import os
    import platform

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in flags.splitlines()
                  if line.startswith("model name")), platform.processor())
    return f"{model}, {os.cpu_count()} cores"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
