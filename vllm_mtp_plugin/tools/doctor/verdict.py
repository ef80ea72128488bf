"""From the measurements to a verdict: is low acceptance the layer's, the serving stack's, or none.

Two figures count the same thing on the same text (the target's greedy continuation of the same
prompts): the served acceptance at k = 1 (vLLM's counters) and the layer's own top-1 agreement
computed outside vLLM from the checkpoint's files (``mtp_layer/evaluation.py``). A healthy setup
gives the two within noise of each other; served acceptance far below the layer's own agreement is
a serving problem; a layer that does not agree with its target even on its own is the layer's.

* ``not-mtp``: no DeepSeek MTP layer where one belongs (none, or another drafter format);
* ``refused``: the start-up check refuses the layer (its message says what to fix);
* ``serving-mismatch``: the served drafts accepted less often than the layer's own drafts on the
  same positions of the same text (``paired.py``: a drop of ``SERVING_DROP`` or more, its interval
  above 0; sized to tell a drop of ``DETECTABLE_DROP``, 0.05 of first-position acceptance). Where
  too few drafts pair (an engine without vLLM's per-request draft records, texts that part), the
  two rates are compared unpaired: served acceptance below the layer's own agreement, their 95 %
  intervals apart, and either far below (under ``SERVING_RATIO`` of it and ``MIN_GAP`` less) or
  with the served layer's output away from the files' layer's (``OUTPUT_DISTANCE``);
* ``layer-mismatch``: the layer's own agreement below ``LAYER_MIN_AGREEMENT``;
* ``healthy``: neither;
* ``undetermined``: no reference could be computed, or an engine failed (the reason is given).
"""

from __future__ import annotations

from .paired import tells_a_serving_drop

VERDICTS = ("healthy", "serving-mismatch", "layer-mismatch", "not-mtp", "refused", "undetermined")
# Below this first-draft agreement a layer does not fit its target: matched DeepSeek layers accept
# 0.8-0.9 (DeepSeek-V3 technical report, section 5.4.3: 85-90 %), the tiny trained one 0.7-0.8.
LAYER_MIN_AGREEMENT = 0.5
SERVING_RATIO = 0.8
MIN_GAP = 0.1  # two low figures (a layer that fits nothing) differ by little, whatever the ratio
# A served layer output this far (relative L2) from the files' layer is computed differently
# (bf16 serving against a float32 reference stays below ~0.05).
OUTPUT_DISTANCE = 0.1


def decide(kind: str, problems: list[str], probe: dict | None, reference: dict | None,
           eager: dict | None, inspect: dict | None = None, reason: str = "") -> dict:
    """``{"verdict", "reasons", "causes", "next"}``; ``probe`` and ``eager``: counters with
    ``acceptance`` and ``interval``; ``reference``: ``reference.evaluate``'s figures."""
    if kind != "mtp":
        what = "a DSpark drafter" if kind == "dspark" else "no MTP layer"
        return {"verdict": "not-mtp", "reasons": [f"the checkpoint holds {what}", *problems],
                "causes": [], "next": ["serve it with the speculative method its drafter needs"
                                       if kind == "dspark" else
                                       "give it a layer: vllm-mtp train MODEL (a new layer) or "
                                       "vllm-mtp graft SOURCE MODEL (from a sibling checkpoint)"]}
    if problems:
        return {"verdict": "refused", "reasons": problems, "causes": [],
                "next": ["fix what the start-up check names, then run vllm-mtp doctor again"]}
    if probe is None or reference is None or probe["acceptance"] is None \
            or reference["agreement"][0] is None:
        why = reason or ("the served probe made no drafts" if probe and probe["acceptance"] is None
                         else "no reference figure")
        return {"verdict": "undetermined", "reasons": [why], "causes": [], "next": []}
    own, own_ci = reference["agreement"][0], reference["agreement_interval"]
    served, served_ci = probe["acceptance"], probe["interval"]
    figures = (f"served acceptance {served:.3f} [{served_ci[0]:.3f}, {served_ci[1]:.3f}] at k = 1 "
               f"over {probe['drafts']:.0f} drafts; the layer's own agreement {own:.3f} "
               f"[{own_ci[0]:.3f}, {own_ci[1]:.3f}] over {reference['positions']} positions")
    paired = probe.get("paired")
    told = tells_a_serving_drop(paired)
    if told is None:
        apart = served_ci[1] < own_ci[0]
        far_below = served < SERVING_RATIO * own and own - served > MIN_GAP and apart
        out = reference.get("served_output")
        told = far_below or (out is not None and out["relative_distance"] > OUTPUT_DISTANCE
                             and apart)
    else:
        low, high = paired["drop_interval"]
        figures += (f"; on the same {paired['pairs']} positions the served drafts were accepted "
                    f"{paired['served']:.3f} and the layer's own {paired['own']:.3f}: a serving "
                    f"drop of {paired['drop']:.3f} [{low:.3f}, {high:.3f}]")
    if told:
        return {"verdict": "serving-mismatch", "reasons": [figures],
                "causes": serving_causes(reference, eager, probe, inspect),
                "next": ["the layer is fine: the serving stack loads or runs it wrong (causes "
                         "above); report it with this JSON"]}
    if own < LAYER_MIN_AGREEMENT:
        return {"verdict": "layer-mismatch", "reasons": [
            figures + f"; below {LAYER_MIN_AGREEMENT} the layer does not fit this target"],
            "causes": ["the target changed after the layer was trained (fine-tuned, converted "
                       "or quantized target), or the layer belongs to another model"],
            "next": ["vllm-mtp train MODEL --init checkpoint --prompts YOUR_TRAFFIC (refresh the "
                     "layer on this target)", "or vllm-mtp graft ORIGINAL MODEL (the original "
                     "checkpoint's layer)"]}
    return {"verdict": "healthy", "reasons": [figures + ": served as the layer predicts"],
            "causes": [], "next": []}


