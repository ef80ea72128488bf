"""``vllm-mtp train``'s proofs (``benchmarks/results/training``): acceptance per position of each
served layer, with 95 % intervals, and comparisons that say "within noise" unless they separate."""

from __future__ import annotations

from fractions import Fraction
from math import lcm

from vllm_mtp_plugin.tools.stats import comparison, wilson

from .common import load, table

TRAINING = "benchmarks/results/training"
TOKENS_PER_PROMPT = 64
HELD_OUT_PROMPTS = {"graft": 8, "recursive": 8, "foreign": 8, "refresh": 12, "loss": 8, "v4": 8}
LAYERS = {
    "graft": [("untrained (the initial layer)", "untrained_initial_layer"),
              ("jointly trained with the target (shipped)", "jointly_trained"),
              ("trained by `vllm-mtp train` from scratch", "trained_from_scratch")],
    "recursive": [("depth 1", "depth1"), ("depth 3, recursive", "depth3_recursive")],
    "v4": [("jointly trained with the V4 target (shipped)", "jointly_trained"),
           ("trained by `vllm-mtp train` from scratch", "trained_from_scratch")],
    "refresh": [("base target + its layer", "base_on_cpp"),
                ("fine-tuned target + old layer", "fine_tuned_old_layer_on_cpp"),
                ("fine-tuned target + refreshed layer", "fine_tuned_refreshed_on_cpp")],
}


def file(proof: str) -> str:
    return f"{TRAINING}/{proof}.json"


def drafts(proof: str, figures: dict) -> tuple[int, bool]:
    """Drafts behind one k's figures: stored by newer runs; for older ones the count that makes
    every per-position rate a whole number of accepted drafts, nearest to generated tokens /
    acceptance length (True when so recovered)."""
    if figures.get("num_drafts"):
        return int(figures["num_drafts"]), False
    estimate = HELD_OUT_PROMPTS[proof] * TOKENS_PER_PROMPT / figures["acceptance_length"]
    step = lcm(*(Fraction(p).limit_denominator(2000).denominator for p in figures["per_position"]))
    return max(step, round(estimate / step) * step), True


def interval(proof: str, figures: dict, position: int) -> tuple[float, float]:
    n, _ = drafts(proof, figures)
    return wilson(figures["per_position"][position] * n, n)


def _cell(proof: str, figures: dict | None) -> str:
    if not figures:
        return ""
    return " / ".join(f"{p:.3f} [{low:.2f}–{high:.2f}]" for p, (low, high) in
                      ((p, interval(proof, figures, i)) for i, p in enumerate(figures["per_position"])))


def _run_line(proof: str) -> str:
    data = load(file(proof))
    run = data.get("run")
    if run:
        from .common import provenance
        return f"Source: `{file(proof)}`: {provenance(run)}."
    if "stopped_at_step" in data.get("train", {}):
        return (f"Source: `{file(proof)}`: {data['date']}, {data['machine']}. **Not reproduced by "
                f"a repo command**: that run was stopped at training step "
                f"{data['train']['stopped_at_step']} of {data['train']['of_steps']} and its layer "
                f"exported by hand; `python benchmarks/train_proofs.py {proof}` runs it in full.")
    return (f"Source: `{file(proof)}`: {data['date']}, {data['machine']}; written by "
            f"`python benchmarks/train_proofs.py {proof}` before results recorded their commit.")


def proof_table(proof: str) -> str:
    """One proof's layers at k = 1, 2, 3: per position [95 % interval], acceptance length at 3."""
    data, rows, recovered = load(file(proof)), [], False
    for label, key in LAYERS[proof]:
        per_k = data[key]
        cells = [_cell(proof, per_k.get(str(k))) for k in (1, 2, 3)]
        length = per_k.get("3", {}).get("acceptance_length")
        rows.append([label, *cells, "" if length is None else f"{length:.2f}",
                     " / ".join(str(drafts(proof, per_k[str(k)])[0]) for k in (1, 2, 3)
                                if str(k) in per_k)])
        recovered |= any(drafts(proof, f)[1] for f in per_k.values())
    text = table(["layer", "k = 1", "k = 2", "k = 3", "acceptance length at k = 3",
                  "drafts k = 1 / 2 / 3"], rows)
    note = (" Drafts were not stored by this run: counted back from the rates and the tokens "
            "generated." if recovered else "")
    return (f"{text}\n\nPer position with its 95 % Wilson interval.{note} {_run_line(proof)}")


