"""The trained tiny DeepSeek-V4: a V4 language model and its MTP layer trained together on the
trained tiny DeepSeek's corpus and tokenizer, so that V4 acceptance is measured on language.

The architecture is the tiny V4 checkpoints' (``v4.py``: hyper-connections, V4 attention with its
sink, MoE with a biased ``sqrtsoftplus`` router, as vLLM's CPU kernels take them), with the trained
V3's vocabulary. The model is transformers' ``DeepseekV4ForCausalLM`` and the MTP layer the
reference layer ``mtp_layer/transformers_v4_layer.V4MtpLayer``, which computes what the plugin
serves: it reads the target's residual before ``hc_head`` at position i and token i+1 (embedding
zeroed at position 0) and predicts token i+2 through ``hc_head``, its norm and the target's head.
Objective: ``CE(main) + λ·CE(MTP)`` (``pretrain.py``, as for V3).

The checkpoint is written in DeepSeek's own names (``layers.{i}.*``, ``mtp.0.*``): each name of
the tiny V4 layout is read back from transformers' module through transformers' own V4 renaming
(the rules it loads DeepSeek's files with), and encoded by ``v4.encode``: bf16, or the V4-Flash
format (FP8 linears, FP4 experts with UE8M0 scales).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..mtp_layer import transformers_v4_layer as reference
from .v4 import TinyV4Arch, build_tensors, encode, hf_config

# The trained V3's vocabulary (its tokenizer is reused); half the experts' width of the built
# checkpoints, so that the files stay small (64 experts: vLLM's CPU router needs 64 or more).
ARCH = TinyV4Arch(vocab_size=4096, moe_intermediate_size=64)


def config_json(quantization: str | None = None, expert_dtype: str = "fp4") -> dict:
    return hf_config(ARCH, quantization, expert_dtype)


class TargetWithV4Mtp(torch.nn.Module):
    """transformers' V4 target and one V4 MTP layer (``pretrain.train``'s ``model_cls``)."""

    def __init__(self, raw_config: dict):
        super().__init__()
        from transformers.models.deepseek_v4 import DeepseekV4Config, DeepseekV4ForCausalLM

        config = DeepseekV4Config.from_dict(raw_config)
        self.target = DeepseekV4ForCausalLM(config)
        layer_index = config.num_hidden_layers
        block = reference.config_for_block(raw_config, layer_index)
        for kind in ("_attn_implementation", "_experts_implementation"):
            setattr(block, kind, getattr(self.target.config, kind, None))
        self.mtp = reference.V4MtpLayer(block, layer_index)
        self.mtp.apply(self.target._init_weights)  # fused expert tensors are created empty
        self.config = config

    def logits(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's logits for t_{i+1} and the MTP layer's for t_{i+2}."""
        with reference.residual_before_hc_head(self.target) as caught:
            main = self.target(input_ids=ids, use_cache=False).logits
        batch, length = ids.shape
        positions = torch.arange(length - 2, device=ids.device).expand(batch, -1)
        streams = reference.layer_streams(self.target, self.mtp, caught["hidden"][:, :-2],
                                          ids[:, 1:-1], positions)
        return main[:, :-1], reference.streams_logits(self.target, self.mtp, streams)


def checkpoint_tensors(model: TargetWithV4Mtp) -> dict[str, tuple[torch.Tensor, str]]:
    """``{DeepSeek name: (float32 tensor, kind)}`` of the trained model: every name of the tiny V4
    layout (``v4.build_tensors``), its value read from the module that transformers' V4 renaming
    loads it into (experts sliced from transformers' fused tensors)."""
    target = {("" if k.startswith("lm_head.") else "model.") + k.removeprefix("model."): v
              for k, v in model.target.state_dict().items()}
    out = reference.layer_tensors(model.mtp, config_json())
    layout, _ = build_tensors(ARCH, "random", 0)
    for name, (_, kind) in layout.items():
        if not name.startswith("mtp."):
            renamed = reference.transformers_name(name)
            key = renamed if renamed.startswith("lm_head.") else "model." + renamed
            value = reference.unfused(target[key], name, ARCH.moe_intermediate_size)
            out[name] = (value.detach().float(), kind)
    if set(out) != set(layout):
        raise KeyError(f"the trained model's tensors differ from the tiny V4 layout: "
                       f"{sorted(set(out) ^ set(layout))[:5]}")
    return out


def save_checkpoint(model: TargetWithV4Mtp, out_dir: Path) -> Path:
    """model.safetensors (bf16) + config.json of the trained model in DeepSeek's V4 layout."""
    return write_tensors(checkpoint_tensors(model), out_dir)


