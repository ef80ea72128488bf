"""The pictures of the docs and of ``benchmarks/results``, drawn from the stored results and
carrying the data they were drawn from.

Each picture is a PNG with a compressed text chunk ``vllm-mtp-data``: the JSON of what it plots
(for a bench run, the fields of its rows the plots read; for tune, its expectations and
measurements; for ``--adapt``, the windows and swaps) and the command that drew it.
``tables.py --check`` reads that chunk with the standard library and compares it with what the
results files give now, so a picture drawn by hand or from an older run fails like a stale table;
``tables.py`` draws again (matplotlib, optional: without it one line says which picture is stale)
what differs, and leaves a picture whose data still matches untouched.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .common import ROOT, RESULTS, load
from .quiet import quiet_rows

KEY = b"vllm-mtp-data"
PNG = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class Picture:
    """One PNG: where it lies, what it plots (JSON-able, from the results), how to draw it (False
    where it could not), and the pictures drawn together with it (one drawing, one ``group``)."""
    path: str
    data: Callable[[], object]
    draw: Callable[[], bool]
    group: str


def chunks(blob: bytes) -> list[tuple[bytes, bytes]]:
    """(type, data) of every chunk of a PNG."""
    if not blob.startswith(PNG):
        raise ValueError("not a PNG")
    out, i = [], len(PNG)
    while i < len(blob):
        (length,) = struct.unpack(">I", blob[i:i + 4])
        out.append((blob[i + 4:i + 8], blob[i + 8:i + 8 + length]))
        i += 12 + length
    return out


def embedded(path: Path) -> dict | None:
    """The ``vllm-mtp-data`` a picture carries (None: none, or no picture)."""
    if not path.exists():
        return None
    for kind, data in chunks(path.read_bytes()):
        if kind == b"zTXt" and data.startswith(KEY + b"\0"):
            return json.loads(zlib.decompress(data[len(KEY) + 2:]).decode("ascii"))
    return None


def embed(path: Path, record: dict) -> None:
    """Write ``record`` into the picture (replacing an earlier one), before its end chunk."""
    text = json.dumps(record, sort_keys=True, ensure_ascii=True).encode("ascii")
    chunk = KEY + b"\0\0" + zlib.compress(text, 9)
    parts = [PNG]
    for kind, data in chunks(path.read_bytes()):
        if kind == b"zTXt" and data.startswith(KEY + b"\0"):
            continue
        if kind == b"IEND":
            parts.append(struct.pack(">I", len(chunk)) + b"zTXt" + chunk
                         + struct.pack(">I", zlib.crc32(b"zTXt" + chunk)))
        parts.append(struct.pack(">I", len(data)) + kind + data
                     + struct.pack(">I", zlib.crc32(kind + data)))
    path.write_bytes(b"".join(parts))


def _canonical(value) -> object:
    return json.loads(json.dumps(value, sort_keys=True))


# --- bench runs: the three plots of ``vllm-mtp bench report`` ------------------------------------

BENCH_FIELDS = ("checkpoint", "impl", "concurrency", "prompts", "temperature", "mla_verify",
                "draft_sample_method", "rejection_sample_method", "k", "floor_only",
                "per_position_acceptance", "speedup", "ideal_speedup", "output_tok_s")


def bench_data(relative: str) -> list[dict]:
    """The fields the plots read from each row, the speed-ups against quiet baselines (as the
    tables show them)."""
    return [{f: r.get(f) for f in BENCH_FIELDS} for r in quiet_rows(relative)[0]]


def bench_names(relative: str) -> list[str]:
    """The plots ``report.plot_all`` draws for a run's rows."""
    rows = [r for r in load(relative)["results"] if not r.get("floor_only")]
    names = []
    if any(r["k"] and r.get("per_position_acceptance") for r in rows):
        names.append("per_position_acceptance.png")
    if any(r.get("speedup") is not None for r in rows):
        names.append("speedup_vs_k.png")
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    if len(impls) > 1:
        from vllm_mtp_plugin.tools.bench.report import implementations_picture

        names.append(implementations_picture(impls)[0])
    return names


def _draw_bench(relative: str) -> bool:
    from vllm_mtp_plugin.tools.bench.report import plot_all

    return bool(plot_all(quiet_rows(relative)[0], (ROOT / relative).parent))


# --- tune: its expectations, and its pick against the fixed-k sweeps ------------------------------

TUNE_FIELDS = ("expected_tok_s", "ks_measured", "measurements", "draft_sample_method",
               "best_fixed_k")


def tune_data(relative: str) -> dict:
    data = load(relative)
    return {**{f: data.get(f) for f in TUNE_FIELDS}, "max_k": data["settings"]["max_k"]}


