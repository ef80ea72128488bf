"""The MTP layers being trained, how they start, and the per-depth objective.

Depth s (0-based) of a sequence with tokens x and stored hidden states h: position i takes the
previous depth's output at i (h_i at depth 0), the embedding of x[i+s+1] and rotary position i+s
(what vLLM passes at draft step s), and predicts x[i+s+2]. ``unroll``:

* ``chained``: depth s runs layer L+s (DeepSeek's sequential MTP; Model Runner V2 drafts step s
  with layer L+s);
* ``recursive``: every depth runs the one layer L on its own output (vLLM's V1 runner for k > 1).

Losses per depth: ``ce`` on the sequence's tokens, or ``kl`` to the target's distribution at that
position, ``softmax(head(h[i+s+1]))`` - computed from the stored hidden state with the frozen head,
so it is the target's full distribution, not a top-k cut. Depth s weighs ``step_weight ** s``.
Accuracy per depth counts agreement with the target's greedy choice (what greedy acceptance
measures).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.target import TargetCheckpoint
from .transformers_layer import (FrozenTarget, mtp_forward, new_layer, to_checkpoint_tensors,
                     to_module_state, transformers_config)
from .v3_target import TrainInputError

INITS = ("auto", "checkpoint", "scratch", "last-layer")
UNROLLS = ("chained", "recursive")
# --train-only groups: parameter-name fragments of the MtpLayer.
PARAMETER_GROUPS = {
    "eh_proj": ("eh_proj.",),
    "norms": ("enorm.", "hnorm.", "post_norm.", "layernorm."),
    "attention": ("mtp_block.self_attn.",),
    "router": ("mlp.gate.",),
    "shared_expert": ("mlp.shared_experts.",),
    "experts": ("mlp.experts.",),
}


def resolve_init(init: str, target: TargetCheckpoint) -> str:
    """``auto``: refresh the target's own MTP layer, or start a new one from scratch when it has
    none (on the tiny DeepSeek, scratch reached 0.66 held-out agreement in 500 steps where the
    last-layer start reached 0.52: docs/training.md)."""
    own = target.mtp_layers()
    if init == "auto":
        return "checkpoint" if own else "scratch"
    if init == "checkpoint" and not own:
        raise TrainInputError(
            f"--init checkpoint: {target.dir} has no MTP layer (no model.layers."
            f"{target.num_hidden_layers}.eh_proj.weight); use --init last-layer or --init scratch.")
    return init


def initial_layer(target: TargetCheckpoint, config, init: str, index: int) -> nn.Module:
    """MTP layer ``L + index`` as ``init`` says (float32)."""
    base = target.num_hidden_layers
    layer = new_layer(config, base + index)
    if init == "scratch":
        return layer
    if init == "checkpoint":
        own = target.mtp_layers()
        source = own[min(index, len(own) - 1)]  # deeper layers than shipped start as the last one
        state = to_module_state(target.layer(source), config.n_routed_experts)
    else:  # last-layer: the target's last decoder block, the final norm as post norm, and an
        # eh_proj that passes hnorm(h) through (the block then sees the target's own state)
        state = to_module_state(target.layer(base - 1), config.n_routed_experts)
        hidden = config.hidden_size
        eh = torch.zeros(hidden, 2 * hidden)
        eh[:, hidden:] = torch.eye(hidden)
        eh[:, :hidden] = torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(index)
                                     ) * config.initializer_range
        state.update({"eh_proj.weight": eh, "post_norm.weight": target.float_tensor(
            "model.norm.weight"), "enorm.weight": torch.ones(hidden),
            "hnorm.weight": torch.ones(hidden)})
    _load(layer, state, target, base + index, init)
    return layer


def _load(layer: nn.Module, state: dict, target: TargetCheckpoint, index: int, init: str) -> None:
    own = layer.state_dict()
    missing = sorted(set(own) - set(state))
    wrong = [f"{k}: checkpoint {tuple(v.shape)}, layer {tuple(own[k].shape)}"
             for k, v in state.items() if k in own and tuple(v.shape) != tuple(own[k].shape)]
    unknown = sorted(set(state) - set(own))
    if missing or wrong or unknown:
        parts = ([f"missing {', '.join(missing[:4])}"] if missing else []) + wrong[:4] + (
            [f"unexpected {', '.join(unknown[:4])}"] if unknown else [])
        raise TrainInputError(
            f"--init {init}: layer {index} of {target.dir} does not fit a DeepSeek-V3 MTP layer "
            f"of this config ({'; '.join(parts)}). Use --init scratch, or a target whose "
            "config.json matches its tensors.")
    layer.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})


class MtpTrainModel(nn.Module):
    """The trainable layers and the frozen target parts they share."""

    def __init__(self, target: TargetCheckpoint, init: str, depth: int, unroll: str,
                 seed: int = 0):
        super().__init__()
        if unroll not in UNROLLS:
            raise TrainInputError(f"--unroll {unroll!r}: choose one of {', '.join(UNROLLS)}.")
        if depth < 1:
            raise TrainInputError(f"--depth {depth}: at least 1.")
        self.config = transformers_config(target.config)
        self.first_layer = target.num_hidden_layers  # L: the checkpoint's index of layers[0]
        self.init = resolve_init(init, target)
        self.unroll = unroll
        self.depth = depth
        self.lengths: torch.Tensor | None = None
        self.input_mask: torch.Tensor | None = None
        count = depth if unroll == "chained" else 1
        layers = []
        for j in range(count):
            with torch.random.fork_rng():  # the same start in every process and every run
                torch.manual_seed(seed + j)
                layers.append(initial_layer(target, self.config, self.init, j))
        self.layers = nn.ModuleList(layers)
        self.target = FrozenTarget(self.config, target.float_tensor("model.embed_tokens.weight"),
                                   target.float_tensor("lm_head.weight"))

    def checkpoint_tensors(self, state: dict[str, torch.Tensor] | None = None
                           ) -> dict[str, torch.Tensor]:
        """``self.layers``' state dict (``{j}.<module name>``; default: the current one) in the
        checkpoint's names, ``model.layers.{L + j}.<tensor>``: the one renaming between the
        trainer and the served checkpoint."""
        per_layer: dict[int, dict[str, torch.Tensor]] = {}
        for key, tensor in (self.layers.state_dict() if state is None else state).items():
            j, name = key.split(".", 1)
            per_layer.setdefault(int(j), {})[name] = tensor
        return {name: tensor for j in sorted(per_layer) for name, tensor in to_checkpoint_tensors(
            per_layer[j], f"model.layers.{self.first_layer + j}.").items()}

    def freeze_except(self, groups: list[str] | None) -> int:
        """Train only parameters of ``groups`` (None: all); returns the trainable count."""
        unknown = [g for g in groups or () if g not in PARAMETER_GROUPS]
        if unknown:
            raise TrainInputError(f"--train-only {','.join(unknown)}: unknown; choose from "
                                  f"{', '.join(PARAMETER_GROUPS)}.")
        fragments = [f for g in groups for f in PARAMETER_GROUPS[g]] if groups else None
        count = 0
        for name, param in self.layers.named_parameters():
            param.requires_grad = fragments is None or any(f in name for f in fragments)
            count += param.numel() if param.requires_grad else 0
        return count

    def layer_at(self, depth: int) -> nn.Module:
        return self.layers[depth if self.unroll == "chained" else 0]

    def depth_outputs(self, tokens: torch.Tensor, hidden: torch.Tensor):
        """Per depth s: the layer's output ``[B, T - s, H]`` for positions i (see module doc)."""
        previous = hidden
        width = hidden.shape[1]
        for s in range(self.depth):
            n = width - s
            positions = (torch.arange(n, device=tokens.device) + s).expand(tokens.shape[0], n)
            # Rows with a real input (not right padding), for the expert balancer's counts.
            self.input_mask = positions < self.lengths[:, None] if self.lengths is not None \
                else None
            out = mtp_forward(self.layer_at(s), self.target, previous[:, :n],
                              tokens[:, s + 1:s + 1 + n], positions)
            yield s, out
            previous = out

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, lengths: torch.Tensor,
                loss: str) -> list[dict[str, torch.Tensor]]:
        return self.objective(tokens, hidden, lengths, loss)

    def objective(self, tokens: torch.Tensor, hidden: torch.Tensor, lengths: torch.Tensor,
                  loss: str) -> list[dict[str, torch.Tensor]]:
        """Per depth: summed ``loss``, ``correct`` (agreement with the target's greedy token) and
        ``count`` of valid positions (i + s + 2 <= T)."""
        self.lengths = lengths
        rows = []
        head = self.target.lm_head
        for s, out in self.depth_outputs(tokens, hidden):
            n = out.shape[1] - 1  # the last position has no next token to predict
            valid = (torch.arange(n, device=tokens.device) + s + 2)[None, :] <= lengths[:, None]
            logits = head(out[:, :n]).float()[valid]
            with torch.no_grad():
                teacher_logits = head(hidden[:, s + 1:s + 1 + n]).float()[valid]
            if loss == "kl":
                value = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(teacher_logits, -1),
                                 log_target=True, reduction="sum")
            else:
                value = F.cross_entropy(logits, tokens[:, s + 2:s + 2 + n][valid], reduction="sum")
            correct = (logits.argmax(-1) == teacher_logits.argmax(-1)).sum()
            rows.append({"loss": value, "correct": correct, "count": valid.sum()})
        return rows
