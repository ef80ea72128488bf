"""Measure ``vllm-mtp serve --record`` on the trained tiny DeepSeek: why it re-prefills, and what
it costs. Writes ``benchmarks/results/live/<part>.json``; ``docs/live-traffic.md`` shows them.

    python benchmarks/live_record.py choice   # own passes vs re-prefill: positions the drafter got
    python benchmarks/live_record.py cost     # serve throughput with --record F = 0.1 vs without

Traffic (both parts): chats that share a system prompt, each user turn one of the trained model's
prompts; ``choice`` adds a second turn to each (the first turn and its answer, then a new
question), as chat clients send. Engines run as users run them: vLLM's default compilation,
prefix caching and chunked prefill at vLLM's defaults, MTP k = 1, fp32.

choice: per KV block size, one engine serves the traffic (a system prompt of a few hundred
tokens) from an empty prefix cache with the drafter's recording on for the whole time (what
recording in the engine's own forward passes would keep), then re-prefills the same sequences the
way the recorder does (``skip_reading_prefix_cache``); for each, the share of sequences whose
every position reached the drafter, and of positions. Prefix caching and chunked prefill must be
on: where vLLM turns them off for MLA (CPUs without AMX) the target's attention runs unabsorbed
(``VLLM_MLA_DISABLE=1``).
cost: ``vllm-mtp serve`` with and without ``--record DIR --record-fraction 0.1``, both running,
passes alternating between them (3 rounds of fresh server processes), the same streamed chats at
concurrency 4 (``ignore_eos``); output tokens/s per pass (recording windows that outlast a pass
charged to it) with other processes' CPU seconds; each recording pass compared with the plain
pass next to it, since this machine's speed drifts by a third between passes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import regex as re

from vllm_mtp_plugin.tools.engine.interference import Meter, disturbed
from vllm_mtp_plugin.tools.engine.loadgen import run_requests
from vllm_mtp_plugin.tools.engine.server import Server
from vllm_mtp_plugin.tools.live import record_metrics
from vllm_mtp_plugin.tools.live.options import RecordSettings
from vllm_mtp_plugin.tools.provenance import environment, portable
from vllm_mtp_plugin.tools.tiny import trained

RESULTS = Path(__file__).parent / "results" / "live"
PROMPTS = trained.shipped_dir().parent / "trained_prompts.jsonl"
SYSTEM = ("You are a careful assistant for a software team. Answer in plain language, keep code "
          "short and correct, say when you are unsure, and never invent an API.")
SPEC = {"method": "mtp", "num_speculative_tokens": 1}
MAX_TOKENS = 64
# ``choice``: a system prompt of the length deployed assistants send (a few hundred tokens), so
# that it fills whole KV blocks that later requests read from the prefix cache.
LONG_SYSTEM = " ".join([
    SYSTEM,
    "You work inside the team's code review tool. Every message you receive comes from an "
    "engineer who is in the middle of a change and wants an answer they can act on at once.",
    "When the question is about code, answer with the smallest change that solves it, in the "
    "language the question uses, and explain in one or two sentences why it works.",
    "When the question is about prose, keep the writer's voice, fix what is wrong, and do not "
    "add claims the writer did not make.",
    "If a request is ambiguous, state the reading you chose in one sentence and answer that "
    "reading; do not ask a question back unless no reading makes sense.",
    "Never print secrets, tokens or passwords, even when they appear in the material you are "
    "given; refer to them by name instead.",
    "Prefer the standard library to third-party packages, name the version of any tool whose "
    "behaviour changed between versions, and mark code you have not run as untested.",
    "Format answers in Markdown: short paragraphs, code in fenced blocks with the language "
    "named, lists only for steps that must happen in order.",
    "If the engineer's approach is unsafe or will not work, say so first, then give the "
    "alternative, and keep the tone of a colleague rather than of a teacher."])
# Two servers share the machine in ``cost``: a CPU KV cache of 2 GiB each, not vLLM's 92 % of RAM.
KV_CACHE = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}


def conversations(copies: int, system: str = SYSTEM) -> list[list[dict]]:
    """First turns: the shared system prompt, then each trained prompt as the user's message."""
    texts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()]
    return [[{"role": "system", "content": system}, {"role": "user", "content": t}]
            for _ in range(copies) for t in texts]


