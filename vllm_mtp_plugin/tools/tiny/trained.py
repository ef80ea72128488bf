"""The trained tiny DeepSeek: a real language model whose MTP acceptance is measured, not built in.

``rebuild`` makes it from scratch (corpus -> BPE tokenizer -> joint training of target and MTP
layer -> DeepSeek-V3 checkpoint), writing ``model.safetensors`` (bf16, without the per-layer copies
of the embedding and head), ``config.json``, the tokenizer files, ``training.json`` (corpus,
settings, held-out metrics, the loss history) and ``loss.png``. Those files ship with the package
(``tools/data/trained``); ``write_checkpoint`` turns them into a servable checkpoint in seconds.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from importlib import resources
from pathlib import Path

import torch

from . import corpus
from ..mtp_layer.transformers_layer import transformers_config
from .pretrain import PretrainSettings, train
from .tokenizer import BOS, EOS, write_tokenizer
from .v3 import TinyArch, hf_config

ARCH = TinyArch(vocab_size=4096, hidden_size=256, intermediate_size=704, moe_intermediate_size=128,
                num_hidden_layers=4, num_nextn_predict_layers=1, num_attention_heads=4,
                q_lora_rank=None, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                first_k_dense_replace=1, max_position_embeddings=2048)
# DeepSeek-V3's router: sigmoid scores, grouped top-k (here 2 groups, 1 kept), scaled weights.
ROUTER = {"n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5}
SHIPPED_FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
                 "training.json", "loss.png")


# How close a rebuild with the shipped settings must come to the shipped record: relative for
# perplexity, absolute for MTP top-1 accuracy. On the machine kind that trained it (torch
# 2.13.0+cpu, 2 threads, x86-64 with AVX-512/AMX) the rebuild is bit-identical; other CPUs sum in
# another order, which the margins allow for.
REPRODUCTION_TOLERANCE = {"perplexity": 0.03, "mtp_top1_accuracy": 0.01}


def reproduction_report(record: dict, shipped: dict | None = None) -> list[tuple[str, bool]]:
    """Each held-out metric of ``record`` against the shipped one: ``(line, within tolerance)``."""
    if shipped is None:
        shipped = json.loads((shipped_dir() / "training.json").read_text())
    lines = []
    for kind, ours in record["metrics"].items():
        theirs = shipped["metrics"][kind]
        ppl = abs(ours["perplexity"] - theirs["perplexity"]) / theirs["perplexity"]
        top1 = abs(ours["mtp_top1_accuracy"] - theirs["mtp_top1_accuracy"])
        ok = (ppl <= REPRODUCTION_TOLERANCE["perplexity"]
              and top1 <= REPRODUCTION_TOLERANCE["mtp_top1_accuracy"])
        lines.append((f"{kind}: perplexity {ours['perplexity']:.2f} vs shipped "
                      f"{theirs['perplexity']:.2f} ({ppl:.1%}), MTP top-1 "
                      f"{ours['mtp_top1_accuracy']:.3f} vs {theirs['mtp_top1_accuracy']:.3f}", ok))
    return lines


def shipped_dir() -> Path:
    return Path(str(resources.files("vllm_mtp_plugin.tools").joinpath("data/trained")))


def config_json(dtype: str = "bfloat16", mtp_layers: int = 1) -> dict:
    config = hf_config(ARCH, dtype)
    config.update(ROUTER, num_nextn_predict_layers=mtp_layers)
    return config


def tokenize(tokenizer, docs: list[corpus.Document]) -> torch.Tensor:
    """One stream: each document as BOS + text + EOS."""
    bos, eos = tokenizer.convert_tokens_to_ids([BOS, EOS])
    ids: list[int] = []
    for doc in docs:
        ids += [bos, *tokenizer(doc.text, add_special_tokens=False)["input_ids"], eos]
    return torch.tensor(ids, dtype=torch.long)


def unigram_perplexity(train_tokens: torch.Tensor, tokens: torch.Tensor, vocab: int) -> float:
    """Perplexity of ``tokens`` under the train set's token frequencies (add-one smoothed)."""
    counts = torch.bincount(train_tokens, minlength=vocab).double() + 1
    logp = (counts / counts.sum()).log()
    return math.exp(-logp[tokens].mean().item())


