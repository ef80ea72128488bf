"""Write a safetensors file piece by piece: memory bounded by the largest piece, not the file.

``safetensors.torch.save`` builds the whole file in memory (and its caller holds the tensors
too): for a recording window of long requests that is several times the shard's size. The format
is simple and documented (https://github.com/huggingface/safetensors, "Format"): an 8-byte
little-endian header length, a JSON header naming each tensor's dtype, shape and byte range, then
the bytes. So the header is written from the shapes alone and each tensor's bytes from an iterable
of pieces; ``safetensors`` reads the result like any other file (tested).

The file is created new (``O_EXCL``) and never through a link (``O_NOFOLLOW``) under a temporary
name, then renamed: a reader never sees half a file, and a link planted in a shared directory is
replaced, not written through.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
          torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
          torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


@dataclass
class Entry:
    """One tensor: its name, dtype, shape and the pieces whose bytes, in order, fill it."""
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: Iterable[torch.Tensor]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()


def open_new(path: Path, private: bool):
    """A new file at ``path`` (a leftover or a planted link there is removed, not followed);
    ``private``: readable by the owner only from its first byte."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    mode = 0o600 if private else 0o644
    try:
        fd = os.open(path, flags, mode)
    except FileExistsError:
        path.unlink()
        fd = os.open(path, flags, mode)
    return os.fdopen(fd, "wb")


def _header(entries: list[Entry], metadata: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for entry in entries:
        if entry.dtype not in DTYPES:
            raise TypeError(f"{entry.name}: dtype {entry.dtype} has no safetensors name here")
        header[entry.name] = {"dtype": DTYPES[entry.dtype], "shape": list(entry.shape),
                              "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(text)) + text


def write_pieces(path: Path, entries: list[Entry], metadata: dict[str, str],
                 private: bool = False) -> int:
    """Write ``entries`` to ``path`` (through ``path``.partial); returns the file's bytes.
    Raises ValueError, leaving no file, when pieces do not fill their tensor exactly."""
    tmp = path.with_suffix(".partial")
    try:
        with open_new(tmp, private) as out:
            out.write(_header(entries, metadata))
            for entry in entries:
                written = 0
                for piece in entry.pieces:
                    if piece.dtype != entry.dtype:
                        raise ValueError(f"{entry.name}: a piece of {piece.dtype}, the tensor is "
                                         f"{entry.dtype}")
                    data = piece.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                    out.write(data.numpy().data)
                    written += data.numel()
                if written != entry.nbytes:
                    raise ValueError(f"{entry.name}: its pieces hold {written} bytes, its shape "
                                     f"{list(entry.shape)} needs {entry.nbytes}")
            size = out.tell()
        tmp.rename(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size
