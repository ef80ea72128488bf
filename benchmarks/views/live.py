"""``vllm-mtp serve --record`` measured (``benchmarks/live_record.py``, ``results/live``): what
recording costs a server, and what each way of recording would keep."""

from __future__ import annotations

import statistics

from vllm_mtp_plugin.tools.stats import median_interval

from .common import load, source_line, table

COST = "benchmarks/results/live/cost.json"
CHOICE = "benchmarks/results/live/choice.json"
# vLLM 0.32's CompilationMode, for results that stored its number
MODES = {"0": "NONE", "1": "STOCK_TORCH_COMPILE", "2": "DYNAMO_TRACE_ONCE", "3": "VLLM_COMPILE"}


def record_cost() -> str:
    """Per round of server processes (one with ``--record``, one without, both running, passes
    alternating): median output tokens/s of each arm and of the pass-pair ratios; then the
    median over rounds with the quartiles of all pairs, and how much was recorded."""
    data = load(COST)
    summary, settings, runs = data["summary"], data["settings"], data["runs"]
    rows = []
    for p, ratio in enumerate(summary["ratio_per_process"]):
        mine = [r for r in runs if r["process"] == p]
        tok_s = {arm: statistics.median(r["output_tok_s"] for r in mine if r["record"] == arm)
                 for arm in (False, True)}
        spread = _pair_ratios(mine)
        rows.append([str(p + 1), str(len(spread)), f"{tok_s[False]:.1f}", f"{tok_s[True]:.1f}",
                     f"{ratio:.3f}", f"{min(spread):.3f}–{max(spread):.3f}"])
    low, _, high = summary["pair_ratio_quartiles"]
    every = _pair_ratios(runs)
    interval = median_interval(every) or (float("nan"), float("nan"))  # under 6 pairs: none
    pinned = {", ".join(map(str, r["pinned_to_cpus"])) if r.get("pinned_to_cpus")
              else "not pinned (no reserved CPU in the server log)" for r in data["recording"]}
    record_s = _recording_served_seconds(runs)
    return "\n".join([
        table(["round", "pass pairs", "without recording, tok/s (median)",
               f"--record-fraction {settings['record_fraction']:g}, tok/s (median)",
               "ratio (median of pairs)", "pair ratios"], rows), "",
        f"With recording the server ran at {summary['ratio_median']:.3f}× of its speed without "
        f"(median of the {len(rows)} rounds; all {summary['pairs']} pass pairs: median "
        f"{statistics.median(every):.3f}, 95 % interval {interval[0]:.3f}–{interval[1]:.3f}, "
        f"quartiles {low:.3f}–{high:.3f}), {settings['requests']} chat requests of "
        f"{settings['max_tokens']} tokens per pass at concurrency {settings['concurrency']}; "
        f"processes other than the model's worker on CPU(s) {'; '.join(sorted(pinned))}. "
        f"Recording windows were open {summary['window_seconds']:.1f} s of the "
        f"{record_s:.0f} s the recording server served "
        f"({summary['window_seconds'] / record_s:.1%}; {summary['recorded_sequences']} of "
        f"{summary['finished_requests']:.0f} finished requests recorded); "
        f"{summary['disturbed_passes']} pass(es) with other work above 5 % of the CPUs. "
        f"{source_line(COST)}"])


def _pair_ratios(runs: list[dict]) -> list[float]:
    """Each recording pass over the plain pass of the same round and pass number."""
    pairs = {}
    for r in runs:
        pairs.setdefault((r["process"], r["pass"]), {})[r["record"]] = r["output_tok_s"]
    return [pair[True] / pair[False] for pair in pairs.values() if len(pair) == 2]


def record_cost_interval() -> str:
    """The 95 % interval of the median pair ratio (order statistics), for the docs' prose."""
    low, high = median_interval(_pair_ratios(load(COST)["runs"]))
    return f"{low:.3f}–{high:.3f}"


def record_window_share() -> str:
    """Share of the recording server's serving time with a recording window open."""
    data = load(COST)
    return f"{data['summary']['window_seconds'] / _recording_served_seconds(data['runs']):.1%}"


def _recording_served_seconds(runs: list[dict]) -> float:
    """The recording server's passes, windows that outlasted them included."""
    return sum(r["seconds"] + r["window_seconds_after_end"] for r in runs if r["record"])


def record_cost_ratio() -> str:
    return f"{load(COST)['summary']['ratio_median']:.3f}×"


