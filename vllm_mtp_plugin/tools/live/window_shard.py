"""A recording window's shard from the workers' raw calls, streamed: memory bounded by a constant.

The workers write, per drafter call, the rows of the window's requests and a ``segments`` table
(request, first row, first position, rows, exact) (``vllm_mtp_plugin.recording``). Here the tables alone
are read to find, per request, the rows that cover each of its positions; a request with a
position missing is left out. The shard is then written request by request, reading at most
``PIECE_BYTES`` of hidden states at a time from the memory-mapped raw files
(``shard_writer.write_pieces``): the API server's memory does not grow with the window
(tested with a window of several hundred MB).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch

from ..mtp_layer.shard_format import shard_entries, shard_metadata
from ..mtp_layer.shard_writer import DTYPES, write_pieces

PIECE_BYTES = 16 * 2**20
_DTYPE_OF = {name: dtype for dtype, name in DTYPES.items()}

Piece = tuple[Path, int, int]  # raw file, first row, rows


def _segments(raw: Path, next_tokens: list[int]):
    """``(segments by request, dtype, width)`` from the raw calls' tables and headers. A row
    taken at a request's last position as a candidate (``recording_window.take``) counts only
    if it carries the token the target sampled there."""
    from safetensors import safe_open

    by_request, dtype, width = defaultdict(list), None, None
    for path in sorted(raw.glob("call-*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            table = handle.get_tensor("segments").tolist()
            rows = handle.get_slice("hidden_states")
            dtype, width = _DTYPE_OF[rows.get_dtype()], rows.get_shape()[-1]
            if any(not exact for *_, exact in table):
                tokens = handle.get_tensor("input_ids").tolist()
        for request, row, position, count, exact in table:
            if exact or tokens[row] == next_tokens[request]:
                by_request[request].append((position, count, path, row))
    return by_request, dtype, width


def _cover(segments: list, length: int) -> list[Piece] | None:
    """Pieces giving positions ``0 .. length - 1`` in order, or None if one is missing."""
    pieces, at = [], 0
    for position, count, path, row in sorted(segments, key=lambda s: s[0]):
        if at >= length or position > at:
            break
        skip = at - position
        take = min(count - skip, length - at)
        if take > 0:
            pieces.append((path, row + skip, take))
            at += take
    return pieces if at >= length else None


def _read(pieces: list[Piece], row_bytes: int):
    """The hidden states of ``pieces``, at most ``PIECE_BYTES`` at a time."""
    from safetensors import safe_open

    step = max(1, PIECE_BYTES // row_bytes)
    for path, row, count in pieces:
        with safe_open(str(path), "pt") as handle:
            rows = handle.get_slice("hidden_states")
            for start in range(row, row + count, step):
                yield rows[start:min(start + step, row + count)]


def window_rows(raw: Path) -> dict[str, int]:
    """The workers' row counts of the window (``rows-*.json``): kept and dropped (other
    traffic's) rows, summed over the writing ranks."""
    counts: dict[str, int] = defaultdict(int)
    for path in raw.glob("rows-*.json"):
        for key, value in json.loads(path.read_text()).items():
            counts[key] += int(value)
    return dict(counts)


def write_window_shard(raw: Path, batch: list[tuple[list[int], int]], next_tokens: list[int],
                       path: Path, metadata: dict) -> tuple[int, int, int | None]:
    """Write the window's complete requests (``batch``: token ids and prompt length each) to
    ``path``; returns ``(requests, tokens)`` written (0, 0: no shard) and the bytes of one row
    as the workers recorded it (None: nothing recorded)."""
    by_request, dtype, width = _segments(raw, next_tokens)
    if dtype is None:
        return 0, 0, None
    row_bytes = width * torch.empty((), dtype=dtype).element_size()
    covers = [_cover(by_request.get(r, []), len(ids)) for r, (ids, _) in enumerate(batch)]
    keep = [r for r, cover in enumerate(covers) if cover is not None]
    if not keep:
        return 0, 0, row_bytes
    sequences = [batch[r][0] for r in keep]
    rows = sum(len(s) for s in sequences)
    pieces = (piece for r in keep for piece in _read(covers[r], row_bytes))
    entries = shard_entries(sequences, [next_tokens[r] for r in keep], [batch[r][1] for r in keep],
                            rows, width, dtype, pieces)
    write_pieces(path, entries, shard_metadata(metadata), private=True)
    return len(keep), rows, row_bytes
