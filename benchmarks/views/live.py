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