def serving_causes(reference: dict, eager: dict | None, probe: dict,
                   inspect: dict | None) -> list[str]:
    """What the measurements say about where the served drafts go wrong."""
    causes = []
    own = reference["agreement"][0]
    out = reference.get("served_output")
    if out is not None:
        if out["relative_distance"] > OUTPUT_DISTANCE or out["agreement"] < SERVING_RATIO * own:
            causes.append(
                f"the served layer computes something else than the files' layer (relative "
                f"distance {out['relative_distance']:.3f}, its drafts agree {out['agreement']:.3f} "
                f"vs {own:.3f}): a loading problem - norms (enorm/hnorm, shared_head.norm), the "
                "layer index (num_hidden_layers), the quantization of the layer's linears, a "
                "rotation")
        else:
            causes.append(
                f"the served layer computes what the files say (relative distance "
                f"{out['relative_distance']:.3f}, its output drafts {out['agreement']:.3f} through "
                "the target's head), yet the served drafts are rejected: the head or embedding the "
                "drafter shares with the target, or how the runner uses the drafts")
    if eager is not None and eager.get("interval") and not eager["interval"][1] < \
            reference["agreement_interval"][0]:
        causes.append(
            f"an eager engine without prefix caching or chunked prefill (the reference's own) "
            f"served acceptance {eager['acceptance']:.3f}: the fault comes with the probe's engine "
            "settings (compilation or graphs, prefix caching, chunked prefill, your engine "
            "arguments)")
    if inspect:
        for layer, info in (inspect.get("layers") or {}).items():
            if info.get("quantized"):
                causes.append(f"MTP layer {layer} stores {info['quantized']} linears quantized: "
                              "check the scales the loader pairs with them")
    return causes


def advice(reference: dict | None, probe: dict | None) -> list[str]:
    """k and temperature, from what the reference measured."""
    if reference is None:
        return []
    from ..mtp_layer.evaluation import expected_tokens_per_step

    tokens = expected_tokens_per_step(reference["accepted_by_k"])
    lines = ["k: tokens per step with k drafts, measured on your prompts: " + ", ".join(
        f"k = {k + 1}: {t:.2f}" for k, t in enumerate(tokens) if t is not None)
        + "; a step with k drafts costs more than a plain one, by how much depends on your "
          "hardware and batch size: vllm-mtp tune MODEL measures which k pays there, or "
          "VLLM_MTP_ADAPTIVE_K=1 has the engine choose k at every step while it serves"]
    sampled = reference["sampled"]
    if sampled["greedy_drafts"] is not None:
        greedy, prob = sampled["greedy_drafts"], sampled["probabilistic_drafts"]
        better = "probabilistic" if prob > greedy + 0.02 else "greedy"
        lines.append(f"temperature: sampling at T = {sampled['temperature']:g} on the greedy "
                     f"continuations, the first draft would be accepted {greedy:.2f} of the time "
                     f"with greedy drafts (vLLM's default) and {prob:.2f} with probabilistic "
                     "drafts (sampled text is less predictable: served figures come out lower, "
                     f'the order holds): for sampled traffic set "draft_sample_method": "{better}"')
    return lines