def choice(model: Path, work: Path, block_sizes: list[int], attention: str) -> dict:
    """One engine per KV block size (prefix caching hits whole blocks only)."""
    unabsorbed = attention == "unabsorbed" or (attention == "auto" and _mla_turns_caching_off())
    if unabsorbed:
        os.environ["VLLM_MLA_DISABLE"] = "1"
    engines = {}
    for block_size in block_sizes:
        print(f"block size {block_size}", flush=True)
        engines[str(block_size)] = _choice_engine(model, work / f"block-{block_size}", block_size)
    return {"attention": "unabsorbed (VLLM_MLA_DISABLE=1)" if unabsorbed else "MLA",
            "engines": engines}


def _mla_turns_caching_off() -> bool:
    """vLLM's CPU platform turns prefix caching and chunked prefill off for MLA unless the CPU
    has AMX tiles (``platforms/cpu.py``, ``check_and_update_config``)."""
    import torch
    from vllm.platforms import current_platform

    return current_platform.is_cpu() and not torch.cpu._is_amx_tile_supported()


def _choice_engine(model: Path, work: Path, block_size: int) -> dict:
    """Both turns served from an empty prefix cache, recording every drafter call (what recording
    in the engine's own passes could keep), then the same sequences re-prefilled the recorder's
    way. Own passes are counted twice: per request, the positions its own steps computed
    (vLLM's ``num_cached_tokens`` tells how many prompt tokens came from the cache instead), and
    stitched: recorded rows of any request at the same positions with the same tokens (matched
    as ``tools/mtp_layer/drafter_inputs.py`` assembles calls), from whichever request computed them while
    recording was on."""
    import gc

    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams

    from vllm_mtp_plugin.tools.live.options import WORKER_EXTENSION
    from vllm_mtp_plugin.tools.mtp_layer.drafter_inputs import positions_received

    llm = LLM(str(model), speculative_config=SPEC, dtype="float32", max_model_len=2048,
              block_size=block_size, worker_extension_cls=WORKER_EXTENSION, seed=0)
    config = llm.llm_engine.vllm_config
    engine = {"prefix_caching": config.cache_config.enable_prefix_caching,
              "chunked_prefill": config.scheduler_config.enable_chunked_prefill,
              "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
              "block_size": config.cache_config.block_size,
              "use_mla": config.model_config.use_mla,
              "compilation_mode": getattr(config.compilation_config.mode, "name",
                                          str(config.compilation_config.mode))}
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    first = conversations(1, LONG_SYSTEM)
    llm.chat(conversations(1, "Be brief.")[:2], greedy, use_tqdm=False)  # warm-up

    def serve_both_turns():
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset the prefix cache: the turns would not start "
                               "from an empty cache")
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
        lengths = [len(s) - 1 for s in seqs]
        cached = [o.num_cached_tokens or 0 for o in outputs[turn]]
        result["turns"][turn] = {
            "sequences": len(seqs),
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs[turn]),
            "prompt_tokens_from_cache": sum(cached),
            "own_passes": _coverage([n - c for n, c in zip(lengths, cached)], lengths),
            "own_passes_stitched": _coverage(positions_received(calls, [s[1:] for s in seqs]),
                                             lengths)}
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
        result["turns"][turn]["reprefill_prompt_tokens_from_cache"] = sum(
            d.num_cached_tokens or 0 for d in done[offset:offset + n])
        offset += n
    result["system_prompt_tokens"] = _shared_prefix(sequences["turn 1"])
    del llm
    gc.collect()
    return result


def _shared_prefix(sequences: list[list[int]]) -> int:
    """Tokens every sequence starts with (the chat template and the system prompt)."""
    n = 0
    while all(len(s) > n and s[n] == sequences[0][n] for s in sequences):
        n += 1
    return n


def _coverage(received: list[int], lengths: list[int]) -> dict:
    return {"complete_sequences": sum(g == n for g, n in zip(received, lengths)),
            "positions": sum(lengths), "positions_received": sum(received),
            "share_of_positions": sum(received) / sum(lengths)}


