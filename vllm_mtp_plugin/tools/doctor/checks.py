"""One doctor check: its name, pass / fail / skip, a line a user reads, and the figures behind it.

Every run prints the checks as a table and writes them, with the platform facts, as JSON
(``--json FILE``): what a user pastes into an issue.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

STATUSES = ("pass", "fail", "skip")
SCHEMA = "vllm-mtp-doctor/1"


@dataclasses.dataclass
class Check:
    name: str
    status: str
    summary: str
    figures: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"check {self.name}: status {self.status!r} is not one of {STATUSES}")


def check(name: str, ok: bool, summary: str, **figures) -> Check:
    return Check(name, "pass" if ok else "fail", summary, figures)


def format_table(checks: list[Check]) -> str:
    width = max((len(c.name) for c in checks), default=0)
    return "\n".join(f"  {c.status.upper():<4}  {c.name:<{width}}  {c.summary}" for c in checks)


def write_report(path: Path | None, report: dict) -> None:
    """``report`` as JSON at ``path`` (nothing when None), host paths made portable."""
    if path is None:
        return
    from ..provenance import portable

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(portable({"schema": SCHEMA, **report}), indent=1))


def as_dicts(checks: list[Check]) -> list[dict]:
    return [dataclasses.asdict(c) for c in checks]
