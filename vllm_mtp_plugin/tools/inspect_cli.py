"""``vllm-mtp inspect DIR``: what a checkpoint offers an MTP drafter, read from file headers only.

The report is ``checkpoint/report.py``'s: MTP layers, formats, dtypes, the tensors taken from the
target instead, and the start-up check's problems (exit status 1 when there are any).
"""

from __future__ import annotations

import argparse
import json

from .checkpoint.report import format_report, inspect_checkpoint
from .cli_help import HelpFormatter, examples


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-mtp inspect", description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
        epilog="Exit status 1 when the checkpoint has a problem start-up would refuse it for.\n\n"
        + examples("vllm-mtp inspect /models/DeepSeek-R1",
                   "vllm-mtp inspect /models/DeepSeek-R1-quantized --json > report.json"))
    parser.add_argument("model_dir", metavar="DIR",
                        help="a checkpoint directory (config.json and safetensors files); only "
                             "their headers are read")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = inspect_checkpoint(args.model_dir)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 1 if report["problems"] else 0
