"""Measure ``vllm-mtp serve --record`` on the trained tiny DeepSeek: why it re-prefills, and what
it costs. Writes ``benchmarks/results/live/<part>.json``; ``docs/live-traffic.md`` shows them.

    python benchmarks/live_record.py choice   # own passes vs re-prefill: positions the drafter got
    python benchmarks/live_record.py cost     # serve throughput with --record F = 0.1 vs without

Traffic (both parts): chats that share a system prompt, each user turn one of the trained model's
prompts; ``choice`` adds a second turn to each (the first turn and its answer, then a new
question), as chat clients send. Engines run as users run them: vLLM's default compilation,
prefix caching and chunked prefill at vLLM's defaults, MTP k = 1, fp32.

choice: one engine serves the traffic with the drafter's recording on for the whole time (what
recording in the engine's own forward passes would keep), then re-prefills the same sequences the
way the recorder does (``skip_reading_prefix_cache``); for each, the share of sequences whose
every position reached the drafter, and of positions.
cost: ``vllm-mtp serve`` with and without ``--record DIR --record-fraction 0.1``, 3 server
processes each (alternating), the same streamed chats at concurrency 4 (``ignore_eos``), output
tokens/s per pass with other processes' CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from vllm_mtp_plugin.tools.engine.interference import Meter, disturbed
from vllm_mtp_plugin.tools.engine.loadgen import run_requests
from vllm_mtp_plugin.tools.engine.server import Server
from vllm_mtp_plugin.tools.provenance import environment, portable
from vllm_mtp_plugin.tools.tiny import trained

RESULTS = Path(__file__).parent / "results" / "live"
PROMPTS = trained.shipped_dir().parent / "trained_prompts.jsonl"
SYSTEM = ("You are a careful assistant for a software team. Answer in plain language, keep code "
          "short and correct, say when you are unsure, and never invent an API.")
SPEC = {"method": "mtp", "num_speculative_tokens": 1}
MAX_TOKENS = 64


def conversations(copies: int) -> list[list[dict]]:
    """First turns: the shared system prompt, then each trained prompt as the user's message."""
    texts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()]
    return [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": t}]
            for _ in range(copies) for t in texts]