def rebuild(out_dir: Path, cache_dir: Path, settings: PretrainSettings | None = None,
            progress: bool = True) -> dict:
    """Train the model from scratch into ``out_dir`` (the shipped files); returns training.json."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from ..provenance import environment, portable
    from .export import checkpoint_tensors

    run = {"recorded": True, **environment()}  # the code, command and machine, as training starts
    settings = settings or PretrainSettings()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    docs = corpus.read_documents(corpus.fetch_sdist(cache_dir))
    train_docs = [d for d in docs if not d.held_out]
    random.Random(settings.seed).shuffle(train_docs)
    write_tokenizer(out_dir, ARCH.vocab_size, (d.text for d in train_docs))
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    train_tokens = tokenize(tokenizer, train_docs)
    held_out = {kind: tokenize(tokenizer, [d for d in docs if d.held_out and d.kind == kind])
                for kind in corpus.KINDS}
    config = config_json("float32")
    model, history = train(transformers_config(config), train_tokens, held_out, settings, progress)
    save_file(checkpoint_tensors(model, torch.bfloat16), str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config_json(), indent=2))
    final = history["evaluations"][-1]
    record = {
        "run": portable(run),
        "corpus": corpus.summary(docs),
        "train_tokens": train_tokens.numel(),
        "held_out_tokens": {k: v.numel() for k, v in held_out.items()},
        "settings": settings.__dict__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "metrics": {kind: {**final[kind], "unigram_perplexity": unigram_perplexity(
            train_tokens, held_out[kind], ARCH.vocab_size)} for kind in corpus.KINDS},
        "history": history,
    }
    (out_dir / "training.json").write_text(json.dumps(record, indent=1))
    plot_training(record, out_dir / "loss.png")
    return record


def plot_training(record: dict, path: Path) -> None:
    """Training loss (target and MTP) and held-out MTP accuracy per kind, against the step."""
    from ..plotting import pyplot

    plt = pyplot(path)
    if plt is None:
        return

    history = record["history"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    smooth = max(1, len(history["step"]) // 100)

    def smoothed(values):
        return [sum(values[i:i + smooth]) / len(values[i:i + smooth])
                for i in range(0, len(values), smooth)]

    steps = history["step"][::smooth]
    left.plot(steps, smoothed(history["main"]), label="target (next token)")
    left.plot(steps, smoothed(history["mtp"]), label="MTP layer (token after next)")
    left.set(xlabel="step", ylabel="cross-entropy (train)", title="Training loss")
    left.legend()
    for kind in corpus.KINDS:
        evals = history["evaluations"]
        right.plot([e["step"] for e in evals], [e[kind]["mtp_top1_accuracy"] for e in evals],
                   marker="o", label=f"{kind}, held out")
    right.set(xlabel="step", ylabel="top-1 accuracy", title="MTP layer, depth 1")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_checkpoint(out_dir: Path, mtp_layers: int = 1, source: Path | None = None) -> Path:
    """A servable checkpoint from the shipped (or ``source``) files: with its MTP layer, or with
    ``mtp_layers=0`` the same target alone (what a graft starts from)."""
    from safetensors.torch import load_file, save_file

    from .export import shared_copies

    if mtp_layers not in (0, 1):
        raise ValueError(f"the trained tiny model has one MTP layer; --mtp-layers {mtp_layers} "
                         "is not available (use 0 or 1)")
    source = Path(source or shipped_dir())
    missing = [f for f in SHIPPED_FILES if not (source / f).exists()]
    if missing:
        raise FileNotFoundError(f"{source} lacks {', '.join(missing)}: rebuild it with "
                                "`vllm-mtp build-tiny --mode trained --rebuild DIR`")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(source / "model.safetensors"))
    mtp_prefix = f"model.layers.{ARCH.num_hidden_layers}."
    if mtp_layers:
        tensors.update(shared_copies(tensors, ARCH.num_hidden_layers))
    else:
        tensors = {k: v for k, v in tensors.items() if not k.startswith(mtp_prefix)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config_json(mtp_layers=mtp_layers), indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "training.json"):
        shutil.copy(source / name, out / name)
    return out

