"""The data files shipped in ``vllm_mtp_plugin/tools/data/``: how many prompts of which kind, and
how large the trained tiny model is. Stated here once; other tests use the files' lengths."""

import collections
import json

from vllm_mtp_plugin.tools.prompt_files import load_prompts
from vllm_mtp_plugin.tools.tiny import trained
from vllm_mtp_plugin.tools.tiny.tokenizer import bundled_prompt_texts

DATA = trained.shipped_dir().parent


def kinds(name: str) -> collections.Counter:
    rows = [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]
    return collections.Counter(row.get("kind") for row in rows)


def test_prompt_files_hold_their_prompts_by_kind():
    bundled = bundled_prompt_texts()
    assert load_prompts() == bundled and len(set(bundled)) == len(bundled)  # all distinct
    assert kinds("prompts.jsonl") == {None: 44}
    assert kinds("train_prompts.jsonl") == {"code": 32, "prose": 32, "chat": 8}  # vllm-mtp train
    assert kinds("trained_prompts.jsonl") == {"code": 4, "prose": 4, "chat": 4}  # demo, bench


def test_the_trained_model_stays_small():
    assert (trained.shipped_dir() / "model.safetensors").stat().st_size < 18_000_000
