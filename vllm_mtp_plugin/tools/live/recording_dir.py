"""The recording directory: shards appear whole, readable by their owner only, and the oldest go
when the directory outgrows its bound (or they outlive ``--record-max-age``).

The shards hold served traffic (token ids of users' prompts and outputs, and the target's hidden
states from which text can be recovered), hence owner-only files in an owner-only directory. A
shard is written under a temporary name and renamed (``data.write_shard``), so a server killed
mid-write leaves a ``.partial`` file that no reader globs and that the next server on this host
removes, with the raw drafter calls (``.raw-*``) of its unfinished window.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path

SHARD_GLOB = "shard-*.safetensors"


def _host() -> str:
    return "".join(c if c.isalnum() else "_" for c in socket.gethostname())[:32] or "host"


def shard_path(directory: Path, number: int) -> Path:
    """A name that sorts by time and is unique across servers sharing the directory."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    return directory / f"shard-{stamp}-{_host()}-{os.getpid()}-{number:05d}.safetensors"


def raw_dir(directory: Path, number: int) -> Path:
    return directory / f".raw-{_host()}-{os.getpid()}-{number:05d}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _writer_pid(name: str) -> int | None:
    """The PID in a ``.partial``/``.raw-`` name written by this host, else None."""
    parts = name.split(".")[0 if not name.startswith(".") else 1].split("-")
    host = _host()
    for i in range(len(parts) - 1):
        if parts[i] == host and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def remove_leftovers(directory: Path) -> list[str]:
    """Partial shards and raw calls of servers on this host that are gone."""
    removed = []
    for path in [*directory.glob("shard-*.partial"), *directory.glob(".raw-*")]:
        pid = _writer_pid(path.name)
        if pid is None or pid == os.getpid() or _pid_alive(pid):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed


def _shards(directory: Path) -> list[tuple[float, str, int, Path]]:
    """``(mtime, name, bytes, path)`` of each shard, oldest first; one another server sharing the
    directory removes meanwhile is left out, not an error."""
    found = []
    for path in directory.glob(SHARD_GLOB):
        try:
            info = path.stat()
        except FileNotFoundError:
            continue
        found.append((info.st_mtime, path.name, info.st_size, path))
    return sorted(found)


def directory_bytes(directory: Path) -> int:
    return sum(size for _, _, size, _ in _shards(directory))


def enforce_bound(directory: Path, max_bytes: int, max_age_s: float | None = None) -> list[str]:
    """Remove shards older than ``max_age_s`` (by their time of writing), then the oldest
    until the rest fit in ``max_bytes``; the newest stays unless it is too old."""
    shards = _shards(directory)
    removed = []
    if max_age_s is not None:
        oldest_kept = time.time() - max_age_s
        for mtime, name, _, path in shards:
            if mtime < oldest_kept:
                path.unlink(missing_ok=True)
                removed.append(name)
        shards = [s for s in shards if s[1] not in removed]
    total = sum(size for _, _, size, _ in shards)
    for _, name, size, path in shards[:-1]:
        if total <= max_bytes:
            break
        total -= size
        path.unlink(missing_ok=True)
        removed.append(name)
    return removed
