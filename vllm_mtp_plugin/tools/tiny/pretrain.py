"""Train a small DeepSeek-V3 language model and its MTP layer together, as DeepSeek-V3 did.

The model is Hugging Face transformers' ``DeepseekV3ForCausalLM`` (MLA, dense and MoE layers,
sigmoid router with ``e_score_correction_bias`` and grouped top-k) and its generic ``MtpLayer``
(``enorm``/``hnorm``/``eh_proj``, a DeepSeek decoder block, a post norm that serves as
``shared_head.norm``). Objective (DeepSeek-V3 report §2.2, D = 1): ``CE(main) + λ·CE(MTP)``.

The MTP layer sees exactly what vLLM feeds the drafter while serving (``models/v3.py``): the
target's hidden state after its final norm at position i, the embedding of token i+1 (zeroed at
position 0), rotary position i; it predicts token i+2 through the target's head.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch
import torch.nn.functional as F

from ..mtp_layer.optim import ExpertLoadBalancer, OptimizerSettings, learning_rate


@dataclasses.dataclass
class PretrainSettings(OptimizerSettings):
    """The shipped model's run: ~9.8 M tokens (about 3 passes over the corpus), about 45 minutes
    on a 2-core CPU (``vllm-mtp train``'s ``OptimizerSettings`` with these defaults)."""

    batch_size: int = 16
    learning_rate: float = 3e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    eval_every: int = 250
    steps: int = 2400
    seq_len: int = 256
    mtp_weight: float = 0.3  # λ of DeepSeek-V3's MTP loss (0.3 early in its training)
    eval_tokens: int = 16384  # held-out tokens per kind for the periodic evaluation


class TargetWithMtp(torch.nn.Module):
    """The target and one MTP layer; ``logits`` is what the objective (``losses``) reads."""

    def __init__(self, config):
        super().__init__()
        from transformers import DeepseekV3ForCausalLM
        from transformers.modeling_layers import MtpLayer
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3DecoderLayer,
            DeepseekV3RMSNorm,
        )

        self.config = config
        self.target = DeepseekV3ForCausalLM(config)
        self.mtp = MtpLayer(config, DeepseekV3DecoderLayer, DeepseekV3RMSNorm,
                            layer_idx=config.num_hidden_layers, use_post_norm=True)
        # The target's initialisation (transformers' ``_init_weights``) for the MTP layer too:
        # its fused expert tensors are created empty.
        self.mtp.apply(self.target._init_weights)

    def mtp_hidden(self, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """MTP layer output (after its post norm) for pairs (h_i, t_{i+1}) at positions i."""
        batch, length = next_ids.shape
        positions = torch.arange(length, device=next_ids.device).expand(batch, length)
        embeds = self.target.model.embed_tokens(next_ids)
        embeds = torch.where(positions.unsqueeze(-1) == 0, 0, embeds)  # as vLLM serves it
        rotary = self.target.model.rotary_emb(embeds, positions)
        return self.mtp(embeds, hidden, position_embeddings=rotary, attention_mask=None,
                        position_ids=positions, past_key_values=None)

    def logits(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's logits for t_{i+1} (positions 0..T-2) and the MTP layer's for t_{i+2}
        (positions 0..T-3)."""
        hidden = self.target.model(input_ids=ids).last_hidden_state  # after the final norm
        head = self.target.lm_head
        return head(hidden[:, :-1]), head(self.mtp_hidden(hidden[:, :-2], ids[:, 1:-1]))


def losses(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """``main``: CE of t_{i+1}; ``mtp``: CE of t_{i+2} from the MTP layer (``model.logits``)."""
    main, drafted = model.logits(ids)
    return {"main": F.cross_entropy(main.flatten(0, 1).float(), ids[:, 1:].flatten()),
            "mtp": F.cross_entropy(drafted.flatten(0, 1).float(), ids[:, 2:].flatten())}

def windows(tokens: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, tokens.numel() - length - 1, (batch,), generator=gen)
    return torch.stack([tokens[s:s + length] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model, tokens: torch.Tensor, seq_len: int, max_tokens: int) -> dict:
    """Held-out CE of the target and of the MTP layer, and the MTP layer's top-1 accuracy at
    depth 1, over consecutive windows of ``tokens`` (at most ``max_tokens``)."""
    model.eval()
    n = min(tokens.numel(), max_tokens) // seq_len
    sums = {"main": 0.0, "mtp": 0.0, "mtp_correct": 0, "mtp_count": 0}
    for i in range(n):
        ids = tokens[i * seq_len:(i + 1) * seq_len].unsqueeze(0)
        main, drafted = model.logits(ids)
        sums["main"] += F.cross_entropy(main[0].float(), ids[0, 1:]).item()
        logits = drafted[0].float()
        sums["mtp"] += F.cross_entropy(logits, ids[0, 2:]).item()
        sums["mtp_correct"] += int((logits.argmax(-1) == ids[0, 2:]).sum())
        sums["mtp_count"] += ids.shape[1] - 2
    model.train()
    return {"perplexity": math.exp(sums["main"] / n), "mtp_cross_entropy": sums["mtp"] / n,
            "mtp_top1_accuracy": sums["mtp_correct"] / sums["mtp_count"], "tokens": n * seq_len}


def train(config, train_tokens: torch.Tensor, held_out: dict[str, torch.Tensor],
          settings: PretrainSettings, progress: bool = True,
          model_cls=TargetWithMtp) -> tuple[torch.nn.Module, dict]:
    """Train from scratch; returns the model and the history (losses, evaluations, timings).
    ``model_cls(config)``: the target with its MTP layer, with ``logits(ids)`` (V3 here, V4 in
    ``pretrain_v4.py``)."""
    from tqdm import tqdm

    # Adam's second moments of rarely used rows (embeddings of rare tokens) decay into denormal
    # floats, which x86 CPUs compute very slowly: training slowed by 60 % after 500 steps here.
    torch.set_flush_denormal(True)
    torch.manual_seed(settings.seed)
    model = model_cls(config)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=settings.learning_rate, betas=(0.9, 0.95))
    balancer = ExpertLoadBalancer(model, settings.bias_update_speed)
    gen = torch.Generator().manual_seed(settings.seed)
    history: dict = {"step": [], "main": [], "mtp": [], "evaluations": []}
    started = time.monotonic()
    bar = tqdm(range(settings.steps), desc="training", disable=not progress, unit="step")
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, settings, settings.steps)
        batch = windows(train_tokens, settings.batch_size, settings.seq_len, gen)
        step_losses = losses(model, batch)
        loss = step_losses["main"] + settings.mtp_weight * step_losses["mtp"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        balancer.step()
        history["step"].append(step)
        history["main"].append(step_losses["main"].item())
        history["mtp"].append(step_losses["mtp"].item())
        bar.set_postfix(main=f"{history['main'][-1]:.2f}", mtp=f"{history['mtp'][-1]:.2f}")
        if (step + 1) % settings.eval_every == 0 or step + 1 == settings.steps:
            row = {"step": step + 1, **{kind: evaluate(model, tokens, settings.seq_len,
                                                        settings.eval_tokens)
                                        for kind, tokens in held_out.items()}}
            history["evaluations"].append(row)
            balancer.loads.clear()  # evaluation traffic does not steer the routers
    history["seconds"] = time.monotonic() - started
    history["tokens_seen"] = settings.steps * settings.batch_size * settings.seq_len
    return model, history
