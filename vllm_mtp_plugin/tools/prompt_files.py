"""Prompt files, one reader for every tool (``bench``, ``tune``, ``train``).

Three formats, told apart by the file's first non-blank character and line:

* a JSON array (the file starts with ``[``): ShareGPT's ``[{"conversations": [...]}, ...]`` or
  a list of the records below;
* JSON Lines (the first non-blank line is a JSON object): one record per line, blank lines
  skipped; a later line that is not JSON is refused with its line number;
* plain text otherwise: one prompt per non-blank line.

A record is ``{"prompt": ...}`` (a completion; with ``"kind": "chat"`` the user's turn of a chat),
OpenAI ``{"messages": [...]}`` or ShareGPT ``{"conversations": [{"from": "human", "value": ...}]}``
(``role``/``content`` keys too); it may carry a ``kind`` the benchmark groups by. Anything else
is refused naming the file, the line and what was expected.

Prompt sets (what ``bench`` and ``tune`` send): the bundled JSONL, or a user's file in any of the
formats above.

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
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

EXPECTED = ("one prompt per line, JSON Lines of {\"prompt\": ...} / {\"messages\": [...]} / "
            "{\"conversations\": [...]}, or a JSON array of those (ShareGPT)")


class PromptFileError(ValueError):
    """A prompt file that cannot be read: the message names the file, the line and the format."""


@dataclass(frozen=True)
class PromptRecord:
    """One record and where it came from (``file:line``, and its index among the records)."""
    where: str
    index: int
    value: str | dict


def read_records(path: str | Path) -> list[PromptRecord]:
    """Every record of ``path`` in order: a ``str`` for a plain-text line, else the JSON object."""
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"{path}: no such prompt file (expected {EXPECTED}).")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PromptFileError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                              f"expected {EXPECTED}.") from None
    if text.lstrip().startswith("["):
        return _json_array(path, text)
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if lines and _is_json_object(lines[0][1]):
        return _json_lines(path, lines)
    return [PromptRecord(f"{path}:{n}", i, line) for i, (n, line) in enumerate(lines)]


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _json_array(path: Path, text: str) -> list[PromptRecord]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PromptFileError(f"{path}:{exc.lineno}: the file starts with '[' but is not valid "
                              f"JSON ({exc.msg}); expected {EXPECTED}.") from None
    records = []
    for i, item in enumerate(data):
        if not isinstance(item, (dict, str)):
            raise PromptFileError(f"{path}: record {i} of the JSON array is a "
                                  f"{type(item).__name__}; expected an object with 'prompt', "
                                  "'messages' or 'conversations'.")
        records.append(PromptRecord(f"{path}: record {i}", i, item))
    return records


def _json_lines(path: Path, lines: list[tuple[int, str]]) -> list[PromptRecord]:
    records = []
    for i, (n, line) in enumerate(lines):
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptFileError(f"{path}:{n}: not JSON ({exc.msg}), but the file's first line "
                                  "is, so every line must be a JSON record; expected "
                                  f"{EXPECTED}.") from None
        if not isinstance(value, (dict, str)):
            raise PromptFileError(f"{path}:{n}: record {i} is a {type(value).__name__}; expected "
                                  "an object with 'prompt', 'messages' or 'conversations'.")
        records.append(PromptRecord(f"{path}:{n}: record {i}", i, value))
    return records


HUMAN_ROLES = ("human", "user")
CHAT = "chat"  # the ``kind`` of a record whose prompt is the user's turn of a chat


def prompt_of(record: str | dict, where: str, sharegpt_as_chat: bool = False
              ) -> str | list[dict] | None:
    """What a record asks for: a completion prompt (``str``), a chat (OpenAI messages), or
    ``None`` (a conversation without a human turn). The one reading of a record for every tool:

    * a plain line or ``{"prompt": ...}``: a completion; with ``"kind": "chat"`` the user's turn
      of a chat;
    * ``{"messages": [{"role": ..., "content": ...}, ...]}``: that chat;
    * ShareGPT ``{"conversations": [{"from": "human", "value": ...}, ...]}`` (or ``messages``
      without ``role``/``content``): its first human turn, as a completion prompt the way
      ``vllm bench serve`` sends it, or with ``sharegpt_as_chat`` as a one-turn chat (what
      ``vllm-mtp train`` trains on: the chat template applied).
    """
    if isinstance(record, str):
        return record
    if not isinstance(record, dict):
        raise PromptFileError(f"{where}: expected an object with 'prompt', 'messages' or "
                              f"'conversations', got {type(record).__name__}")
    if "prompt" in record:
        if record.get("kind") == CHAT:
            return [{"role": "user", "content": str(record["prompt"])}]
        return str(record["prompt"])
    messages = record.get("messages")
    if messages and all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        return [{"role": m["role"], "content": str(m["content"])} for m in messages]
    turns = record.get("conversations") or messages
    if not turns:
        raise PromptFileError(f"{where}: a record needs a 'prompt', 'messages' or "
                              "'conversations' field")
    for turn in turns:
        if isinstance(turn, dict) and turn.get("from", turn.get("role")) in HUMAN_ROLES:
            text = str(turn.get("value", turn.get("content", "")))
            return [{"role": "user", "content": text}] if sharegpt_as_chat else text
    return None



ALL = "all"


def bundled_prompt_texts() -> list[str]:
    """The prompts shipped in ``data/prompts.jsonl`` (also the tokenizer's training text)."""
    path = resources.files("vllm_mtp_plugin.tools").joinpath("data/prompts.jsonl")
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]


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
