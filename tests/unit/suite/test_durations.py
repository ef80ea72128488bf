"""``support/durations.py``: the suite's files run slowest first by their measured seconds, a file
without a measurement last, each file's tests together and in their order; only a run of the
whole suite rewrites the measurements."""

import json
from types import SimpleNamespace

from support import durations
from support.paths import TESTS


def _item(relative: str, name: str):
    return SimpleNamespace(path=TESTS / relative, name=name)


def test_slowest_file_first_unknown_last_tests_of_a_file_together():
    items = [_item("unit/a/test_x.py", "1"), _item("unit/a/test_x.py", "2"),
             _item("engine/b/test_y.py", "1"), _item("engine/c/test_new.py", "1"),
             _item("engine/b/test_y.py", "2"), _item("unit/a/test_z.py", "1")]
    measured = {"unit/a/test_x.py": 0.5, "engine/b/test_y.py": 300.0, "unit/a/test_z.py": 0.0}
    durations.slowest_first(items, measured)
    assert [(i.path.relative_to(TESTS).as_posix(), i.name) for i in items] == [
        ("engine/b/test_y.py", "1"), ("engine/b/test_y.py", "2"), ("unit/a/test_x.py", "1"),
        ("unit/a/test_x.py", "2"), ("unit/a/test_z.py", "1"), ("engine/c/test_new.py", "1")]


def _recorder(tmp_path, args, **options):
    option = SimpleNamespace(keyword="", markexpr="", deselect=None, lf=False, exitfirst=False)
    vars(option).update(options)
    config = SimpleNamespace(option=option, args=args, rootpath=TESTS.parent,
                             invocation_params=SimpleNamespace(dir=TESTS.parent))
    return durations.Recorder(config, tmp_path / "durations.json")


def _report(nodeid: str, seconds: float):
    return SimpleNamespace(nodeid=nodeid, duration=seconds)


def test_a_whole_suite_run_writes_each_files_seconds(tmp_path):
    recorder = _recorder(tmp_path, ["tests"])
    for nodeid, seconds in [("tests/unit/a/test_x.py::test_1", 0.3),
                            ("tests/unit/a/test_x.py::test_2", 0.5),
                            ("tests/engine/b/test_y.py::test_1[v1]", 12.0)]:
        recorder.pytest_runtest_logreport(_report(nodeid, seconds))
    recorder.pytest_sessionfinish(SimpleNamespace(shouldstop=False), 1)  # failures still count
    assert json.loads((tmp_path / "durations.json").read_text()) == {
        "engine/b/test_y.py": 12.0, "unit/a/test_x.py": 0.8}


def test_a_partial_or_stopped_run_writes_nothing(tmp_path):
    cases = [_recorder(tmp_path, ["tests/unit"]), _recorder(tmp_path, ["tests/engine/b/test_y.py"]),
             _recorder(tmp_path, ["tests"], keyword="sampling"),
             _recorder(tmp_path, ["tests"], markexpr="not engine"),
             _recorder(tmp_path, ["tests"], exitfirst=True)]
    for recorder in cases:
        recorder.pytest_runtest_logreport(_report("tests/unit/a/test_x.py::test_1", 1.0))
        recorder.pytest_sessionfinish(SimpleNamespace(shouldstop=False), 0)
    whole = _recorder(tmp_path, ["tests"])
    whole.pytest_sessionfinish(SimpleNamespace(shouldstop=False), 2)  # interrupted
    assert not (tmp_path / "durations.json").exists()
