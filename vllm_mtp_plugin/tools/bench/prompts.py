"""Prompt sets for the benchmark: the bundled JSONL, a user's ``{"prompt"}`` JSONL, or ShareGPT.

ShareGPT files (a JSON list, or JSONL, of ``{"conversations": [{"from": "human", "value": ...},
...]}``; ``role``/``content`` keys work too) contribute the first human turn of each conversation,
which is what ``vllm bench serve --dataset-name sharegpt`` sends as the prompt as well.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..tiny.tokenizer import bundled_prompt_texts

HUMAN_ROLES = ("human", "user")


def _prompt_of(record: dict, where: str) -> str | None:
    if "prompt" in record:
        return str(record["prompt"])
    turns = record.get("conversations") or record.get("messages")
    if turns is None:
        raise ValueError(f"{where}: a record needs a 'prompt' or a 'conversations' field")
    for turn in turns:
        role = turn.get("from", turn.get("role"))
        if role in HUMAN_ROLES:
            return str(turn.get("value", turn.get("content", "")))
    return None  # a conversation without a human turn has no prompt to offer


def _records(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        return json.loads(stripped)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load_prompts(path: str | Path | None = None, limit: int | None = None) -> list[str]:
    """Prompts from ``path`` (JSONL or JSON; see the module docstring), or the bundled set.

    ``limit`` keeps the first ``limit`` prompts; fewer than asked cycles through the set, so a run
    can use more requests than the file has prompts.
    """
    if path is None:
        prompts = bundled_prompt_texts()
    else:
        path = Path(path)
        prompts = []
        for i, record in enumerate(_records(path)):
            prompt = _prompt_of(record, f"{path}: record {i}")
            if prompt:
                prompts.append(prompt)
    if not prompts:
        raise ValueError(f"no prompts found in {path}")
    if limit is None:
        return prompts
    return [prompts[i % len(prompts)] for i in range(limit)]


def write_sharegpt(prompts: list[str], path: str | Path, completion: str = "ok ok ok ok") -> Path:
    """Write ``prompts`` as a ShareGPT JSON file, in order (``vllm bench serve`` reads it).

    vLLM's ShareGPT loader wants two turns per conversation; the answer turn is only a
    placeholder since the benchmark fixes the output length.
    """
    data = [{"id": str(i), "conversations": [{"from": "human", "value": p},
                                             {"from": "gpt", "value": completion}]}
            for i, p in enumerate(prompts)]
    path = Path(path)
    path.write_text(json.dumps(data, ensure_ascii=False, indent=1), encoding="utf-8")
    return path