def _draw_tune(relative: str) -> bool:
    from vllm_mtp_plugin.tools.tune.plot import expected

    data = load(relative)
    return expected(data, (ROOT / relative).with_suffix(".png")) is not None


def check_data(relative: str) -> dict:
    check = load(relative)
    tune = load(str(Path(relative).with_name("tune.json")))
    return {"verdicts": check["verdicts"],
            "title": f"{Path(tune['settings']['model']).name}: fixed k against tune's pick"}


def _draw_check(relative: str) -> bool:
    from vllm_mtp_plugin.tools.tune.plot import measured_against_pick

    data = check_data(relative)
    return measured_against_pick(data["verdicts"], (ROOT / relative).with_name(
        "tune_vs_fixed.png"), data["title"]) is not None


# --- the docs' own pictures, drawn by the proofs' scripts from their stored results ---------------

ADAPT = "benchmarks/results/live/adapt.json"
PROOFS = "benchmarks/results/training"


def adapt_data() -> dict:
    """What ``live_adapt.py plot`` draws: served acceptance per window, the swaps, the offline
    figure and the layer's held-out figure at the end."""
    data = load(ADAPT)
    return {"windows": [{k: w[k] for k in ("start_s", "end_s", "acceptance")}
                        for w in data["windows"]],
            "events": [{k: e[k] for k in ("t", "event")} for e in data["events"]],
            "offline": data["offline"]["refreshed"]["1"]["per_position"][0],
            "final": data["held_out"]["final_layer"]["1"]["per_position"][0],
            "ratio_to_offline_k1": data["ratio_to_offline_k1"]}


def proofs_data() -> dict:
    """What ``train_proofs.py plot`` draws from: every training proof's per-position
    acceptance at each k."""
    out = {}
    for path in sorted((ROOT / PROOFS).glob("*.json")):
        data = load(path.relative_to(ROOT).as_posix())
        out[path.stem] = {key: {k: v["per_position"] for k, v in value.items()
                                if isinstance(v, dict) and "per_position" in v}
                          for key, value in data.items() if isinstance(value, dict)}
    return out


def _script(script: str) -> Callable[[], bool]:
    def draw() -> bool:
        done = subprocess.run([sys.executable, script, "plot"], cwd=ROOT, capture_output=True,
                              text=True)
        if done.returncode:
            print(f"{script} plot failed: {done.stderr.strip().splitlines()[-1:]}",
                  file=sys.stderr)
        return done.returncode == 0
    return draw


def _bind(function: Callable, *args) -> Callable:
    return lambda: function(*args)


def pictures() -> list[Picture]:
    """Every picture the docs and the results folders hold, with its data and its drawing."""
    found = []
    for path in sorted((ROOT / RESULTS).glob("**/results.json")):
        relative = path.relative_to(ROOT).as_posix()
        folder = Path(relative).parent
        found += [Picture(str(folder / name), _bind(bench_data, relative),
                          _bind(_draw_bench, relative), relative)
                  for name in bench_names(relative)]
    for path in sorted((ROOT / RESULTS).glob("tune-*/tune.json")):
        relative = path.relative_to(ROOT).as_posix()
        found.append(Picture(str(Path(relative).with_suffix(".png")), _bind(tune_data, relative),
                             _bind(_draw_tune, relative), relative))
    for path in sorted((ROOT / RESULTS).glob("tune-*/check.json")):
        relative = path.relative_to(ROOT).as_posix()
        found.append(Picture(str(Path(relative).with_name("tune_vs_fixed.png")),
                             _bind(check_data, relative), _bind(_draw_check, relative), relative))
    found.append(Picture("docs/live-adapt.png", adapt_data, _script("benchmarks/live_adapt.py"),
                         ADAPT))
    found.append(Picture("docs/training-acceptance.png", proofs_data,
                         _script("benchmarks/train_proofs.py"), PROOFS))
    return found


def stale(picture: Picture) -> bool:
    return embedded(ROOT / picture.path) != {"data": _canonical(picture.data())}


def refresh(check: bool) -> list[str]:
    """The pictures whose embedded data differ from the results' (drawn again unless ``check``,
    with the pictures drawn together with them); returns a line for each one still stale."""
    groups: dict[str, list[Picture]] = {}
    for picture in pictures():
        groups.setdefault(picture.group, []).append(picture)
    lines = []
    for members in groups.values():
        behind = [p for p in members if stale(p)]
        if not behind:
            continue
        if check or not members[0].draw() or not all((ROOT / p.path).exists() for p in members):
            lines += [f"{p.path}: drawn from other data than its results" for p in behind]
            continue
        for p in members:
            embed(ROOT / p.path, {"data": _canonical(p.data())})
            print(f"drew {p.path}")
    return lines
