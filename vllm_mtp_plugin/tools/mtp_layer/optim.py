"""What every training run of the project shares: the optimiser settings, the learning-rate
schedule and DeepSeek's expert balancing.

``vllm-mtp train`` (``trainer.py``: MTP layers on a frozen target) and the tiny model's
pretraining (``tiny/pretrain.py``: target and MTP layer together) both use them, with their own
defaults (``TrainSettings``, ``PretrainSettings``).
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass
class OptimizerSettings:
    """AdamW (betas 0.9 / 0.95, gradient norm clipped at 1) with linear warm-up and cosine decay
    to a tenth, and DeepSeek's auxiliary-loss-free expert balancing."""

    batch_size: int = 16  # sequences per step, all ranks together
    learning_rate: float = 1e-3
    warmup_steps: int = 30
    weight_decay: float = 0.0
    bias_update_speed: float = 0.001  # γ of DeepSeek-V3's expert balancing (0.001 in its report)
    eval_every: int = 50
    seed: int = 0


def learning_rate(step: int, settings: OptimizerSettings, steps: int) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to a tenth at ``steps``."""
    if step < settings.warmup_steps:
        return settings.learning_rate * (step + 1) / settings.warmup_steps
    done = (step - settings.warmup_steps) / max(1, steps - settings.warmup_steps)
    return settings.learning_rate * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, done))))


class ExpertLoadBalancer:
    """DeepSeek-V3's auxiliary-loss-free balancing (report §2.1.2): after each step, every
    router's ``e_score_correction_bias`` moves by ``speed`` towards the experts that got fewer
    tokens than the mean in that step. The bias only steers the choice of experts, not their
    weights, exactly as vLLM applies it when serving."""

    def __init__(self, model: torch.nn.Module, speed: float):
        self.speed = speed
        self.loads: dict[torch.nn.Module, torch.Tensor] = {}
        self.routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        for router in self.routers:
            router.register_forward_hook(self._count)

    def _count(self, router, args, output) -> None:
        chosen = output[-1]  # the router returns (logits, weights, expert indices)
        load = torch.bincount(chosen.flatten(), minlength=router.e_score_correction_bias.numel())
        self.loads[router] = self.loads.get(router, 0) + load

    @torch.no_grad()
    def step(self) -> None:
        for router, load in self.loads.items():
            router.e_score_correction_bias += self.speed * torch.sign(load.float().mean() - load)
        self.loads.clear()
