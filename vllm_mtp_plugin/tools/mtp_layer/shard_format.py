"""The data shard: sequences and the hidden states the drafter received, one file each.

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
from pathlib import Path

import torch

from .shard_writer import Entry, write_pieces
from .v3_target import TrainInputError

DATA_FORMAT = "vllm-mtp-train-data/1"
SHARD_FORMATS = {DATA_FORMAT}


def write_shard(path: Path, sequences: list[list[int]], next_tokens: list[int],
                hidden: list[torch.Tensor], prompt_lengths: list[int], metadata: dict,
                drafter_output: list[torch.Tensor] | None = None, private: bool = False) -> None:
    """Write under a temporary name, then rename: a reader never sees half a shard.
    ``private``: readable by the owner only from its first byte (recorded traffic). The file is
    written piece by piece (``shard_writer.py``): no second copy of the states in memory."""
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
