"""Engines compile as vLLM does by default; every eager one names a reason from one list.

``vllm_mtp_plugin/tools/engine/eager_reasons.py`` holds the reasons. These tests keep it the one place:
an unknown reason is refused, a run that counts layer calls must say so, and no test, tool or
script turns compilation off otherwise: Python is parsed (``enforce_eager`` set to ``True``, a
variable or any expression, as a keyword or a dict entry, and the ``--enforce-eager`` flag) and
shell scripts are scanned.
"""

import ast
import re
from pathlib import Path

import pytest

from support import paths
from vllm_mtp_plugin.tools.engine.eager_reasons import EAGER_REASONS, eager_for, eager_serve_args
from vllm_mtp_plugin.tools.engine.offline import OfflineConfig

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

ROOT = paths.REPO
# The bench's --enforce-eager is a user's option: its flag, its handling and the test of the flag.
USER_OPTION = {"vllm_mtp_plugin/tools/bench/cli.py", "vllm_mtp_plugin/tools/bench/serve_mode.py",
               "vllm_mtp_plugin/tools/bench/offline_mode.py",
               "tests/engine/bench/test_bench_e2e.py"}
REASONED = {"eager_for", "eager_serve_args"}  # tools/engine/eager_reasons.py: the one list of reasons
EAGER_FLAG = re.compile(r"--enforce-eager|enforce_eager")


def _calls_reasoned(node: ast.AST) -> bool:
    """The value comes from engine/eager_reasons.py (``eager_for(reason)`` somewhere inside it)."""
    return any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None))
               in REASONED for n in ast.walk(node))


def eager_settings_without_reason(source: str) -> list[tuple[int, str]]:
    """(line, what) for every place the code sets ``enforce_eager`` (a keyword argument or a dict
    entry, whatever its value: ``True``, a variable, an expression) or passes the
    ``--enforce-eager`` flag, unless the value comes from ``engine/eager_reasons.py``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.keyword) and node.arg == "enforce_eager":
            if not _calls_reasoned(node.value):
                found.append((node.value.lineno, f"enforce_eager={ast.unparse(node.value)}"))
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == "enforce_eager" \
                        and not _calls_reasoned(value):
                    found.append((key.lineno, f"'enforce_eager': {ast.unparse(value)}"))
        elif isinstance(node, ast.Constant) and node.value == "--enforce-eager":
            found.append((node.lineno, "'--enforce-eager'"))
    return found


def _python_files():
    for pattern in ("vllm_mtp_plugin/**/*.py", "tests/**/*.py", "benchmarks/**/*.py",
                    "examples/**/*.py"):
        yield from ROOT.glob(pattern)


def _shell_files():
    yield ROOT / ".ci" / "run"
    for pattern in ("*.sh", "**/*.sh"):
        yield from ROOT.glob(pattern)


def test_default_is_vllms_compilation_and_reasons_are_listed():
    assert eager_for(None) is False and eager_serve_args(None) == []
    for reason in EAGER_REASONS:
        assert eager_for(reason) is True and eager_serve_args(reason) == ["--enforce-eager"]
    with pytest.raises(ValueError, match=r"unknown reason to run eager 'faster'.*engine/eager_reasons\.py"):
        eager_for("faster")
    with pytest.raises(ValueError, match="unknown reason"):
        OfflineConfig("m", eager="because")


def test_counting_layer_calls_needs_the_stated_reason():
    with pytest.raises(ValueError, match='eager="layer-calls"'):
        OfflineConfig("m", 2, record_layer_calls=True)
    assert OfflineConfig("m", 2, record_layer_calls=True, eager="layer-calls").eager


def test_no_engine_turns_compilation_off_without_a_reason():
    found = []
    for path in _python_files():
        relative = path.relative_to(ROOT).as_posix()
        if relative in USER_OPTION or relative == "vllm_mtp_plugin/tools/engine/eager_reasons.py" \
                or path == Path(__file__).resolve():
            continue
        found += [f"{relative}:{line}: {what}"
                  for line, what in eager_settings_without_reason(path.read_text())]
    for path in sorted(set(_shell_files())):
        relative = path.relative_to(ROOT).as_posix()
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if EAGER_FLAG.search(line.split("#", 1)[0]):
                found.append(f"{relative}:{number}: {line.strip()}")
    assert found == [], "use tools/engine/eager_reasons.py (eager_for / eager_serve_args):\n" + "\n".join(found)


@pytest.mark.parametrize("code", [
    "LLM(m, enforce_eager=True)", "LLM(m, enforce_eager=eager)", "LLM(m, enforce_eager=not compiled)",
    "kwargs = {'enforce_eager': flag}", "args = ['serve', '--enforce-eager']",
    "EngineArgs(enforce_eager=cfg.get('eager', True))",
])
def test_the_scan_catches_every_way_of_turning_compilation_off(code):
    assert len(eager_settings_without_reason(code)) == 1


@pytest.mark.parametrize("code", [
    "LLM(m, enforce_eager=eager_for('load-time'))", "args = eager_serve_args(reason)",
    "kwargs = {'enforce_eager': eager_for(config.eager)}", "eager = config.enforce_eager",
])
def test_the_scan_lets_listed_reasons_and_reads_through(code):
    assert eager_settings_without_reason(code) == []
