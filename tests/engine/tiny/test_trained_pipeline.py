"""The trained tiny DeepSeek's build pipeline, end to end at a tiny scale (minutes, not an hour).

Corpus download and split, BPE tokenizer, joint training of target and MTP layer with
transformers' DeepSeek-V3 modeling, export in DeepSeek's checkpoint layout, and the files a
servable checkpoint is written from. The MTP layer's training input is checked against what vLLM
feeds the drafter (final-norm hidden state, next token's embedding zeroed at position 0).
"""

import json

import pytest
import torch

from vllm_mtp_plugin.tools.tiny import corpus, trained
from vllm_mtp_plugin.tools.tiny.pretrain import PretrainSettings, TargetWithMtp
from vllm_mtp_plugin.tools.mtp_layer.transformers_layer import transformers_config

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

TINY_RUN = PretrainSettings(steps=4, batch_size=2, seq_len=64, eval_every=2, eval_tokens=256)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("corpus")


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory, corpus_dir):
    out = tmp_path_factory.mktemp("trained")
    record = trained.rebuild(out, corpus_dir, TINY_RUN, progress=False)
    return out, record


def test_corpus_is_the_pinned_archive_split_into_prose_and_code(rebuilt):
    _, record = rebuilt
    summary = record["corpus"]
    assert (summary["package"], summary["version"], summary["license"]) == \
        ("Django", "5.2.19", "BSD-3-Clause")
    for kind in ("prose", "code"):
        train, held = summary[f"{kind}_train"], summary[f"{kind}_held_out"]
        assert train["characters"] > 4_000_000 and held["characters"] > 100_000
        assert 0.02 < held["documents"] / (train["documents"] + held["documents"]) < 0.10


def test_rebuild_writes_every_shipped_file_with_its_records(rebuilt):
    out, record = rebuilt
    for name in trained.SHIPPED_FILES:
        assert (out / name).stat().st_size > 0, name
    assert json.loads((out / "config.json").read_text()) == trained.config_json()
    assert record["settings"] == TINY_RUN.__dict__
    assert record["history"]["tokens_seen"] == 4 * 2 * 64
    assert [e["step"] for e in record["history"]["evaluations"]] == [2, 4]
    for kind in ("prose", "code"):
        metrics = record["metrics"][kind]
        assert metrics["unigram_perplexity"] > 50  # a 4096-token vocabulary on real text


def test_the_shipped_figures_are_what_the_shipped_weights_score(rebuilt, corpus_dir):
    """The held-out perplexity and MTP top-1 accuracy the docs quote (the shipped training.json)
    recomputed from the shipped bf16 weights on the held-out files, within the documented
    tolerance (``trained.REPRODUCTION_TOLERANCE``): the target through transformers, the MTP
    layer loaded from the checkpoint as ``vllm-mtp train`` loads it, the evaluation the build
    ran. A layer fed the wrong inputs, or weights that are not the ones scored, fail here."""
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    from vllm_mtp_plugin.tools.tiny.pretrain import evaluate
    from vllm_mtp_plugin.tools.mtp_layer.v3_target import open_target
    from vllm_mtp_plugin.tools.mtp_layer.trainable import initial_layer

    shipped = trained.shipped_dir()
    out, _ = rebuilt  # the pipeline's tokenizer is the shipped one, byte for byte
    assert (out / "tokenizer.json").read_bytes() == (shipped / "tokenizer.json").read_bytes()
    record = json.loads((shipped / "training.json").read_text())
    config = transformers_config(trained.config_json("float32"))
    model = TargetWithMtp(config)
    model.target = DeepseekV3ForCausalLM.from_pretrained(shipped, dtype=torch.float32)
    model.mtp = initial_layer(open_target(shipped), config, "checkpoint", 0)
    tokenizer = AutoTokenizer.from_pretrained(str(shipped))
    docs = corpus.read_documents(corpus.fetch_sdist(corpus_dir))
    settings = PretrainSettings()
    for kind in corpus.KINDS:
        held_out = trained.tokenize(tokenizer, [d for d in docs if d.held_out and d.kind == kind])
        measured = evaluate(model, held_out, settings.seq_len, settings.eval_tokens)
        quoted = record["metrics"][kind]
        assert abs(measured["perplexity"] / quoted["perplexity"] - 1) <= \
            trained.REPRODUCTION_TOLERANCE["perplexity"], (kind, measured, quoted)
        assert abs(measured["mtp_top1_accuracy"] - quoted["mtp_top1_accuracy"]) <= \
            trained.REPRODUCTION_TOLERANCE["mtp_top1_accuracy"], (kind, measured, quoted)


