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

from ..prompt_files import CHAT, HUMAN_ROLES, prompt_of, read_records
from ..tiny.tokenizer import bundled_prompt_texts

ALL = "all"


def _cycled(prompts: list[str], limit: int | None) -> list[str]:
    if limit is None:
        return prompts
    return [prompts[i % len(prompts)] for i in range(limit)]


def _as_text(prompt: str | list[dict] | None) -> str | None:
    """A completion prompt: a chat's first human turn (as ``vllm bench serve`` reads one)."""
    if prompt is None or isinstance(prompt, str):
        return prompt
    return next((m["content"] for m in prompt if m["role"] in HUMAN_ROLES), None)


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
        prompt = prompt_of(record, entry.where)
        if prompt:
            kind = str((record.get("kind") if isinstance(record, dict) else None)
                       or (CHAT if isinstance(prompt, list) else ALL))
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
                   if (prompt := _as_text(prompt_of(entry.value, entry.where)))]
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


def default_prompts(checkpoint_args: list[str]) -> str | None:
    """The trained model's own code/prose/chat prompts when only it is measured; else None (the
    bundled prompts)."""
    from importlib import resources

    from .checkpoints import TRAINED

    if checkpoint_args and all(arg == TRAINED for arg in checkpoint_args):
        return str(resources.files("vllm_mtp_plugin.tools").joinpath("data/trained_prompts.jsonl"))
    return None
