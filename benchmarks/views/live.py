"""``vllm-mtp serve --record`` measured (``benchmarks/live_record.py``, ``results/live``): what
recording costs a server, and what each way of recording would keep."""

from __future__ import annotations

from .common import load, source_line, table

COST = "benchmarks/results/live/cost.json"
CHOICE = "benchmarks/results/live/choice.json"
# vLLM 0.32's CompilationMode, for results that stored its number
MODES = {"0": "NONE", "1": "STOCK_TORCH_COMPILE", "2": "DYNAMO_TRACE_ONCE", "3": "VLLM_COMPILE"}


def record_cost() -> str:
    """Per pair of server processes (one with ``--record``, one without, same traffic): median
    output tokens/s of the passes, and their ratio; then the ratio of the medians with its
    spread, and how much was recorded."""
    data = load(COST)
    summary, settings = data["summary"], data["settings"]
    rows = [[str(p + 1), f"{plain:.1f}", f"{record:.1f}", f"{ratio:.3f}"]
            for p, (plain, record, ratio) in enumerate(zip(
                summary["plain_tok_s"], summary["record_tok_s"],
                summary["ratio_per_process_pair"]))]
    ratios = summary["ratio_per_process_pair"]
    return "\n".join([
        table(["process pair", "without recording, tok/s", f"--record-fraction "
               f"{settings['record_fraction']:g}, tok/s", "ratio"], rows), "",
        f"With recording the server ran at {summary['ratio_median']:.3f}× of its speed without "
        f"(ratio of the medians; {min(ratios):.3f}–{max(ratios):.3f} over the {len(ratios)} "
        f"process pairs), {settings['requests']} chat requests of {settings['max_tokens']} "
        f"tokens per pass at concurrency {settings['concurrency']}, {settings['passes']} passes "
        f"per process; {summary['recorded_sequences']} of {summary['finished_requests']} "
        f"finished requests recorded; {summary['disturbed_passes']} pass(es) with other work "
        f"above 5 % of the CPUs. {source_line(COST)}"])


def record_cost_ratio() -> str:
    return f"{load(COST)['summary']['ratio_median']:.3f}×"


def record_choice() -> str:
    """Per turn of the chat traffic: how many positions each way of recording got."""
    data = load(CHOICE)
    rows = []
    for turn, row in data["turns"].items():
        own, again = row["own_passes"], row["reprefill"]
        rows.append([turn, str(row["sequences"]), str(own["positions"]),
                     f"{own['share_of_positions']:.3f} ({own['complete_sequences']})",
                     f"{again['share_of_positions']:.3f} ({again['complete_sequences']})"])
    engine, seconds = data["engine"], data["serving_s"]
    turns = data["turns"].values()
    return "\n".join([
        table(["traffic", "sequences", "positions", "own passes: share received (complete "
               "sequences)", "re-prefill: share received (complete sequences)"], rows), "",
        f"Engine: prefix caching {'on' if engine['prefix_caching'] else 'off'}, chunked prefill "
        f"{'on' if engine['chunked_prefill'] else 'off'} (as vLLM set them on this machine), "
        f"compilation {MODES.get(engine['compilation_mode'], engine['compilation_mode'])} (vLLM's "
        f"default here). Serving both turns took {seconds['without_recording']:.2f} s "
        f"without recording and {seconds['own_passes_recorded']:.2f} s recording every drafter "
        f"call; re-prefilling all {sum(r['sequences'] for r in turns)} sequences took "
        f"{data['reprefill_s']:.2f} s. {source_line(CHOICE)}"])


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
