"""Engines compile as vLLM does by default; every eager one names a reason from one list.

``vllm_mtp_plugin/tools/engine_modes.py`` holds the reasons. These tests keep it the one place:
an unknown reason is refused, a run that counts layer calls must say so, and no test or tool
turns compilation off with a bare ``enforce_eager=True`` / ``--enforce-eager``.
"""

import re
from pathlib import Path

import pytest

from vllm_mtp_plugin.tools.engine_modes import (EAGER_REASONS, eager_for, eager_serve_args)
from vllm_mtp_plugin.tools.offline import OfflineConfig

ROOT = Path(__file__).resolve().parents[1]
# The bench's --enforce-eager is a user's option: its flag, its handling and the test of the flag.
USER_OPTION = {"vllm_mtp_plugin/tools/bench/cli.py", "vllm_mtp_plugin/tools/bench/serve_mode.py",
               "tests/test_bench_e2e.py"}
BARE_EAGER = re.compile(r"enforce_eager\s*=\s*True|\"--enforce-eager\"|'enforce_eager':\s*True"
                        r"|\"enforce_eager\":\s*True")


def test_default_is_vllms_compilation_and_reasons_are_listed():
    assert eager_for(None) is False and eager_serve_args(None) == []
    for reason in EAGER_REASONS:
        assert eager_for(reason) is True and eager_serve_args(reason) == ["--enforce-eager"]
    with pytest.raises(ValueError, match=r"unknown reason to run eager 'faster'.*engine_modes\.py"):
        eager_for("faster")
    with pytest.raises(ValueError, match="unknown reason"):
        OfflineConfig("m", eager="because")


def test_counting_layer_calls_needs_the_stated_reason():
    with pytest.raises(ValueError, match='eager="layer-calls"'):
        OfflineConfig("m", 2, record_layer_calls=True)
    assert OfflineConfig("m", 2, record_layer_calls=True, eager="layer-calls").eager


def test_no_engine_turns_compilation_off_without_a_reason():
    found = []
    for path in [*ROOT.glob("vllm_mtp_plugin/**/*.py"), *ROOT.glob("tests/**/*.py"),
                 *ROOT.glob("benchmarks/**/*.py"), *ROOT.glob("examples/**/*.py")]:
        relative = path.relative_to(ROOT).as_posix()
        if relative in USER_OPTION or relative == "vllm_mtp_plugin/tools/engine_modes.py" \
                or path == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if BARE_EAGER.search(line):
                found.append(f"{relative}:{number}: {line.strip()}")
    assert found == [], "use tools/engine_modes.py (eager_for / eager_serve_args):\n" + "\n".join(found)
