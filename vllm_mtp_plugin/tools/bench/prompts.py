"""Prompt sets for the benchmark: the bundled JSONL, or a user's file in any format
``tools/prompt_files.py`` reads (plain lines, JSONL, ShareGPT).

ShareGPT files (a JSON list, or JSONL, of ``{"conversations": [{"from": "human", "value": ...},
...]}``; ``role``/``content`` keys work too) contribute the first human turn of each conversation,
which is what ``vllm bench serve --dataset-name sharegpt`` sends as the prompt as well.

A JSONL record may carry a ``kind`` (e.g. ``code``, ``prose``, ``chat``): the benchmark then
measures each kind as its own pass and reports it on its own row, since acceptance depends on
the content (``load_prompt_groups``). Records of kind ``chat`` (a ``prompt`` as the user's turn)
and records with OpenAI ``messages`` are sent as chats, through the model's chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..prompt_files import PromptFileError, read_records
from ..tiny.tokenizer import bundled_prompt_texts

HUMAN_ROLES = ("human", "user")


def _prompt_of(record: str | dict, where: str) -> str | None:
    if isinstance(record, str):  # a plain-text line, or a JSON string
        return record
    if "prompt" in record:
        return str(record["prompt"])
    turns = record.get("conversations") or record.get("messages")
    if turns is None:
        raise PromptFileError(f"{where}: a record needs a 'prompt', 'messages' or "
                              "'conversations' field")
    for turn in turns:
        role = turn.get("from", turn.get("role"))
        if role in HUMAN_ROLES:
            return str(turn.get("value", turn.get("content", "")))
    return None  # a conversation without a human turn has no prompt to offer


ALL = "all"


def _cycled(prompts: list[str], limit: int | None) -> list[str]:
    if limit is None:
        return prompts
    return [prompts[i % len(prompts)] for i in range(limit)]


CHAT = "chat"


def _chat_of(record: str | dict) -> list[dict] | None:
    """The conversation a record sends as a chat, or None for a completion prompt."""
    if isinstance(record, str):
        return None
    messages = record.get("messages")
    if messages and all("role" in m and "content" in m for m in messages):
        return [{"role": m["role"], "content": str(m["content"])} for m in messages]
    if record.get("kind") == CHAT and "prompt" in record:
        return [{"role": "user", "content": str(record["prompt"])}]
    return None


def load_prompt_groups(path: str | Path | None = None, limit: int | None = None,
                       by_kind: bool = True) -> dict[str, list]:
    """Prompts per ``kind`` field, ``limit`` per kind: completion prompts (str) or, for chats,
    OpenAI message lists (records without a kind: ``"all"``, or ``"chat"`` for chats).

    ``by_kind=False`` (or no file) gives one group, ``{"all": load_prompts(...)}``.
    """
    if path is None or not by_kind:
        return {ALL: load_prompts(path, limit)}
    path = Path(path)
    groups: dict[str, list] = {}
    for entry in read_records(path):
        record = entry.value
        chat = _chat_of(record)
        prompt = chat or _prompt_of(record, entry.where)
        if prompt:
            kind = str((record.get("kind") if isinstance(record, dict) else None)
                       or (CHAT if chat else ALL))
            groups.setdefault(kind, []).append(prompt)
    if not groups:
        raise ValueError(f"no prompts found in {path}")
    for kind, prompts in groups.items():
        if len({isinstance(p, list) for p in prompts}) > 1:
            raise ValueError(f"{path}: kind {kind!r} mixes chats and completion prompts; give "
                             "them different kinds")
    return {kind: _cycled(prompts, limit) for kind, prompts in groups.items()}


def is_chat(prompts: list) -> bool:
    return bool(prompts) and isinstance(prompts[0], list)


def load_prompts(path: str | Path | None = None, limit: int | None = None) -> list[str]:
    """Prompts from ``path`` (JSONL or JSON; see the module docstring), or the bundled set.

    ``limit`` keeps the first ``limit`` prompts; fewer than asked cycles through the set, so a run
    can use more requests than the file has prompts.
    """
    if path is None:
        prompts = bundled_prompt_texts()
    else:
        prompts = [prompt for entry in read_records(path)
                   if (prompt := _prompt_of(entry.value, entry.where))]
    if not prompts:
        raise ValueError(f"no prompts found in {path}")
    return _cycled(prompts, limit)


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