def record_choice() -> str:
    """Per KV block size and turn of the chat traffic: how many positions each way of recording
    got, and how much of the prompts vLLM read from its prefix cache."""
    data = load(CHOICE)
    rows, notes = [], []
    for block_size, run in data["engines"].items():
        for turn, row in run["turns"].items():
            share = {way: f"{row[way]['share_of_positions']:.3f} "
                          f"({row[way]['complete_sequences']})"
                     for way in ("own_passes", "own_passes_stitched", "reprefill")}
            rows.append([block_size, turn, str(row["sequences"]), str(row["own_passes"]["positions"]),
                         f"{row['prompt_tokens_from_cache']} of {row['prompt_tokens']}",
                         share["own_passes"], share["own_passes_stitched"],
                         f"{share['reprefill']}, {row['reprefill_prompt_tokens_from_cache']} "
                         f"read from the cache"])
        seconds = run["serving_s"]
        notes.append(f"{block_size}-token blocks: both turns served in "
                     f"{seconds['without_recording']:.2f} s without recording, "
                     f"{seconds['own_passes_recorded']:.2f} s recording every drafter call; "
                     f"re-prefilling all {sum(r['sequences'] for r in run['turns'].values())} "
                     f"sequences {run['reprefill_s']:.2f} s")
    first = next(iter(data["engines"].values()))
    engine, system = first["engine"], first["system_prompt_tokens"]
    return "\n".join([
        table(["KV block", "traffic", "sequences", "positions", "prompt tokens from the cache",
               "own passes, per request: share (complete sequences)",
               "own passes, stitched from every recorded pass: share (complete)",
               "re-prefill: share (complete)"], rows), "",
        f"Engine: prefix caching {'on' if engine['prefix_caching'] else 'off'}, chunked prefill "
        f"{'on' if engine['chunked_prefill'] else 'off'} ({engine['max_num_batched_tokens']} "
        f"tokens per step), attention {data['attention']}, compilation "
        f"{MODES.get(engine['compilation_mode'], engine['compilation_mode'])} (vLLM's default "
        f"here); the conversations share a chat template and system prompt of {system} tokens. "
        f"{'; '.join(notes)}. {source_line(CHOICE)}"])


ADAPT = "benchmarks/results/live/adapt.json"


def adapt_events() -> str:
    """Each round of ``--adapt`` in the proof (``benchmarks/live_adapt.py``): when, what it
    decided, the held-out agreements and the served acceptance it watched."""
    data = load(ADAPT)
    rows = []
    for e in data["events"]:
        figures = ""
        if "candidate_agreement" in e:
            figures = (f"held-out agreement: candidate {e['candidate_agreement']:.3f}, serving "
                       f"{e['serving_agreement']:.3f} ({e['positions']} positions)")
        elif "served" in e:
            s = e["served"]
            figures = (f"served acceptance: new {s['new']:.3f} over {s['new_draft_tokens']:.0f} "
                       f"draft tokens, previous {s['previous']:.3f}")
        elif e["event"] == "training":
            figures = f"{e['shards']} shards, {e['recorded_tokens']} recorded tokens"
        elif "error" in e:
            figures = e["error"].replace("|", "/")[:160]
        rows.append([f"{e['t'] / 60:.1f}", str(e["round"]), e["event"], figures])
    return table(["minute", "round", "event", "figures"], rows)


def adapt_summary() -> str:
    """The proof's outcome: the held-out acceptance of the layer serving at the end against the
    starting layer and the offline refresh, the traffic, failures and the losslessness check."""
    data = load(ADAPT)
    held, offline = data["held_out"], data["offline"]
    rows = []
    for label, per_k in (("starting layer (the base model's)", held["start_layer"]),
                         ("layer serving at the end of --adapt", held["final_layer"]),
                         ("offline vllm-mtp train on the same text", offline["refreshed"])):
        rows.append([label] + [
            " / ".join(f"{a:.3f}" for a in per_k[k]["per_position"]) if k in per_k else "–"
            for k in ("1", "2", "3")])
    settings, requests, lossless = data["settings"], data["requests"], data["lossless"]
    return "\n".join([
        table(["layer (held-out C++ headers, greedy, bf16)", "k = 1", "k = 2 (per position)",
               "k = 3 (per position)"], rows), "",
        f"After {settings['minutes']:g} minutes of `--adapt` the layer serving reached "
        f"{data['ratio_to_offline_k1']:.2f}× of the offline refresh's first-position acceptance "
        f"(version {data['final_version']}; the offline layer: "
        f"{offline['train_tokens']} tokens, {offline['train_seconds'] / 60:.0f} minutes of "
        f"`vllm-mtp train`, from `{offline['file']}` at commit {str(offline['commit'])[:10]}; "
        f"the fine-tuned target is the same: held-out perplexity "
        f"{data['target']['fine_tune']['held_out_cpp_perplexity']['fine_tuned']:.4f} here, "
        f"{offline['fine_tuned_perplexity']:.4f} there). Traffic: {requests['finished']} "
        f"requests ({requests['output_tokens']} output tokens) at concurrency "
        f"{settings['concurrency']}, {requests['failed']} failed; {data['recorded_tokens']} "
        f"tokens recorded. Losslessness: {lossless['checked_near_swaps']} requests within "
        f"seconds of the {lossless['swaps']} swap(s) ({lossless['in_flight_during_a_swap']} in "
        f"flight during one) and {lossless['checked_others']} others compared with the "
        f"target's own greedy continuation: {lossless['mismatches']} differ. "
        f"{source_line(ADAPT)}"])


def adapt_ratio() -> str:
    return f"{load(ADAPT)['ratio_to_offline_k1']:.2f}×"


def adapt_minutes() -> str:
    """"20 minutes of serving on 2 CPUs": how long the proof served, and on what."""
    data = load(ADAPT)
    return f"{data['settings']['minutes']:g} minutes of serving on {data['environment']['cpus']} CPUs"
