"""The real MTP tensor lists in ``tests/data/*_names.txt`` (DeepSeek-V3/R1 layer 61, V4-Flash).

Each line is ``name<TAB>shape (comma-separated)<TAB>dtype``; ``#`` lines say where the list comes
from. One reader, so every test sees the same rows.
"""

from pathlib import Path

DATA = Path(__file__).parents[1] / "data"


def name_list_rows(names_file: str) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, shape, dtype)`` of every tensor in ``tests/data/<names_file>``, in file order;
    dtype as written (``bf16``, ``float8_e4m3fn``, ...)."""
    rows = []
    for line in (DATA / names_file).read_text().splitlines():
        if line and not line.startswith("#"):
            name, shape, dtype = line.split("\t")
            rows.append((name, tuple(int(d) for d in shape.split(",")), dtype))
    return rows


def tensor_names(names_file: str) -> list[str]:
    """The tensor names of ``tests/data/<names_file>``, in file order."""
    return [name for name, _, _ in name_list_rows(names_file)]
