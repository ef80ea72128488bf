"""vLLM engine arguments a user gives a tool (``vllm-mtp tune MODEL --max-model-len 4096``), as
``LLM(...)`` keywords: parsed by vLLM's own parser, so they mean what they mean to ``vllm serve``."""

from __future__ import annotations

import json

# vLLM's choices for speculative_config.draft_sample_method / rejection_sample_method, default
# first ("synthetic" rejection is left out: it forces acceptance rates, nothing to measure).
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
REJECTION_SAMPLE_METHODS = ("standard", "block")


def engine_args(extra: list[str], prog: str, refused: tuple[str, ...] = (),
                why_refused: str = "") -> dict:
    """The non-default values of ``extra`` (vLLM engine flags) by ``LLM`` keyword. A flag in
    ``refused`` (the tool sets it itself: ``why_refused`` says how) or a value that is not JSON
    (the tools hand arguments to engines in other processes as JSON) stops with the flag named."""
    if not extra:
        return {}
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog=prog))
    given, default = vars(parser.parse_args(extra)), vars(parser.parse_args([]))
    args = {key: value for key, value in given.items() if default.get(key) != value}
    for key, value in args.items():
        try:
            json.dumps(value)
        except TypeError:
            raise SystemExit(f"{prog}: --{key.replace('_', '-')} is parsed by vLLM into a "
                             f"{type(value).__name__}, which {prog} cannot hand to its engines; "
                             "leave it out") from None
    wrong = sorted(set(args) & set(refused))
    if wrong:
        raise SystemExit(f"{prog} sets {', '.join('--' + r.replace('_', '-') for r in wrong)}"
                         f" itself{f' ({why_refused})' if why_refused else ''}; leave it out")
    return args
