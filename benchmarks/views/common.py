"""What every view needs: reading a results file, and the line that says where a table came from."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
RESULTS = "benchmarks/results"


@dataclass(frozen=True)
class View:
    """One generated part of the docs: what renders it and the results files it reads."""
    render: Callable[[], str]
    sources: tuple[str, ...]


@lru_cache(maxsize=None)
def load(relative: str):
    """A results file, by its path under the checkout."""
    path = ROOT / relative
    if not path.exists():
        raise FileNotFoundError(f"{relative}: no such results file (its run writes it: "
                                f"benchmarks/run_readme.sh names the command)")
    return json.loads(path.read_text())


def bench_rows(relative: str, **where) -> list[dict]:
    """The rows of a bench results file that match every ``field=value`` given."""
    return [r for r in load(relative)["results"]
            if all(r.get(field) == value for field, value in where.items())]


def one_row(relative: str, **where) -> dict:
    rows = bench_rows(relative, **where)
    if len(rows) != 1:
        raise ValueError(f"{relative}: {len(rows)} rows match {where}, expected one")
    return rows[0]


def _flags(env: dict) -> str:
    flags = env.get("cpu_flags")
    if flags is None:
        return "CPU flags not recorded"
    return "flags " + (" ".join(flags) or "none of the speed-relevant ones")


def command(argv: list[str]) -> str:
    argv = list(argv)
    if argv and argv[0].endswith("bench.py"):
        argv[0] = "python benchmarks/bench.py"
    elif argv and argv[0].endswith("vllm-mtp"):
        argv[0] = "vllm-mtp"
    argv = [a for a in argv if a]
    # the log folder says nothing about the figures
    if "--log-dir" in argv:
        i = argv.index("--log-dir")
        del argv[i:i + 2]
    return " ".join(argv)


def provenance(env: dict) -> str:
    """Date, machine, software, code and command of a run, as stored with its results."""
    commit, changed = env.get("commit"), env.get("uncommitted_changes")
    if isinstance(changed, list):  # results files and docs a run found rewritten change no figure
        changed = [f for f in changed if not f.startswith(f"{RESULTS}/") and not f.endswith(".md")]
    code = f"commit {commit[:10]}" if commit else "commit not recorded"
    if changed is True:  # recorded as a flag only
        code += " with uncommitted changes"
    elif changed:
        code += " with uncommitted changes to " + ", ".join(f"`{f}`" for f in changed)
    kernels = f", vLLM kernels {env['vllm_kernels']}" if env.get("vllm_kernels") else ""
    return (f"{env.get('date', 'date not recorded')}, {env.get('cpu')} ({env.get('cpus')} CPUs; "
            f"{_flags(env)}{kernels}), vLLM {env.get('vllm')}, torch {env.get('torch')}, {code}; "
            f"`{command(env.get('argv') or [])}`")


def source_line(*relatives: str) -> str:
    """The line under a table: each results file it reads, with the run that wrote it."""
    parts = []
    for relative in relatives:
        data = load(relative)
        env = data.get("environment") or data.get("machine") or data.get("run") or {}
        parts.append(f"`{relative}`: {provenance(env)}")
    return "Source: " + "; ".join(parts) + "."


def percent(share: float, digits: int = 1) -> str:
    """"3.7 %": a share as the docs write it."""
    return f"{100 * share:.{digits}f} %"


def rate(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])
