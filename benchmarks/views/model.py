"""The trained tiny DeepSeek's held-out quality, from the record its build writes beside the
weights (``vllm_mtp_plugin/tools/data/trained/training.json``)."""

from __future__ import annotations

from .common import load, table

RECORD = "vllm_mtp_plugin/tools/data/trained/training.json"
RECORD_V4 = "vllm_mtp_plugin/tools/data/trained_v4/training.json"
REBUILD = {RECORD: "vllm-mtp build-tiny --mode trained --rebuild",
           RECORD_V4: "trained_v4.rebuild` (what `vllm-mtp build-tiny --variant v4 --mode trained "
                      "--rebuild` runs)"}


def quality_table(path: str = RECORD) -> str:
    record = load(path)
    rows = [[kind, f"{m['perplexity']:.1f}", f"{m['unigram_perplexity']:.0f}",
             f"{100 * m['mtp_top1_accuracy']:.1f} %"] for kind, m in record["metrics"].items()]
    tokens = {m["tokens"] for m in record["metrics"].values()}
    return (table(["", "perplexity", "unigram perplexity",
                   "MTP top-1 accuracy (token after next)"], rows)
            + f"\n\n{'/'.join(f'{t:,}' for t in sorted(tokens))} held-out tokens per kind. "
              f"Source: `{path}`, written by `{REBUILD[path]}`; {run_line(path)}.")


def run_line(path: str = RECORD) -> str:
    """Where the shipped record came from, or that it does not say."""
    from .common import provenance

    run = load(path).get("run") or {}
    if not run.get("recorded"):
        return ("the run that trained the shipped weights recorded no commit, date, machine or "
                "command line (`run` in the record says so; a rebuild records them)")
    return provenance(run)


def training_time(path: str = RECORD) -> str:
    """"46 minutes": how long the shipped model's training loop ran, as its record says."""
    return f"{load(path)['history']['seconds'] / 60:.0f} minutes"


def quality_sentence() -> str:
    m = load(RECORD)["metrics"]
    return (f"Held out, its perplexity is {m['prose']['perplexity']:.1f} on prose and "
            f"{m['code']['perplexity']:.1f} on code (unigram: {m['prose']['unigram_perplexity']:.0f} "
            f"and {m['code']['unigram_perplexity']:.0f}); its MTP layer predicts the token after "
            f"next right {100 * m['prose']['mtp_top1_accuracy']:.0f} % (prose) and "
            f"{100 * m['code']['mtp_top1_accuracy']:.0f} % (code) of the time")


def parameters() -> str:
    return f"{load(RECORD)['parameters'] / 1e6:.1f} M"


def size(path: str = RECORD) -> str:
    """"8.37 M parameters, 16.7 MB in bf16": the record's parameter count, two bytes each."""
    count = load(path)["parameters"]
    return f"{count / 1e6:.2f} M parameters, {2 * count / 1e6:.1f} MB in bf16"


def corpus_characters(kind: str) -> str:
    """"5.7 M characters to train on, 0.5 M held out"."""
    corpus = load(RECORD)["corpus"]
    train, held = (corpus[f"{kind}_{part}"]["characters"] / 1e6 for part in ("train", "held_out"))
    return f"{train:.1f} M characters to train on, {held:.1f} M held out"


def tokens_seen() -> str:
    """"9.8 M tokens, 3.3 passes over the 3.0 M training tokens"."""
    record = load(RECORD)
    seen, train = record["history"]["tokens_seen"], record["train_tokens"]
    return (f"{seen / 1e6:.1f} M tokens, {seen / train:.1f} passes over the {train / 1e6:.1f} M "
            f"training tokens")


def metrics_exact() -> str:
    """"perplexity 36.40 / 15.82 and MTP top-1 0.362 / 0.504 (prose / code)": the record's
    held-out figures at the precision a rebuild is compared at."""
    m = load(RECORD)["metrics"]
    return (f"perplexity {m['prose']['perplexity']:.2f} / {m['code']['perplexity']:.2f} and MTP "
            f"top-1 {m['prose']['mtp_top1_accuracy']:.3f} / {m['code']['mtp_top1_accuracy']:.3f} "
            f"(prose / code)")
