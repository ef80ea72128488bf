"""Test files' measured durations: written by every whole-suite run, read to run the slowest first.

``tests/durations.json`` maps each test file (relative to ``tests/``) to the seconds its tests took
(setup, call and teardown summed) in the last run of the whole suite. pytest-xdist hands whole
files to the workers in collection order (``--dist loadfile``); slowest first keeps both workers
busy to the end, where file order left one worker a long tail. A file the last run did not see (a
new one) sorts last; nothing is kept by hand.
"""

import json
import os
from collections import defaultdict
from pathlib import Path

from support.paths import TESTS

FILE = TESTS / "durations.json"


def load(path: Path = FILE) -> dict[str, float]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def slowest_first(items, durations: dict[str, float]) -> None:
    """Sorts pytest's ``items`` by their file's duration, longest first; a file's tests stay
    together and in their order, files without a duration keep theirs, after the others."""
    def seconds(item) -> float:
        return durations.get(_relative(item.path), -1.0)

    items.sort(key=lambda item: -seconds(item))


def _relative(path) -> str:
    try:
        return Path(path).resolve().relative_to(TESTS).as_posix()
    except ValueError:
        return str(path)


class Recorder:
    """Sums the durations pytest reports per test file; on a whole-suite run, writes them.

    Registered in the process that sees every report: the only one without xdist, the controller
    with it (workers' reports reach it through ``pytest_runtest_logreport``)."""

    def __init__(self, config, path: Path = FILE):
        self.config, self.path = config, path
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid.split("::", 1)[0]] += report.duration

    def pytest_sessionfinish(self, session, exitstatus):
        if exitstatus not in (0, 1) or session.shouldstop or not self.whole_suite():
            return
        rootdir = Path(str(self.config.rootpath))
        measured = {_relative(rootdir / nodeid): round(seconds, 1)
                    for nodeid, seconds in self.seconds.items()}
        self.path.write_text(json.dumps(dict(sorted(measured.items())), indent=1) + "\n")

    def whole_suite(self) -> bool:
        """Every test of tests/ ran: the run named tests/ (or nothing under it) and selected none
        out (``-k``, ``-m``, ``--deselect``, ``--lf``)."""
        option = self.config.option
        if option.keyword or option.markexpr or getattr(option, "deselect", None) \
                or getattr(option, "lf", False) or getattr(option, "exitfirst", False):
            return False
        invoked = Path(str(self.config.invocation_params.dir))
        named = [Path(os.path.join(invoked, a.split("::")[0])).resolve() for a in self.config.args]
        return bool(named) and all(p == TESTS for p in named)


def register(config) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        config.pluginmanager.register(Recorder(config), "suite-durations")
