"""``python -m vllm_mtp_plugin.tools.live.evaluate SERVING CANDIDATE HELDOUT --out FILE``: both
layers evaluated outside vLLM on the same held-out recorded traffic (``mtp_layer/evaluation.py``:
first-position agreement with the target's next-next token, with its 95 % interval). A process of
its own, so that the server's event loop and memory are not touched."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from ..mtp_layer.evaluation import evaluate

    p = argparse.ArgumentParser(prog="vllm_mtp_plugin.tools.live.evaluate")
    p.add_argument("serving")
    p.add_argument("candidate")
    p.add_argument("heldout")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    result = {name: evaluate(Path(path), Path(args.heldout), 1, "recursive")
              for name, path in (("serving", args.serving), ("candidate", args.candidate))}
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
