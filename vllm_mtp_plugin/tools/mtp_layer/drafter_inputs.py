"""Training data: prompts in, and the hidden states the drafter received, per sequence, out.

Prompt files (read by ``tools/prompt_files.py``, as every tool reads them): plain text (one
prompt per line), JSONL with ``prompt`` (a completion) or OpenAI ``messages`` (a chat, sent
through the target's chat template), or ShareGPT JSON/JSONL (``conversations``: the first human
turn, as a chat).

The sequences and their states go to data shards (``shard_format.py``).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from ..prompt_files import PromptFileError, prompt_of, read_records
from .v3_target import TrainInputError


def load_training_prompts(path: str | Path) -> list:
    """Completion prompts (str) and chats (message lists) from ``path``."""
    path = Path(path)
    try:  # ShareGPT conversations train as chats: the chat template applied, as served
        prompts = [p for r in read_records(path)
                   if (p := prompt_of(r.value, r.where, sharegpt_as_chat=True))]
    except PromptFileError as exc:
        raise TrainInputError(f"--prompts {exc}") from None
    if not prompts:
        raise TrainInputError(f"--prompts {path}: no prompts in the file (plain text lines, JSONL "
                              "with 'prompt' or 'messages', or ShareGPT 'conversations').")
    return prompts


def encode_prompts(tokenizer, prompts: list, where: str) -> list[list[int]]:
    """Token ids: completions as the tokenizer encodes them (with its BOS), chats through the
    tokenizer's chat template with the generation prompt."""
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            out.append(list(tokenizer(prompt)["input_ids"]))
            continue
        if not getattr(tokenizer, "chat_template", None):
            raise TrainInputError(f"{where} holds chats, but the target's tokenizer has no chat "
                                  "template; give completion prompts ('prompt' or plain lines).")
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        out.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out


def assemble(calls: list[dict[str, torch.Tensor]], sequences: list[list[int]],
             key: str = "hidden_states") -> list[torch.Tensor]:
    """Per sequence, the recorded ``key`` (the hidden states the drafter received, or its
    ``output``) at each of its positions.

    ``sequences[r]`` is what the drafter was fed for request r (token i+1 at position i, the
    target's chosen token at the last position). ``calls`` are the recorded drafter calls, in any
    batching and chunking: runs of consecutive positions are matched to the requests whose tokens
    they carry. Raises when a position was never seen.
    """
    rows, filled = _match(calls, sequences, key)
    for r, done in enumerate(filled):
        if not bool(done.all()):
            first = int((~done).nonzero()[0])
            raise RuntimeError(f"the drafter never received position {first} of sequence {r}: "
                               "the collecting engine must run without prefix caching and "
                               "without chunked prefill.")
    return rows


def positions_received(calls: list[dict[str, torch.Tensor]], sequences: list[list[int]]
                       ) -> list[int]:
    """Per sequence, how many of its positions the recorded calls hold (``assemble``'s matching):
    what recording the engine's own passes would give."""
    return [int(done.sum()) for done in _match(calls, sequences, "hidden_states")[1]]


def _match(calls, sequences, key):
    by_start = defaultdict(list)
    for r, seq in enumerate(sequences):
        for p, token in enumerate(seq):
            by_start[(p, token)].append(r)
    width = next((c[key].shape[-1] for c in calls), 0)
    dtype = next((c[key].dtype for c in calls), torch.float32)
    rows = [torch.empty(len(s), width, dtype=dtype) for s in sequences]
    filled = [torch.zeros(len(s), dtype=torch.bool) for s in sequences]
    for call in calls:
        ids, pos, hid = call["input_ids"].tolist(), call["positions"].tolist(), call[key]
        o = 0
        while o < len(ids):
            matches = []
            for r in by_start.get((pos[o], ids[o]), ()):
                seq, n = sequences[r], 0
                while (o + n < len(ids) and pos[o + n] == pos[o] + n and pos[o + n] < len(seq)
                       and seq[pos[o + n]] == ids[o + n]):
                    n += 1
                if (n and o + n < len(ids) and pos[o + n] == pos[o] + n < len(seq)
                        and (o + n + 1 == len(ids) or pos[o + n + 1] != pos[o + n] + 1)):
                    n += 1  # a chunk's last row carries a placeholder token, its state is real
                matches.append((n, r))
            if not matches:
                o += 1  # a row of no request of ours (nothing else runs on this engine)
                continue
            # Requests with the same tokens up to a position have the same hidden states there
            # (causal attention): the rows fill every request that shares them.
            for n, r in matches:
                free = ~filled[r][pos[o]:pos[o] + n]
                rows[r][pos[o]:pos[o] + n][free] = hid[o:o + n][free]
                filled[r][pos[o]:pos[o] + n] = True
            o += max(matches)[0]
    return rows, filled