def compare(proof: str, a: str, b: str, k: int, position: int) -> str:
    """"higher" / "lower" / "within noise": layer a against layer b at one k and position."""
    data = load(file(proof))
    return comparison(interval(proof, data[a][str(k)], position),
                      interval(proof, data[b][str(k)], position))


def refresh_perplexity() -> str:
    """"491 → 14.5": the target's held-out C++ perplexity before and after its fine-tuning."""
    ppl = load(file("refresh"))["fine_tune"]["held_out_cpp_perplexity"]
    return f"{ppl['base']:.0f} → {ppl['fine_tuned']:.1f}"


def refresh_training() -> str:
    """"3,328 sequences, 617,362 tokens; 1,186 steps, held-out agreement 0.80": the refresh's
    collection and training as ``vllm-mtp train`` recorded them."""
    train = load(file("refresh"))["train"]
    held = train["held_out"]
    return (f"{train['sequences']:,} sequences, {train['tokens']:,} tokens; {held['step']:,} steps, "
            f"held-out agreement {held['accuracy'][0]:.2f} at the end")


LOSS_SERVINGS = (("t0_greedy", "0", "greedy"), ("t1_greedy", "1", "greedy"),
                 ("t1_probabilistic", "1", "probabilistic"))


def loss_table() -> str:
    """KL- against CE-trained layer at k = 2: greedy, and sampled with either draft method."""
    data, rows = load(file("loss")), []
    for name, label in (("kl", "`--loss kl` (default)"), ("ce", "`--loss ce`")):
        for key, temperature, method in LOSS_SERVINGS:
            figures = data[name][key]["2"]
            rows.append([label, temperature, method, str(drafts("loss", figures)[0]),
                         _cell("loss", figures), f"{figures['acceptance_length']:.2f}"])
            label = ""
        held = data[f"train_{name}"]["held_out"]
        rows[-len(LOSS_SERVINGS)][0] += f" (held-out agreement {held['accuracy'][0]:.2f})"
    text = table(["layer", "T", "draft method", "drafts counted", "position 1 / 2 [95 %]",
                  "acceptance length"], rows)
    return (f"{text}\n\nk = 2; sampled rows: each held-out prompt 4 times, seeded. {_run_line('loss')}")


def loss_compare(serving: str) -> str:
    """"higher" / "lower" / "within noise": the KL-trained layer's first position against the
    CE-trained one's, served one way (``LOSS_SERVINGS``)."""
    data = load(file("loss"))
    return comparison(interval("loss", data["kl"][serving]["2"], 0),
                      interval("loss", data["ce"][serving]["2"], 0))


def default_run() -> str:
    """"1,152 sequences, 151,611 tokens; 411 steps": what ``vllm-mtp train``'s defaults collected
    and trained on in proof (a), as it recorded them."""
    train = load(file("graft"))["train"]
    return (f"{train['sequences']:,} sequences, {train['tokens']:,} tokens; "
            f"{train['held_out']['step']:,} steps")


def seconds(proof: str, key: str = "train") -> str:
    """"254 s": collection and training of one proof's ``vllm-mtp train`` run, end to end."""
    return f"{load(file(proof))[key]['seconds']:,} s"


def foreign_vs_graft() -> str:
    """How the layer trained on transformers' re-save of the target served against proof (a)'s
    (same weights, same seeded training): "the same acceptance as (a) to the last digit (...)" or
    the positions where they differ."""
    foreign, graft = load(file("foreign"))["trained"], load(file("graft"))["trained_from_scratch"]
    at3 = " / ".join(f"{p:.3f}" for p in foreign["3"]["per_position"])
    differ = [f"k = {k} position {i + 1}: {a:.3f} against {b:.3f}"
              for k in ("1", "2", "3")
              for i, (a, b) in enumerate(zip(foreign[k]["per_position"],
                                             graft[k]["per_position"])) if a != b]
    if not differ:
        return f"the same acceptance as (a) to the last digit ({at3} at k = 3)"
    return f"acceptance {at3} at k = 3, not (a)'s to the digit ({'; '.join(differ)})"


def ratio(proof: str, a: str, b: str, k: int = 1) -> str:
    """"0.93x (0.61 against 0.66)": layer a's first-position acceptance over layer b's at k."""
    data = load(file(proof))
    first_a, first_b = (data[key][str(k)]["per_position"][0] for key in (a, b))
    return f"{first_a / first_b:.2f}× ({first_a:.2f} against {first_b:.2f})"
