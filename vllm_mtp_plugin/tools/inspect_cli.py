"""``vllm-mtp inspect DIR``: what a checkpoint offers an MTP drafter, read from file headers only.

The report is ``checkpoint/report.py``'s: MTP layers, formats, dtypes, the tensors taken from the
target instead, and the start-up check's problems (exit status 1 when there are any).
"""

from __future__ import annotations

import argparse
import json

from .checkpoint.report import format_report, inspect_checkpoint


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-mtp inspect", description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = inspect_checkpoint(args.model_dir)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 1 if report["problems"] else 0
