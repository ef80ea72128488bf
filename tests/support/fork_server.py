"""Start Python processes by forking one that has already imported vLLM (a fork server).

``from vllm import LLM`` costs ~8 s of one core on a small CPU; a run of many short engines (the
test suite starts about a hundred) pays it once per environment instead of once per engine. Each
job still gets a process of its own: the server only imports (vLLM, and what ``offline``'s child
imports first anyway), then forks one child per job, which takes the job's environment, working
directory and log, and runs the job's ``python`` arguments (``-m module args`` or ``script args``)
as ``__main__``, as a new interpreter would. Nothing of an engine (platform config, plugins,
model, compiled graphs) exists before the fork; what the imports built is frozen out of the
garbage collector's reach first (``gc.freeze``). A child ends as that interpreter would (its exit
code, a traceback in its log, its threads joined, vLLM's exit handlers run), except for the module
teardown, which only frees memory.

One server per environment (the key leaves out ``NOT_IN_KEY``: variables read by nothing at
import); at most ``MAX_SERVERS`` live per process, the least recently used is stopped.
``offline.run_config`` starts its engines through this file's ``run`` when
``MTP_OFFLINE_LAUNCHER`` names it (``tests/conftest.py`` does); by default every engine runs in a
plain new process. It is test code: the installed package holds no fork server.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from typing import NoReturn

# A Python file the server runs after its imports, before it forks: a setting every child of the
# server starts with (the test suite's tests/support/torch_caches.py).
PRELOAD = "MTP_FORK_SERVER_PRELOAD"
MAX_SERVERS = 3
# Read by nothing during the server's imports, so set in the child only: the test's name, and which
# drafter class the plugin registers (read when vLLM loads plugins, in the engine: precedence.py),
# so that the plugin's and vLLM's drafter share one server.
NOT_IN_KEY = ("PYTEST_CURRENT_TEST", "MTP_PLUGIN")
# A new server answers its first job after importing vLLM (~8 s alone, longer on a busy machine).
START_TIMEOUT = 300.0


class _Server:
    """One forking server process and the pipe it answers on."""

    def __init__(self, env: dict[str, str]):
        read_fd, write_fd = os.pipe()
        # What the server prints while it imports (a child's output goes to its own log).
        self.output = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(write_fd)],
            stdin=subprocess.PIPE, stdout=self.output, stderr=subprocess.STDOUT,
            pass_fds=(write_fd,), env=env, text=True)
        os.close(write_fd)
        self.replies, self.pending = read_fd, b""

    def _reply(self, deadline: float | None) -> dict:
        while b"\n" not in self.pending:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.replies], [], [], wait)[0]:
                raise TimeoutError
            chunk = os.read(self.replies, 4096)
            if not chunk:
                self.process.wait()
                self.output.seek(0)
                tail = "\n".join(self.output.read().splitlines()[-20:])
                raise RuntimeError(f"fork server exited (code {self.process.returncode}):\n{tail}")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, job: dict, timeout: float) -> int:
        self.process.stdin.write(json.dumps(job) + "\n")
        self.process.stdin.flush()
        pid = self._reply(time.monotonic() + START_TIMEOUT)["pid"]
        try:
            return self._reply(time.monotonic() + timeout)["exit"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self._reply(None)
            raise subprocess.TimeoutExpired(job["argv"], timeout) from None

    def stop(self) -> None:
        try:
            self.process.stdin.close()
            self.process.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
        os.close(self.replies)
        self.output.close()


_servers: OrderedDict[tuple, _Server] = OrderedDict()
_lock = threading.Lock()


def run(argv: list[str], env: dict[str, str], log_path: str, timeout: float) -> int:
    """Run ``python *argv`` (``["-m", module, ...]`` or ``[script, ...]``) in a forked child with
    ``env``, its output in ``log_path``; return its exit code (negative: killed by that signal).
    Raises ``subprocess.TimeoutExpired`` after killing a child that outran ``timeout``."""
    server_env = {k: v for k, v in env.items() if k not in NOT_IN_KEY}
    key = tuple(sorted(server_env.items()))
    job = {"argv": argv, "env": env, "log": log_path, "cwd": os.getcwd()}
    with _lock:
        server = _servers.pop(key, None)
        if server is not None and server.process.poll() is not None:
            server.stop()  # it died between jobs: close its pipe and output file
            server = None
        if server is None:
            server = _Server(server_env)
        _servers[key] = server
        while len(_servers) > MAX_SERVERS:
            _servers.popitem(last=False)[1].stop()
        try:
            return server.run(job, timeout)
        except (RuntimeError, OSError):
            _servers.pop(key, None)
            server.stop()
            raise


@atexit.register
def _stop_all() -> None:
    while _servers:
        _servers.popitem()[1].stop()


# ------------------------------------------------------------------------------- the server


def _child(job: dict, replies) -> NoReturn:
    """In the forked child: become the process the job asks for, run it, end as it would."""
    replies.close()
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    code = _run_as_main(job["argv"])
    # The end of an interpreter: its threads, its exit handlers (vLLM's engine shutdown among
    # them), its streams. The module teardown after that only frees memory (~2 s for an engine
    # process here): skipped, as multiprocessing's forked children skip it.
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_as_main(argv: list[str]) -> int:
    """``python *argv``'s work and exit code: ``-m module args`` or ``script args``."""
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1


def _serve(reply_fd: int) -> int:
    from vllm import LLM  # noqa: F401  the import this server exists to pay once

    # What ``python -m vllm_mtp_plugin.tools.engine.offline`` imports before its engine (not offline
    # itself: a job runs it as __main__, which runpy wants absent from sys.modules).
    import vllm_mtp_plugin.tools.cpu_features  # noqa: F401
    import vllm_mtp_plugin.tools.engine.eager_reasons  # noqa: F401
    import vllm_mtp_plugin.tools.engine.mrv2  # noqa: F401
    import vllm_mtp_plugin.tools.engine.worker_report  # noqa: F401

    if os.environ.get(PRELOAD):
        runpy.run_path(os.environ[PRELOAD], run_name="fork_server_preload")
    # What the imports built lives as long as every child: out of the collector's reach, vLLM's
    # ~9 collections per engine skip it (2.3 s of an in-process engine's 4.3 s here, 0.8 s after).
    gc.collect()
    gc.freeze()

    # Ctrl-C in a terminal reaches the whole process group: the server ends with its stdin.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    replies = os.fdopen(reply_fd, "w", buffering=1)
    for line in sys.stdin:
        job = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(job, replies)
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"exit": os.waitstatus_to_exitcode(status)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(_serve(int(sys.argv[1])))
