"""Run ``vllm-mtp bench`` from a checkout without installing the console script.

    python benchmarks/bench.py offline -m bench:noisy:0.8 -k 0 1 2 3 --impl plugin in-tree
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from vllm_mtp_plugin.tools.bench.cli import main

    sys.exit(main(sys.argv[1:]))
