"""MTP speculative decoding from a plain ``LLM(...)`` script, with vLLM's defaults.

Nothing here is specific to the plugin: with it installed, vLLM's ``method: mtp`` picks its
drafter; with ``MTP_PLUGIN=off`` vLLM's own class serves. Run it both ways and compare:

    vllm-mtp build-tiny /tmp/trained --mode trained
    python examples/plain_llm.py /tmp/trained -k 2 --out plugin.json
    MTP_PLUGIN=off python examples/plain_llm.py /tmp/trained -k 2 --out in-tree.json
    diff plugin.json in-tree.json && echo "same tokens, same counters"

It writes greedy token ids per prompt and vLLM's speculative-decoding counters as JSON (vLLM's
log shares standard output). On a machine where other processes hold memory, vLLM's CPU default
(92 % of memory) refuses to start: set ``VLLM_CPU_KVCACHE_SPACE`` (GiB), e.g. 2.
"""

import argparse
import json

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Django's ORM lets you",
           "Once upon a time"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    llm = LLM(args.model, max_model_len=1024, disable_log_stats=False, speculative_config={
        "method": "mtp", "num_speculative_tokens": args.num_speculative_tokens})
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                                   ignore_eos=True))
    counters = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            name = metric.name.removeprefix("vllm:spec_decode_")
            counters[name] = getattr(metric, "values", None) or metric.value
    with open(args.out, "w") as f:
        json.dump({"token_ids": [list(o.outputs[0].token_ids) for o in outputs],
                   "spec_decode": counters}, f, indent=1)


if __name__ == "__main__":
    main()