def test_the_tokenizer_is_a_real_bpe_with_the_chat_template(rebuilt):
    from transformers import AutoTokenizer

    out, _ = rebuilt
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert len(tokenizer) == trained.ARCH.vocab_size
    assert not any(t.startswith("<|t") for t in tokenizer.get_vocab())  # no placeholder fillers
    text = "def get_queryset(self):\n    return self.model.objects.all()"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text and len(ids) < len(text) / 2
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜>"


def test_exported_checkpoint_has_deepseeks_mtp_layout(rebuilt, tmp_path):
    from safetensors.torch import load_file

    out, _ = rebuilt
    layer = f"model.layers.{trained.ARCH.num_hidden_layers}."
    served = load_file(str(trained.write_checkpoint(tmp_path / "mtp", 1, source=out)
                           / "model.safetensors"))
    own = {k.removeprefix(layer) for k in served if k.startswith(layer)}
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
            "shared_head.head.weight", "embed_tokens.weight", "self_attn.kv_b_proj.weight",
            "mlp.gate.weight", "mlp.gate.e_score_correction_bias",
            "mlp.experts.7.down_proj.weight", "mlp.shared_experts.up_proj.weight"} <= own
    assert not any("mtp_block" in k or "gate_up_proj" in k for k in served)
    assert all(v.dtype == torch.bfloat16 for k, v in served.items() if "e_score" not in k)
    assert torch.equal(served[layer + "shared_head.head.weight"], served["lm_head.weight"])
    plain = trained.write_checkpoint(tmp_path / "plain", 0, source=out)
    without = load_file(str(plain / "model.safetensors"))
    assert set(without) == {k for k in served if not k.startswith(layer)}
    assert json.loads((plain / "config.json").read_text())["num_nextn_predict_layers"] == 0
    with pytest.raises(ValueError, match="--mtp-layers 2 is not available"):
        trained.write_checkpoint(tmp_path / "two", 2, source=out)


def test_mtp_training_input_is_what_vllm_feeds_the_drafter():
    """Position 0's embedding is zeroed and only earlier positions reach a position (causal)."""
    torch.manual_seed(0)
    config = transformers_config(trained.config_json("float32"))
    model = TargetWithMtp(config).eval()
    ids = torch.randint(3, 4096, (1, 12))
    with torch.no_grad():
        hidden = model.target.model(input_ids=ids).last_hidden_state
        base = model.mtp_hidden(hidden[:, :-1], ids[:, 1:])
        other_first = ids.clone()
        other_first[0, 1] = (ids[0, 1] + 1) % 4096  # the token embedded at position 0
        same = model.mtp_hidden(hidden[:, :-1], other_first[:, 1:])
        other_last = ids.clone()
        other_last[0, -1] = (ids[0, -1] + 1) % 4096
        later = model.mtp_hidden(hidden[:, :-1], other_last[:, 1:])
    assert torch.equal(base, same)  # position 0's token does not enter
    assert torch.allclose(base[:, :-1], later[:, :-1]) and not torch.allclose(base[:, -1], later[:, -1])


def test_a_missing_shipped_file_names_the_rebuild_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="vllm-mtp build-tiny --mode trained --rebuild"):
        trained.write_checkpoint(tmp_path / "out", 1, source=tmp_path)


def test_held_out_choice_is_stable():
    doc = corpus.Document("prose", "docs/intro/tutorial01.txt", "x")
    assert doc.held_out == corpus.Document("code", doc.path, "y").held_out