def choice(model: Path, work: Path) -> dict:
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams

    from vllm_mtp_plugin.tools.live.options import WORKER_EXTENSION
    from vllm_mtp_plugin.tools.train.data import positions_received

    llm = LLM(str(model), speculative_config=SPEC, dtype="float32", max_model_len=1024,
              worker_extension_cls=WORKER_EXTENSION, seed=0)
    config = llm.llm_engine.vllm_config
    engine = {"prefix_caching": config.cache_config.enable_prefix_caching,
              "chunked_prefill": config.scheduler_config.enable_chunked_prefill,
              "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
              "compilation_mode": getattr(config.compilation_config.mode, "name",
                                          str(config.compilation_config.mode))}
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    llm.chat(conversations(1)[:2], greedy, use_tqdm=False)  # warm-up, not recorded
    first = conversations(1)

    def serve_both_turns():
        started = time.monotonic()
        turn1 = llm.chat(first, greedy, use_tqdm=False)
        second = [c + [{"role": "assistant", "content": o.outputs[0].text},
                       {"role": "user", "content": "Now make it shorter."}]
                  for c, o in zip(first, turn1)]
        return turn1, llm.chat(second, greedy, use_tqdm=False), time.monotonic() - started

    *_, plain_s = serve_both_turns()  # the same traffic without recording (its time)
    own = work / "own"
    llm.collective_rpc("start_mtp_recording", args=(str(own), False))
    turn1, turn2, serving_s = serve_both_turns()
    llm.collective_rpc("stop_mtp_recording")
    outputs = {"turn 1": turn1, "turn 2": turn2}
    sequences = {turn: [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
                 for turn, outs in outputs.items()}
    calls = [load_file(str(f)) for f in sorted(own.glob("call-*.safetensors"))]
    result = {"engine": engine, "serving_s": {"without_recording": plain_s,
                                              "own_passes_recorded": serving_s}, "turns": {}}
    for turn, seqs in sequences.items():
        # Own passes can give positions 0 .. L-2 (the last token is never fed back).
        got = positions_received(calls, [s[1:] for s in seqs])
        result["turns"][turn] = {"sequences": len(seqs),
                                 "own_passes": _coverage(got, [len(s) - 1 for s in seqs]),
                                 "prompt_tokens": sum(len(o.prompt_token_ids)
                                                      for o in outputs[turn])}
    everything = [s for seqs in sequences.values() for s in seqs]
    again = work / "reprefill"
    prefill = SamplingParams(max_tokens=1, temperature=0.0, skip_reading_prefix_cache=True)
    llm.collective_rpc("start_mtp_recording", args=(str(again), False))
    started = time.monotonic()
    done = llm.generate([{"prompt_token_ids": s} for s in everything], prefill, use_tqdm=False)
    result["reprefill_s"] = time.monotonic() - started
    llm.collective_rpc("stop_mtp_recording")
    calls = [load_file(str(f)) for f in sorted(again.glob("call-*.safetensors"))]
    fed = [s[1:] + [d.outputs[0].token_ids[0]] for s, d in zip(everything, done)]
    got = positions_received(calls, fed)
    offset = 0
    for turn, seqs in sequences.items():
        n = len(seqs)
        result["turns"][turn]["reprefill"] = _coverage(got[offset:offset + n],
                                                       [len(s) for s in seqs])
        offset += n
    return result


def _coverage(received: list[int], lengths: list[int]) -> dict:
    return {"complete_sequences": sum(g == n for g, n in zip(received, lengths)),
            "positions": sum(lengths), "positions_received": sum(received),
            "share_of_positions": sum(received) / sum(lengths)}


def cost(model: Path, work: Path, processes: int, passes: int, copies: int,
         concurrency: int, fraction: float) -> dict:
    traffic = conversations(copies)
    runs = []
    for p in range(processes):
        for record in (False, True):
            extra = (["--record", str(work / f"recorded-{p}"), "--record-fraction",
                      str(fraction), "--record-seed", str(p)] if record else [])
            log = work / f"serve-{'record' if record else 'plain'}-{p}.log"
            with Server(model, ["--speculative-config", json.dumps(SPEC), "--dtype", "float32",
                                "--max-model-len", "1024", "--max-num-seqs", str(concurrency),
                                "--served-model-name", "t", *extra], log_path=log) as server:
                print(f"process {p + 1}/{processes}, record={record}", flush=True)
                run_requests(server.base_url, "t", traffic[:concurrency], MAX_TOKENS,
                             concurrency)
                for n in range(passes):
                    meter = Meter()
                    meter.watch(server.process.pid)
                    with meter:
                        requests, seconds = run_requests(server.base_url, "t", traffic,
                                                         MAX_TOKENS, concurrency)
                    tokens = sum(r["output_tokens"] for r in requests)
                    runs.append({"process": p, "record": record, "pass": n,
                                 "output_tok_s": tokens / seconds, "seconds": seconds,
                                 "requests": len(requests), "interference": meter.result()})
                    print(f"  pass {n + 1}: {tokens / seconds:.1f} tok/s", flush=True)
                time.sleep(3)  # the last windows finish before the count
            if record:
                from vllm_mtp_plugin.tools.train.data import shard_summary

                shards = work / f"recorded-{p}"
                served = (passes * len(traffic) + concurrency)
                summary = (shard_summary(shards) if list(shards.glob("shard-*.safetensors"))
                           else {"shards": 0, "sequences": 0, "tokens": 0})
                runs[-1]["recording"] = {"finished_requests": served,
                                         "shards": summary["shards"],
                                         "recorded_sequences": summary["sequences"],
                                         "recorded_tokens": summary["tokens"]}
    return {"runs": runs, "summary": _cost_summary(runs),
            "settings": {"processes": processes, "passes": passes, "requests": len(traffic),
                         "concurrency": concurrency, "max_tokens": MAX_TOKENS,
                         "record_fraction": fraction}}


def _cost_summary(runs: list[dict]) -> dict:
    """Per process, the median pass; the ratio of medians with record on/off, and its spread
    over the process pairs (process p with recording against process p without)."""
    def median_of(p, record):
        return statistics.median(r["output_tok_s"] for r in runs
                                 if r["process"] == p and r["record"] == record)
    processes = sorted({r["process"] for r in runs})
    plain = [median_of(p, False) for p in processes]
    record = [median_of(p, True) for p in processes]
    ratios = [r / b for r, b in zip(record, plain)]
    recorded = [r["recording"] for r in runs if "recording" in r]
    return {"plain_tok_s": plain, "record_tok_s": record,
            "ratio_median": statistics.median(record) / statistics.median(plain),
            "ratio_per_process_pair": ratios,
            "recorded_sequences": sum(r["recorded_sequences"] for r in recorded),
            "finished_requests": sum(r["finished_requests"] for r in recorded),
            "disturbed_passes": sum(disturbed(r["interference"]) for r in runs)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="live_record.py", description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=("choice", "cost"))
    p.add_argument("--processes", type=int, default=3)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--copies", type=int, default=8, help="cost: the prompts x this per pass")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--fraction", type=float, default=0.1)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    run = environment()
    work = Path(tempfile.mkdtemp(prefix="live-record-"))
    try:
        model = trained.write_checkpoint(work / "trained", 1)
        if args.part == "choice":
            result = choice(model, work)
        else:
            result = cost(model, work, args.processes, args.passes, args.copies,
                          args.concurrency, args.fraction)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.part}.json"
    path.write_text(json.dumps(portable({"environment": run, **result}), indent=1))
    print(json.dumps(portable(result.get("summary") or result.get("turns")), indent=1))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
