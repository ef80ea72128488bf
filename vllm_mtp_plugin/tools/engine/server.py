"""Start and stop an OpenAI-compatible vLLM server (``vllm-mtp serve``) on 127.0.0.1.

Used by the demo, the benchmark's serve mode and the tests: it picks a free port, writes the
server's log to a file, shows progress while the engine starts, and stops exactly the process it
started (by PID, SIGINT first, as vLLM shuts down cleanly on it).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerError(RuntimeError):
    """The server exited or did not become ready; the message carries its last log lines."""


class Server:
    """A ``vllm-mtp serve`` child process. Use as a context manager."""

    def __init__(self, model: str | os.PathLike, serve_args: Sequence[str] = (),
                 log_path: str | os.PathLike | None = None, env: dict[str, str] | None = None,
                 port: int | None = None):
        self.model = str(model)
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.log_path = Path(log_path or f"vllm-mtp-serve-{self.port}.log")
        self.command = [sys.executable, "-m", "vllm_mtp_plugin.tools.cli", "serve", self.model,
                        "--host", "127.0.0.1", "--port", str(self.port), *serve_args]
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 600.0, progress: Callable[[str], None] | None = None) -> "Server":
        return self.launch().wait_ready(timeout, progress)

    def launch(self) -> "Server":
        """Start the process without waiting for it to be ready (``start_all`` overlaps start-ups)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                        env=self.env, start_new_session=True)
        log.close()
        return self

    def wait_ready(self, timeout: float = 600.0,
                   progress: Callable[[str], None] | None = None) -> "Server":
        self._wait_ready(timeout, progress)
        return self

    def _wait_ready(self, timeout: float, progress) -> None:
        deadline = time.monotonic() + timeout
        last_line = ""
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"the server exited with code {self.process.returncode}; "
                                  f"last lines of {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            line = self._last_log_line()
            if progress and line and line != last_line:
                progress(line)
                last_line = line
            time.sleep(0.5)
        self.stop()
        raise ServerError(f"the server was not ready after {timeout:.0f} s; last lines of "
                          f"{self.log_path}:\n{self.log_tail()}")

    def _last_log_line(self) -> str:
        lines = [l for l in self.log_tail(5).splitlines() if l.strip()]
        return lines[-1][-160:] if lines else ""

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        """SIGINT the server's process group (it started one), then SIGKILL if it lingers."""
        if self.process is None or self.process.poll() is not None:
            return
        pgid = os.getpgid(self.process.pid)
        for sig, wait in ((signal.SIGINT, timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> "Server":
        if self.process is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_all(servers: Sequence[Server], timeout: float = 600.0) -> list[Server]:
    """Launch several servers at once, then wait for each: their engines load side by side.

    If one fails, every server of the group is stopped before the error propagates.
    """
    try:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait_ready(timeout)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return list(servers)
