"""The DeepSeek-V3/R1 MTP layer and the class vLLM builds for ``DeepSeekMTPModel``.

Per layer: ``x = eh_proj(cat(enorm(e), hnorm(h)))`` (embedding first, as the released weights
expect), one vLLM DeepSeek decoder block (MLA + MoE, tensor-parallel because it is vLLM's), and
``shared_head.norm`` before the target's head.

Rotation-quantised checkpoints (Ascend's modelslim with ``"is_rot_used": true``) store one
``rot.weight`` ``[hidden, hidden]`` at the top level; the target's hidden states live in the
rotated basis, and vllm-ascend's ``AscendDeepSeekMTP`` (``vllm_ascend/models/deepseek_mtp.py``,
lines 19-21 and 32-33 at 182b75ea84) applies ``rot`` (a bias-free linear) to the hidden states at
every draft step before vLLM's MTP forward; it loads it as ``model.layers.{L}.rot.weight``
(lines 40-43). This class does the same when the quantisation config says so or the checkpoint
holds ``rot.weight``.
"""


from pathlib import Path

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import tensor_model_parallel_all_gather
from vllm.logger import init_logger
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.deepseek_v2 import (
    DeepseekV2DecoderLayer,
    DeepseekV2MixtureOfExperts,
    DeepseekV2MoE,
)

from vllm.model_executor.models.utils import maybe_prefix

from ..platform import fused_moe_expert_params, host_compares_head_copies
from ..weights.headers import file_holding
from ..weights.loader import CheckpointError
from ..weights.rules import WeightMap
from ..weights.v3 import v3_weight_map
from .predictor import DeepSeekMultiTokenPredictor, SharedHeadNorm, draft_hf_config

logger = init_logger("vllm.vllm_mtp_plugin")


def uses_sparse_attention(config) -> bool:
    """A DeepSeek-V3.2 / GLM-5 (DSA) config: its MLA has an indexer. vLLM's own MTP class tests
    the same attribute to build the indexer's ``topk_indices_buffer``, which this layer does not."""
    return hasattr(config, "index_topk")


ROTATION_WEIGHT = "rot.weight"


def uses_rotation(vllm_config: VllmConfig) -> bool:
    """A rotation-quantised checkpoint: modelslim's ``is_rot_used`` (vllm-ascend's own test,
    ``vllm_ascend/utils.py: is_rot_weight_used``), or a top-level ``rot.weight`` in the files.

    Runs in every worker at construction: the shard index answers without opening a shard; only a
    checkpoint without an index (a single file) has its header read."""
    description = getattr(vllm_config.quant_config, "quant_description", None) or {}
    if isinstance(description, dict) and description.get("is_rot_used"):
        return True
    model_dir = getattr(vllm_config.speculative_config.draft_model_config, "model", None)
    if not model_dir or not Path(model_dir).is_dir():
        return False  # a hub id: only the quantization config can say (load_weights explains)
    return file_holding(model_dir, ROTATION_WEIGHT) is not None


@support_torch_compile
class DeepSeekV3MTPLayer(nn.Module):
    """One V3 MTP module. Returns ``(pre_norm, shared_head.norm(pre_norm))``: vLLM's V1 proposer
    samples from the first (through ``compute_logits``) and feeds the second to the next step.

    Compiled per layer, not as a whole drafter: vLLM traces a compiled forward once and drops its
    guards, so a drafter compiled as one module keeps the MTP layer its first draft step chose
    (``spec_step_idx`` is a Python int) - on Model Runner V2 every later step would run layer L
    again. Each layer here has a graph of its own and the step picks among them outside any trace.
    """

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
        head_copy = (ParallelLMHead(config.vocab_size, hidden, quant_config=vllm_config.quant_config,
                                    prefix=f"{prefix}.shared_head.head")
                     if host_compares_head_copies() else None)
        self.shared_head = SharedHeadNorm(hidden, eps, head_copy)
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
        if uses_rotation(vllm_config):
            hidden = self.config.hidden_size
            first = self.model.layers[str(self.model.mtp_start_layer_idx)]
            first.rot = ReplicatedLinear(
                hidden, hidden, bias=False, return_bias=False,
                prefix=maybe_prefix(prefix, f"model.layers.{self.model.mtp_start_layer_idx}.rot"))

    @property
    def rotation(self) -> nn.Module | None:
        """The checkpoint's ``rot`` (kept on the first MTP layer, as its name is loaded)."""
        return getattr(self.model.layers[str(self.model.mtp_start_layer_idx)], "rot", None)

    def prepare_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``rot`` first (the predictor's forward then runs the step's compiled layer)."""
        return hidden_states if self.rotation is None else self.rotation(hidden_states)

    def load_weights(self, weights):
        """The checkpoint's top-level ``rot.weight`` goes to the first MTP layer's ``rot``."""
        rot_name = f"model.layers.{self.model.mtp_start_layer_idx}.{ROTATION_WEIGHT}"

        def renamed():
            for name, tensor in weights:
                if name == ROTATION_WEIGHT and self.rotation is None:
                    raise CheckpointError(
                        "the checkpoint holds a top-level 'rot.weight' (a rotation-quantised "
                        "export), but its quantization config does not set \"is_rot_used\" and "
                        "the drafter could not see the file when it was built (checkpoint given "
                        "by hub id?). Set \"is_rot_used\": true in the quantization config, or "
                        "serve from a local directory.")
                yield (rot_name if name == ROTATION_WEIGHT else name), tensor

        return super().load_weights(renamed())

    def is_unused_checkpoint_weight(self, name: str) -> bool:
        """The top-level ``rot.weight`` is the drafter's too: its shard must be read."""
        return name != ROTATION_WEIGHT and super().is_unused_checkpoint_weight(name)

    def weight_map(self) -> WeightMap:
        return v3_weight_map(fused_moe_expert_params(), head_copies=host_compares_head_copies())

    def _set_moe_parameters(self) -> None:
        """Expose the MoE layers to vLLM's expert-parallel load balancer (MixtureOfExperts)."""
        self.moe_mlp_layers = [
            moe for layer in self.model.layers.values() if (moe := layer.moe_block()) is not None
        ]
        self.moe_layers = [moe.experts for moe in self.moe_mlp_layers]
        self.num_moe_layers = len(self.moe_mlp_layers)
        self.num_expert_groups = getattr(self.config, "n_group", 1)
        self.extract_moe_parameters(self.moe_mlp_layers[0] if self.moe_mlp_layers else None)
