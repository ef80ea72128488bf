"""Training data: prompts in, and sequences with the hidden states the drafter receives out.

Prompt files (read by ``tools/prompt_files.py``, as every tool reads them): plain text (one
prompt per line), JSONL with ``prompt`` (a completion) or OpenAI ``messages`` (a chat, sent
through the target's chat template), or ShareGPT JSON/JSONL (``conversations``: the first human
turn, as a chat).

A data shard (``shard-00000.safetensors``) holds sequences back to back:

* ``tokens`` int64 ``[sum(T + 1)]``: each sequence (prompt + the target's continuation, T tokens)
  and the token the target chose after it;
* ``hidden`` ``[sum(T), H]`` (the target's dtype): row i of a sequence is the hidden state the
  MTP drafter received with position i (for DeepSeek-V3: the target's output after its final
  norm at token i) - recorded inside vLLM (``vllm_mtp_plugin.recording``);
* ``lengths`` int64 ``[n]`` (T), ``prompt_lengths`` int64 ``[n]``;
* optionally ``drafter_output`` ``[sum(T), H]``: what the served MTP layer returned for row i
  (``vllm-mtp doctor`` compares it with the layer computed from the files).

Nothing here is V3-specific: a V4 drafter's input (its hc-expanded state) is stored the same way.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch

from ..prompt_files import PromptFileError, prompt_of, read_records
from .shard_file import Entry, write_pieces
from .target import TrainInputError

DATA_FORMAT = "vllm-mtp-train-data/1"
SHARD_FORMATS = {DATA_FORMAT}


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


def write_shard(path: Path, sequences: list[list[int]], next_tokens: list[int],
                hidden: list[torch.Tensor], prompt_lengths: list[int], metadata: dict,
                drafter_output: list[torch.Tensor] | None = None, private: bool = False) -> None:
    """Write under a temporary name, then rename: a reader never sees half a shard.
    ``private``: readable by the owner only from its first byte (recorded traffic). The file is
    written piece by piece (``shard_file.py``): no second copy of the states in memory."""
    width, dtype = hidden[0].shape[-1], hidden[0].dtype
    rows = sum(len(h) for h in hidden)
    entries = shard_entries(sequences, next_tokens, prompt_lengths, rows, width, dtype, hidden)
    if drafter_output is not None:
        entries.append(Entry("drafter_output", dtype, (rows, width), drafter_output))
    write_pieces(path, entries, shard_metadata(metadata), private)


def shard_entries(sequences: list[list[int]], next_tokens: list[int], prompt_lengths: list[int],
                  rows: int, width: int, dtype: torch.dtype, hidden_pieces) -> list[Entry]:
    """The tensors of a shard (module docstring), the hidden states from ``hidden_pieces``."""
    tokens = torch.tensor([t for seq, nxt in zip(sequences, next_tokens) for t in (*seq, nxt)],
                          dtype=torch.int64)
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
    starts = torch.tensor(prompt_lengths, dtype=torch.int64)
    return [Entry("tokens", torch.int64, tuple(tokens.shape), [tokens]),
            Entry("lengths", torch.int64, tuple(lengths.shape), [lengths]),
            Entry("prompt_lengths", torch.int64, tuple(starts.shape), [starts]),
            Entry("hidden", dtype, (rows, width), hidden_pieces)]


def shard_metadata(metadata: dict) -> dict[str, str]:
    return {"format": DATA_FORMAT, **{k: json.dumps(v) for k, v in metadata.items()}}


def shard_summary(data_dir: Path) -> dict:
    """What a data directory holds, from the shards' headers only: ``shards``, ``sequences``,
    ``tokens``, ``hidden_size``, ``formats`` and the ``first`` shard's name."""
    from safetensors import safe_open

    shards = sorted(Path(data_dir).glob("shard-*.safetensors"))
    if not shards:
        raise TrainInputError(f"{data_dir}: no data shards (shard-*.safetensors): record some "
                              "with vllm-mtp serve --record DIR, or give a prompt file.")
    summary = {"shards": len(shards), "sequences": 0, "tokens": 0, "hidden_size": None,
               "formats": set(), "first": shards[0].name}
    for shard in shards:
        try:
            with safe_open(str(shard), "pt") as f:
                summary["formats"].add((f.metadata() or {}).get("format", "none"))
                n = f.get_slice("lengths").get_shape()[0]
                summary["sequences"] += n
                summary["tokens"] += f.get_slice("tokens").get_shape()[0] - n
                summary["hidden_size"] = f.get_slice("hidden").get_shape()[-1]
        except Exception as exc:  # noqa: BLE001 - named with the file
            raise TrainInputError(f"{shard}: not a readable data shard ({exc}).") from None
    return summary


class SequenceStore:
    """All sequences of a data directory: ``(tokens [T+1], hidden [T, H])`` by index, with each
    one's prompt length and, where the shards hold it, the served layer's output (``outputs``)."""

    def __init__(self, data_dir: str | Path):
        from safetensors.torch import load_file

        self.dir = Path(data_dir)
        shards = sorted(self.dir.glob("shard-*.safetensors"))
        if not shards:
            raise TrainInputError(f"{self.dir}: no data shards (shard-*.safetensors).")
        self.tokens, self.hidden, self.prompt_lengths, self.outputs = [], [], [], []
        for shard in shards:
            data = load_file(str(shard))
            t_off, h_off = 0, 0
            self.prompt_lengths += data["prompt_lengths"].tolist()
            for length in data["lengths"].tolist():
                self.tokens.append(data["tokens"][t_off:t_off + length + 1])
                self.hidden.append(data["hidden"][h_off:h_off + length])
                if "drafter_output" in data:
                    self.outputs.append(data["drafter_output"][h_off:h_off + length])
                t_off, h_off = t_off + length + 1, h_off + length
        if self.outputs and len(self.outputs) != len(self.hidden):
            raise TrainInputError(f"{self.dir}: some shards hold the drafter's output and some "
                                  "do not; collect into one directory with the same options.")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def hidden_size(self) -> int:
        return self.hidden[0].shape[-1]

    def batch(self, indices: list[int], max_len: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded ``tokens [B, T+1]``, ``hidden [B, T, H]`` (float32), ``lengths [B]``."""
        lengths = [len(self.hidden[i]) if max_len is None else min(len(self.hidden[i]), max_len)
                   for i in indices]
        width = max(lengths)
        tokens = torch.zeros(len(indices), width + 1, dtype=torch.long)
        hidden = torch.zeros(len(indices), width, self.hidden_size)
        for b, (i, n) in enumerate(zip(indices, lengths)):
            tokens[b, :n + 1] = self.tokens[i][:n + 1]
            hidden[b, :n] = self.hidden[i][:n].float()
        return tokens, hidden, torch.tensor(lengths)
