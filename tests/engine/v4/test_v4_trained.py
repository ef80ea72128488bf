"""The shipped trained tiny DeepSeek-V4 (``tools/tiny/trained_v4.py``) in the real engine: a V4
language model whose MTP acceptance is measured, not set by construction.

vLLM runs a V4 target on this CPU in bf16 only, its V4 Triton metadata kernels through the test
harness (V1 runner here, as ``test_v4_generation.py``'s noisy test; the interpreter runs only those
kernels). Checked:

* the shipped files are what their record says, and a language model (held-out perplexity far below
  a unigram model's, an MTP layer usually right about the token after next);
* vLLM serves the model transformers trained: on vLLM's greedy continuation, transformers' own
  argmax (float32 on the same bf16 weights) is vLLM's token at almost every position;
* with our drafter, k = 1 and 3: greedy output equals k = 0's, acceptance counted by vLLM is real
  (neither ~0 nor built in) and falls with the draft position.
"""

import functools
import json

import pytest
import torch
from support.engines import engine_runner
from support.hardware import needs_v4_target

from vllm_mtp_plugin.tools.engine.mrv2 import harness_env
from vllm_mtp_plugin.tools.tiny import corpus, trained_v4

pytestmark = [pytest.mark.engine, needs_v4_target()]  # engine: starts vLLM (conftest.py)

OURS = "vllm_mtp_plugin.models.v4:DeepSeekV4MTP"
MAX_TOKENS = 32


def trained_prompts() -> list[str]:
    from importlib import resources

    text = resources.files("vllm_mtp_plugin.tools").joinpath("data/trained_prompts.jsonl").read_text()
    return [row["prompt"] for row in map(json.loads, text.splitlines())]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return trained_v4.write_checkpoint(tmp_path_factory.mktemp("trained-v4") / "model")


def v1_harness_env() -> dict:
    """V4's Triton metadata kernels through the harness, on the V1 runner."""
    env = harness_env({})
    env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    return env


@functools.cache
def run(model_dir, k: int) -> dict:
    result = engine_runner(runner="v1", eager="interpreted-v4", llm_kwargs={
        "dtype": "bfloat16", "max_model_len": 512})(
        model_dir, k, prompts=trained_prompts(), max_tokens=MAX_TOKENS, ignore_eos=True,
        env=v1_harness_env())
    assert result["runner"] == "v1"
    return result


def test_shipped_files_match_their_record():
    from safetensors import safe_open
    from transformers import AutoTokenizer

    shipped = trained_v4.shipped_dir()
    record = json.loads((shipped / "training.json").read_text())
    assert json.loads((shipped / "config.json").read_text()) == trained_v4.config_json()
    assert record["variant"] == "v4"
    assert record["settings"] == trained_v4.settings().__dict__  # the rebuild command's defaults
    assert record["corpus"]["version"] == corpus.VERSION and record["train_tokens"] > 2_000_000
    assert len(AutoTokenizer.from_pretrained(str(shipped))) == trained_v4.ARCH.vocab_size
    with safe_open(str(shipped / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert {f.get_tensor(n).dtype for n in names} <= {torch.bfloat16, torch.float32}
    assert {"mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.hc_head_fn"} <= names
    assert not {n for n in names if n.startswith("mtp.0.") and n.endswith(("tok_emb.weight",
                                                                           "head.weight"))}
    for kind in corpus.KINDS:
        metrics = record["metrics"][kind]
        assert metrics["perplexity"] < metrics["unigram_perplexity"] / 5, (kind, metrics)
        assert metrics["mtp_top1_accuracy"] > 0.25, (kind, metrics)


def test_vllm_serves_what_transformers_trained(model_dir):
    from transformers import AutoTokenizer

    from vllm_mtp_plugin.tools.mtp_layer.transformers_v4_layer import load_reference

    served = run(model_dir, 0)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    target, _ = load_reference(model_dir, 0, torch.float32)
    agree = total = 0
    for prompt, tokens in zip(trained_prompts(), served["token_ids"], strict=True):
        ids = tokenizer(prompt)["input_ids"]
        sequence = torch.tensor([ids + tokens])
        with torch.no_grad():
            argmax = target(sequence, use_cache=False).logits[0].argmax(-1)
        predicted = argmax[len(ids) - 1:-1].tolist()
        agree += sum(a == b for a, b in zip(predicted, tokens))
        total += len(tokens)
    # bf16 against float32: a near-tie may go either way; a wrong model (another checkpoint's
    # tensors, a misnamed one) agrees at a few positions only
    assert agree >= 0.9 * total, (agree, total)


@pytest.mark.parametrize("k", [1, 3])
def test_drafts_are_measured_and_greedy_output_is_unchanged(model_dir, k):
    baseline, result = run(model_dir, 0), run(model_dir, k)
    assert result["drafter"]["class"] == OURS
    assert result["token_ids"] == baseline["token_ids"]
    spec = result["spec_decode"]
    assert spec["num_draft_tokens"] == k * spec["num_drafts"] > 0
    per_position = spec["per_position_acceptance"]
    assert 0.2 < per_position[0] < 0.95, per_position  # measured, not built in
    if k == 3:  # one layer reused on its own output: later positions are accepted less often
        assert per_position[2] < per_position[0]


def test_grafted_layer_is_served_as_the_original(model_dir, tmp_path):
    """The target without its layer (as a quantizer's export leaves it) + ``vllm-mtp graft``: the
    same tokens and counters as the original checkpoint."""
    from vllm_mtp_plugin.tools.graft import graft

    bare = trained_v4.write_checkpoint(tmp_path / "bare", mtp_layers=0)
    grafted = graft(model_dir, bare, tmp_path / "grafted")["out"]
    original, result = run(model_dir, 1), run(grafted, 1)
    assert result["drafter"]["class"] == OURS
    assert result["token_ids"] == original["token_ids"]
    assert result["spec_decode"] == original["spec_decode"]