def write_tensors(tensors: dict[str, tuple[torch.Tensor, str]], out_dir: Path,
                  quantization: str | None = None, mtp_layers: int = 1) -> Path:
    """``{name: (tensor, kind)}`` encoded (``v4.encode``) into model.safetensors, with config.json
    (``mtp_layers=0``: without ``mtp.0.*``, what a V4 ``train`` or ``graft`` starts from)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not mtp_layers:
        tensors = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    save_file(encode(tensors, quantization, "fp4"), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = config_json(quantization)
    config["num_nextn_predict_layers"] = mtp_layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out

def settings(steps: int | None = None):
    """The V4 run: sequences of 128 tokens (a V4 step costs about three V3 steps here), 1,800
    steps (about 3.7 M tokens)."""
    from .pretrain import PretrainSettings

    return PretrainSettings(seq_len=128, steps=1800 if steps is None else steps, eval_every=300)


def rebuild(out_dir: Path, cache_dir: Path, run_settings=None, progress: bool = True) -> dict:
    """Train the V4 model from scratch into ``out_dir`` (bf16 checkpoint, the trained V3's
    tokenizer, training.json, loss.png); returns training.json's record."""
    import random
    import shutil

    from transformers import AutoTokenizer

    from ..provenance import environment, portable
    from . import corpus, trained
    from .pretrain import train

    run = {"recorded": True, **environment()}
    run_settings = run_settings or settings()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(trained.shipped_dir() / name, out / name)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    docs = corpus.read_documents(corpus.fetch_sdist(cache_dir))
    train_docs = [d for d in docs if not d.held_out]
    random.Random(run_settings.seed).shuffle(train_docs)
    train_tokens = trained.tokenize(tokenizer, train_docs)
    held_out = {kind: trained.tokenize(tokenizer, [d for d in docs
                                                   if d.held_out and d.kind == kind])
                for kind in corpus.KINDS}
    model, history = train(config_json(), train_tokens, held_out, run_settings, progress,
                           model_cls=TargetWithV4Mtp)
    save_checkpoint(model.eval(), out)
    final = history["evaluations"][-1]
    record = {
        "run": portable(run),
        "variant": "v4",
        "corpus": corpus.summary(docs),
        "train_tokens": train_tokens.numel(),
        "held_out_tokens": {k: v.numel() for k, v in held_out.items()},
        "settings": run_settings.__dict__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "metrics": {kind: {**final[kind], "unigram_perplexity": trained.unigram_perplexity(
            train_tokens, held_out[kind], ARCH.vocab_size)} for kind in corpus.KINDS},
        "history": history,
    }
    (out / "training.json").write_text(json.dumps(record, indent=1))
    trained.plot_training(record, out / "loss.png")
    return record


SHIPPED_FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
                 "training.json", "loss.png")


def shipped_dir() -> Path:
    from importlib import resources

    return Path(str(resources.files("vllm_mtp_plugin.tools").joinpath("data/trained_v4")))


def write_checkpoint(out_dir: Path, mtp_layers: int = 1, quantization: str | None = None,
                     source: Path | None = None) -> Path:
    """A servable V4 checkpoint from the shipped (or ``source``) bf16 files: with its MTP layer or
    (``mtp_layers=0``) without; ``quantization="fp8"``: re-encoded in the V4-Flash format (FP8
    linears with UE8M0 block scales, FP4 experts), which vLLM's CPU kernels serve on AMX only."""
    import shutil

    from safetensors.torch import load_file

    if mtp_layers not in (0, 1):
        raise ValueError(f"the trained tiny V4 has one MTP layer; --mtp-layers {mtp_layers} is "
                         "not available (use 0 or 1)")
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization {quantization!r}: None (bf16) or 'fp8' (V4-Flash format)")
    source = Path(source or shipped_dir())
    missing = [f for f in SHIPPED_FILES if not (source / f).exists()]
    if missing:
        raise FileNotFoundError(f"{source} lacks {', '.join(missing)}: rebuild it with "
                                "`vllm-mtp build-tiny DIR --variant v4 --mode trained --rebuild`")
    stored = load_file(str(source / "model.safetensors"))
    layout, _ = build_tensors(ARCH, "random", 0)
    tensors = {name: (stored[name].float(), kind) for name, (_, kind) in layout.items()}
    out = write_tensors(tensors, out_dir, quantization, mtp_layers)
    for name in ("tokenizer.json", "tokenizer_config.json", "training.json"):
        shutil.copy(source / name, out / name)
    return out
