"""How much CPU other processes used while a configuration was measured (Linux ``/proc``).

On a small shared machine a second busy process steals cores from the engine's threads and can
slow a pass several-fold. Each result row records ``other_cpu_s``: the CPU seconds the whole
machine was busy minus those of this process, its waited-for children (the offline engine) and
the process tree of a server it started. A value near zero means the figures are clean.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def busy_seconds() -> float | None:
    """Non-idle CPU time of the machine since boot (user, nice, system, irq, softirq, steal)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / TICK


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, utime + stime + cutime + cstime in seconds) of a live process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), sum(int(v) for v in fields[11:15]) / TICK


def tree_seconds(root: int) -> float:
    """CPU seconds of ``root`` and all its live descendants (plus their waited-for children)."""
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (s := _stat(int(entry.name))) is not None:
            stats[int(entry.name)] = s
    total, todo, seen = 0.0, [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen or pid not in stats:
            continue
        seen.add(pid)
        total += stats[pid][1]
        todo += [child for child, (parent, _) in stats.items() if parent == pid]
    return total


class Meter:
    """``with Meter() as m: ...`` then ``m.result()``; ``m.watch(pid)`` adds a server's tree."""

    def __init__(self):
        self.pids: set[int] = set()
        self.start = self.end = None

    def watch(self, pid: int) -> None:
        self.pids.add(pid)

    def _snapshot(self) -> tuple[float | None, float, float]:
        t = os.times()
        own = t.user + t.system + t.children_user + t.children_system
        return busy_seconds(), own, time.monotonic()

    def __enter__(self) -> "Meter":
        self.start = self._snapshot()
        self.trees_start = {pid: tree_seconds(pid) for pid in self.pids}
        return self

    def stop(self) -> None:
        """Take the closing snapshot while watched servers still run."""
        self.end = self._snapshot()
        self.trees_end = {pid: tree_seconds(pid) for pid in self.pids}

    def __exit__(self, *exc) -> None:
        if self.end is None:
            self.stop()

    def result(self) -> dict:
        (busy0, own0, t0), (busy1, own1, t1) = self.start, self.end
        if busy0 is None or busy1 is None:
            return {"other_cpu_s": None, "wall_s": t1 - t0}
        trees = sum(self.trees_end.get(p, 0.0) - self.trees_start.get(p, 0.0) for p in self.pids)
        other = max(0.0, (busy1 - busy0) - (own1 - own0) - trees)
        return {"other_cpu_s": other, "wall_s": t1 - t0}


# Other processes' CPU time above this share of the machine's CPU time during a measurement
# distorts its timings (an engine's threads lose their cores): such a pass is re-run, not pooled.
BUSY_SHARE = 0.05


def disturbed(interference: dict | None, cpus: int | None = None) -> bool:
    """True when other processes used more than ``BUSY_SHARE`` of the CPUs meanwhile."""
    other = (interference or {}).get("other_cpu_s")
    if other is None:
        return False
    return other > BUSY_SHARE * interference["wall_s"] * (cpus or os.cpu_count() or 1)