def cost(model: Path, work: Path, processes: int, passes: int, copies: int,
         concurrency: int, fraction: float) -> dict:
    """Per process round: a server without and one with ``--record`` run side by side (the idle
    one blocks on its queue), passes alternate between them (ABBA...), so drifts of the
    machine's speed fall on both arms alike."""
    traffic = conversations(copies)
    gap = RecordSettings.window_wait_s + 1.5  # the last window of a pass ends before the next
    runs, recorded = [], []
    free = os.sched_getaffinity(0)
    for p in range(processes):
        _set_affinity([psutil.Process(os.getpid())], free)  # the next servers see every CPU
        print(f"process round {p + 1}/{processes}", flush=True)
        with contextlib.ExitStack() as stack:
            servers = {}
            for record in (False, True):
                extra = (["--record", str(work / f"recorded-{p}"), "--record-fraction",
                          str(fraction), "--record-seed", str(p)] if record else [])
                servers[record] = stack.enter_context(Server(
                    model, ["--speculative-config", json.dumps(SPEC), "--dtype", "float32",
                            "--max-model-len", "1024", "--max-num-seqs", str(concurrency),
                            "--served-model-name", "t", *extra],
                    log_path=work / f"serve-{'record' if record else 'plain'}-{p}.log",
                    env=KV_CACHE))
            pinned = _keep_off_the_workers_cores(servers.values())
            for server in servers.values():
                run_requests(server.base_url, "t", traffic[:concurrency], MAX_TOKENS,
                             concurrency)
            time.sleep(gap)
            for n in range(passes):
                for record in ((False, True) if n % 2 == 0 else (True, False)):
                    runs.append(_pass(servers, record, traffic, concurrency, gap)
                                | {"process": p, "pass": n})
                    print(f"  pass {n + 1} record={record}: "
                          f"{runs[-1]['output_tok_s']:.1f} tok/s", flush=True)
            recorded.append(_recorded(servers[True].base_url, work / f"recorded-{p}")
                            | {"pinned_to_cpus": pinned})
    return {"runs": runs, "recording": recorded, "summary": _cost_summary(runs, recorded),
            "settings": {"processes": processes, "passes": passes, "requests": len(traffic),
                         "concurrency": concurrency, "max_tokens": MAX_TOKENS,
                         "record_fraction": fraction, "gap_s": gap}}


def _keep_off_the_workers_cores(servers) -> list[int] | None:
    """Move this process and every server process but the model's worker onto the CPUs that
    vLLM's CPU thread binding reserves for them (``reserved_cpus`` in the server log,
    ``vllm/utils/ompmultiprocessing.py``). vLLM binds the worker's OpenMP threads but leaves the
    rest free to run on the worker's core; on 2 cores that lottery alone moved a pass's speed
    by a third. None where the log names no reserved CPUs (a GPU, an explicit binding)."""
    for server in servers:
        log = server.log_path.read_text(errors="replace")
        found = re.search(r"reserved_cpus=\[([0-9, ]+)\]", log)
        if found:
            break
    else:
        return None
    cpus = sorted(int(c) for c in found[1].split(","))
    trees = [psutil.Process(os.getpid())]
    for server in servers:
        root = psutil.Process(server.process.pid)
        trees += [root, *root.children(recursive=True)]
    _set_affinity([p for p in trees if "Worker" not in p.name()], cpus)
    return cpus


def _set_affinity(processes, cpus) -> None:
    """Every thread of each process (Linux sets affinity per thread; new ones inherit it)."""
    for process in processes:
        for thread in process.threads():
            os.sched_setaffinity(thread.id, cpus)


