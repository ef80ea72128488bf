"""The DeepSeek-V3/R1 MTP layer and the class vLLM builds for ``DeepSeekMTPModel``.

Per layer: ``x = eh_proj(cat(enorm(e), hnorm(h)))`` (embedding first, as the released weights
expect), one vLLM DeepSeek decoder block (MLA + MoE, tensor-parallel because it is vLLM's), and
``shared_head.norm`` before the target's head.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import tensor_model_parallel_all_gather
from vllm.logger import init_logger
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.models.deepseek_v2 import (
    DeepseekV2DecoderLayer,
    DeepseekV2MixtureOfExperts,
    DeepseekV2MoE,
)

from ..platform import fused_moe_expert_params
from ..weights.rules import WeightMap
from ..weights.v3 import v3_weight_map
from .predictor import DeepSeekMultiTokenPredictor, SharedHeadNorm, draft_hf_config

logger = init_logger("vllm.vllm_mtp_plugin")


def uses_sparse_attention(config) -> bool:
    """A DeepSeek-V3.2 / GLM-5 (DSA) config: its MLA has an indexer. vLLM's own MTP class tests
    the same attribute to build the indexer's ``topk_indices_buffer``, which this layer does not."""
    return hasattr(config, "index_topk")


class DeepSeekV3MTPLayer(nn.Module):
    """One V3 MTP module. Returns ``(pre_norm, shared_head.norm(pre_norm))``: vLLM's V1 proposer
    samples from the first (through ``compute_logits``) and feeds the second to the next step."""

    def __init__(self, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        config = draft_hf_config(vllm_config)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps=eps)
        self.hnorm = RMSNorm(hidden, eps=eps)
        # DeepSeek ships eh_proj unquantized even in FP8 checkpoints.
        self.eh_proj = ReplicatedLinear(
            2 * hidden, hidden, bias=False, return_bias=False, prefix=f"{prefix}.eh_proj"
        )
        self.shared_head = SharedHeadNorm(hidden, eps)
        self.mtp_block = DeepseekV2DecoderLayer(vllm_config, prefix, config=config)

    def forward(
        self,
        positions: torch.Tensor,
        previous_hidden_states: torch.Tensor,
        inputs_embeds: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Position 0 has no previous token: its embedding is zeroed (as vLLM and SGLang do).
        inputs_embeds = torch.where(positions.unsqueeze(-1) == 0, 0, inputs_embeds)
        fused = torch.cat([self.enorm(inputs_embeds), self.hnorm(previous_hidden_states)], dim=-1)
        hidden_states, residual = self.mtp_block(
            positions=positions, hidden_states=self.eh_proj(fused), residual=None
        )
        hidden_states = hidden_states + residual
        if self.mtp_block.use_sequence_parallel_moe:
            hidden_states = tensor_model_parallel_all_gather(hidden_states, 0)
            hidden_states = hidden_states[: positions.shape[0]]
        return hidden_states, self.shared_head(hidden_states)

    def logits_input(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.shared_head(hidden_states)

    def moe_block(self) -> DeepseekV2MoE | None:
        mlp = self.mtp_block.mlp
        return mlp if isinstance(mlp, DeepseekV2MoE) else None


@support_torch_compile
class DeepSeekMTP(DeepSeekMultiTokenPredictor, DeepseekV2MixtureOfExperts):
    """Registered as ``DeepSeekMTPModel``: vLLM's V1 proposer unpacks a tuple from this name."""

    layer_cls = DeepSeekV3MTPLayer
    variant = "V3"

    def __new__(cls, *, vllm_config: VllmConfig, prefix: str = ""):
        """V3.2 / GLM-DSA targets get vLLM's own class (releases that route them to this
        architecture name, e.g. vLLM 0.27, instead of ``DeepseekV32MTPModel``)."""
        config = draft_hf_config(vllm_config)
        if not uses_sparse_attention(config):
            return super().__new__(cls)
        from vllm.model_executor.models.deepseek_mtp import DeepSeekMTP as InTreeDeepSeekMTP

        target_type = getattr(getattr(vllm_config.model_config, "hf_config", None), "model_type",
                              "?")
        logger.info("vllm-mtp-plugin: %s target (sparse-attention indexer): drafting with vLLM's "
                    "own %s:%s", target_type, InTreeDeepSeekMTP.__module__,
                    InTreeDeepSeekMTP.__name__)
        return InTreeDeepSeekMTP(vllm_config=vllm_config, prefix=prefix)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._set_moe_parameters()

    def weight_map(self) -> WeightMap:
        return v3_weight_map(fused_moe_expert_params())

    def _set_moe_parameters(self) -> None:
        """Expose the MoE layers to vLLM's expert-parallel load balancer (MixtureOfExperts)."""
        self.moe_mlp_layers = [
            moe for layer in self.model.layers.values() if (moe := layer.moe_block()) is not None
        ]
        self.moe_layers = [moe.experts for moe in self.moe_mlp_layers]
        self.num_moe_layers = len(self.moe_mlp_layers)
        self.num_expert_groups = getattr(self.config, "n_group", 1)
        self.extract_moe_parameters(self.moe_mlp_layers[0] if self.moe_mlp_layers else None)
