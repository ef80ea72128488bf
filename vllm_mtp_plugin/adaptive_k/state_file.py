"""The controller's state, from the engine core to the API server's ``/metrics``.

The controller runs in vLLM's engine core, ``/metrics`` is served by the API server, another
process. The process that builds the engine config names a file (``STATE_ENV``, inherited by the
engine core vLLM starts after it); the engine core replaces it at most once a second with the
controller's summary, and the API server's collector reads it at scrape time. One small file per
server (a few kB, whatever the uptime), removed when the naming process exits.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import tempfile
from pathlib import Path

STATE_ENV = "VLLM_MTP_ADAPTIVE_K_STATE"


def name_state_file() -> Path:
    """The state file of the engine this process is about to start (named once per process)."""
    given = os.environ.get(STATE_ENV)
    if given:
        return Path(given)
    folder = Path(tempfile.mkdtemp(prefix="vllm-mtp-adaptive-k-"))
    path = folder / "state.json"
    os.environ[STATE_ENV] = str(path)

    def remove():
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
            folder.rmdir()

    atexit.register(remove)
    return path


def write_state(summary: dict) -> None:
    """Replace the state file (atomically: a scrape never reads half a file); no-op without one."""
    given = os.environ.get(STATE_ENV)
    if not given:
        return
    path = Path(given)
    with contextlib.suppress(OSError):
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(summary, separators=(",", ":")))
        os.replace(partial, path)


def read_state() -> dict | None:
    """The last state the engine core wrote (None before its first, or without adaptive k)."""
    given = os.environ.get(STATE_ENV)
    if not given:
        return None
    try:
        return json.loads(Path(given).read_text())
    except (OSError, ValueError):
        return None
