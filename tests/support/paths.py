"""Where the suite's files are, for test files at any depth under tests/."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
SUPPORT = TESTS / "support"
DATA = TESTS / "data"
HARNESS = TESTS / "mrv2_harness"
