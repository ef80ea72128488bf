"""``vllm-mtp doctor MODEL``'s advice on batch size, from a measurement on this machine.

MTP pays when the tokens a step gains outweigh what drafting and verifying add to the step; the
added cost grows with the batch (a step of c requests verifies c * (k + 1) tokens), so past some
batch size speculation loses. Two engines (``vllm-mtp tune``'s measurement, with k = 0 and 1, the
user's engine arguments) run one pass per batch size; per batch size the advice gives the
speed-up k = 1 reaches, by ``tune``'s model (the measured decode steps with the acceptance
measured on the same prompts) and as measured (output tokens/s of the two passes, noisier).
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_BATCH_SIZES = (1, 8, 32)
# A speed-up within this of 1 is neither a gain nor a loss (one pass per point).
EVEN = 0.05


def measure_batch_sizes(model: Path, prompts: list, batch_sizes: list[int], max_tokens: int,
                        engine_args: dict, timeout: float, log_dir: Path, progress=print) -> dict:
    """Per batch size: measured and modelled speed-up of k = 1 over no speculation."""
    from ..throughput.measure import TuneRun, measure
    from ..throughput.prediction import acceptance_lengths, predictions

    completions = [p for p in prompts if isinstance(p, str)]
    run = TuneRun(model=str(model), prompts=completions or prompts, concurrencies=batch_sizes,
                  max_k=1, max_tokens=max(2, max_tokens), engine_args=dict(engine_args),
                  timeout=timeout)
    log_dir.mkdir(parents=True, exist_ok=True)
    measured = measure(run, log_dir, on_start=lambda line: progress(f"batch sizes: {line}"))
    taus = acceptance_lengths(measured.counters[run.draft_sample_methods[0]], 1)
    expected = predictions(measured.points, taus, run.max_tokens)
    tok_s = {(p["k"], p["concurrency"]): p["measured_tok_s"] for p in measured.points}
    rows = []
    for c in run.concurrencies:
        model_k = expected.get(c, {})
        rows.append({
            "batch_size": c,
            "modelled_speedup": (model_k[1] / model_k[0]) if model_k.get(0) and 1 in model_k
            else None,
            "measured_speedup": (tok_s[(1, c)] / tok_s[(0, c)]) if tok_s.get((0, c)) and
            tok_s.get((1, c)) else None,
            "tok_s_without": tok_s.get((0, c)), "tok_s_k1": tok_s.get((1, c))})
    return {"rows": rows, "acceptance_length_k1": taus[1], "compilation": measured.compilation,
            "max_tokens": run.max_tokens}


def _sizes(sizes: list[int]) -> str:
    return "batch " + ", ".join(str(c) for c in sizes)


def batch_advice(batch: dict | None) -> list[str]:
    """One line: where k = 1 gains, breaks even or loses, by batch size."""
    if not batch or not batch.get("rows"):
        return []
    rows = [r for r in batch["rows"] if r["modelled_speedup"] is not None]
    if not rows:
        return []
    figures = ", ".join(
        f"batch {r['batch_size']}: {r['modelled_speedup']:.2f}x"
        + (f" (measured {r['measured_speedup']:.2f}x)" if r["measured_speedup"] else "")
        for r in rows)
    gains = [r["batch_size"] for r in rows if r["modelled_speedup"] > 1 + EVEN]
    losses = [r["batch_size"] for r in rows if r["modelled_speedup"] < 1 - EVEN]
    even = [r["batch_size"] for r in rows if r["batch_size"] not in gains + losses]
    at_even = f", about breaks even at {_sizes(even)}" if even else ""
    if gains and not losses:
        verdict = ("MTP pays at every batch size measured" if not even
                   else f"MTP pays at {_sizes(gains)}{at_even}")
    elif losses and not gains:
        where = "every batch size measured" if not even else _sizes(losses)
        verdict = (f"MTP costs more than it gains at {where} on this machine{at_even}: serve "
                   "without it at those loads, or raise acceptance first")
    elif gains and losses:
        paying = [g for g in gains if g < min(losses)]
        verdict = ((f"MTP pays up to batch {max(paying)} and " if paying else "MTP ")
                   + f"loses from batch {min(losses)}: vllm-mtp tune MODEL sets k per batch size "
                   "(Model Runner V2) or picks one k for your load; or VLLM_MTP_ADAPTIVE_K=1 "
                   "has the engine choose k (0 included) at every step")
    else:
        verdict = "MTP about breaks even at the batch sizes measured"
    return [f"batch size: k = 1 against no speculation, on this machine (tune's model from the "
            f"measured steps; acceptance length {batch['acceptance_length_k1']:.2f}): {figures}: "
            f"{verdict}"]