def _pass(servers: dict, record: bool, traffic, concurrency: int, gap: float) -> dict:
    """One pass on one server. A recording window still running when the last request ends
    (or starting after it, for requests sampled at the end) is charged to the pass: its
    seconds from ``/metrics`` (``record_window_seconds``) are added to the pass's time."""
    server = servers[record]
    meter = Meter()
    for s in servers.values():  # the idle server is part of the setup, not a disturbance
        meter.watch(s.process.pid)
    with meter:
        requests, seconds = run_requests(server.base_url, "t", traffic, MAX_TOKENS, concurrency)
        ended = record_metrics.read(server.base_url).get("window_seconds", 0.0)
    time.sleep(gap)
    after = record_metrics.read(server.base_url).get("window_seconds", 0.0)
    tokens = sum(r["output_tokens"] for r in requests)
    charged = seconds + (after - ended)
    return {"record": record, "output_tok_s": tokens / charged, "seconds": seconds,
            "window_seconds_after_end": after - ended, "requests": len(requests),
            "output_tokens": tokens, "interference": meter.result()}


def _recorded(base_url: str, shards: Path) -> dict:
    from vllm_mtp_plugin.tools.mtp_layer.shard_format import shard_summary

    figures = record_metrics.read(base_url)
    summary = (shard_summary(shards) if list(shards.glob("shard-*.safetensors"))
               else {"shards": 0, "sequences": 0, "tokens": 0})
    return {"metrics": figures, "shards": summary["shards"],
            "recorded_sequences": summary["sequences"], "recorded_tokens": summary["tokens"]}


def _cost_summary(runs: list[dict], recorded: list[dict]) -> dict:
    """Each recording pass against the plain pass next to it (same pass number): the median
    ratio per process round, their median and spread, and the quartiles of all pair ratios."""
    pairs = {}
    for r in runs:
        pairs.setdefault((r["process"], r["pass"]), {})[r["record"]] = r["output_tok_s"]
    ratios = {key: pair[True] / pair[False] for key, pair in sorted(pairs.items())
              if len(pair) == 2}
    processes = sorted({p for p, _ in ratios})
    per_process = [statistics.median(v for (p, _), v in ratios.items() if p == q)
                   for q in processes]
    quartiles = statistics.quantiles(ratios.values(), n=4) if len(ratios) > 1 else []
    return {"ratio_median": statistics.median(per_process),
            "ratio_per_process": per_process,
            "pair_ratio_quartiles": quartiles, "pairs": len(ratios),
            "plain_tok_s_median": statistics.median(r["output_tok_s"] for r in runs
                                                    if not r["record"]),
            "record_tok_s_median": statistics.median(r["output_tok_s"] for r in runs
                                                     if r["record"]),
            "window_seconds": sum(r["metrics"].get("window_seconds", 0.0) for r in recorded),
            "recorded_sequences": sum(r["recorded_sequences"] for r in recorded),
            "finished_requests": sum(r["metrics"].get("finished_requests", 0.0)
                                     for r in recorded),
            "disturbed_passes": sum(disturbed(r["interference"]) for r in runs)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="live_record.py", description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=("choice", "cost"))
    p.add_argument("--processes", type=int, default=3)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--copies", type=int, default=8, help="cost: the prompts x this per pass")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--fraction", type=float, default=0.1)
    p.add_argument("--block-sizes", default="32,128",
                   help="choice: one engine per KV block size. GPUs' MLA kernels take 16 "
                        "(FlashAttention MLA, first on Hopper) to 128 (CUTLASS MLA); this CPU's "
                        "attention backend takes multiples of 32 (128 is its default)")
    p.add_argument("--attention", choices=("auto", "mla", "unabsorbed"), default="auto",
                   help="choice: auto = unabsorbed (VLLM_MLA_DISABLE=1) where vLLM turns prefix "
                        "caching off for MLA (CPUs without AMX)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    run = environment()
    work = Path(tempfile.mkdtemp(prefix="live-record-"))
    try:
        model = trained.write_checkpoint(work / "trained", 1)
        if args.part == "choice":
            result = choice(model, work, [int(b) for b in args.block_sizes.split(",")],
                            args.attention)
        else:
            result = cost(model, work, args.processes, args.passes, args.copies,
                          args.concurrency, args.fraction)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.part}.json"
    path.write_text(json.dumps(portable({"environment": run, **result}), indent=1))
    print(json.dumps(portable(result.get("summary") or result.get("engines")), indent=1))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
