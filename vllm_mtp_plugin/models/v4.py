"""The DeepSeek-V4 MTP layer and the class vLLM builds for ``DeepSeekV4MTPModel``.

Per layer (docs/v4.md): the target hands over its pre-``hc_head`` residual ``(T, hc_mult*H)``;

    x = h_proj(hnorm(h)) + e_proj(enorm(e))      # h per stream, e broadcast: (T, hc_mult, H)
    x = block(x)                                 # the platform's own hyper-connected V4 block
    return x.flatten(1)                          # fed back as the next step's hidden state

and ``compute_logits`` applies ``hc_head`` -> ``shared_head.norm`` -> the target's head. The block is
whatever ``DeepseekV4DecoderLayer`` the platform runs its V4 target with (``platform.py`` picks it
without importing the other platforms' modules); ``hc_head`` is vLLM's op with a portable path
(``ops.py``). vLLM's V1 proposer expects a single tensor from this architecture name.
"""

import inspect

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.mhc import MHCPostOp

from ..ops import hc_head_op
from ..platform import deepseek_v4_aux_streams, deepseek_v4_block_cls, fused_moe_expert_params
from ..weights.rules import WeightMap
from ..weights.v4 import dspark_hint, v4_weight_map
from .predictor import DeepSeekMultiTokenPredictor, SharedHeadNorm, draft_hf_config


def build_v4_block(vllm_config: VllmConfig, prefix: str) -> nn.Module:
    """The platform's V4 decoder block at ``prefix`` (its attention registers as ``prefix.attn``).

    Blocks differ in what they accept: CUDA's takes side streams, CPU's does not; each gets the
    arguments its constructor names. The top-k buffer is what vLLM's V4 model gives its blocks
    (the MTP block's attention is sliding-window only, but CUDA's prefill path still slices it).
    """
    block_cls = deepseek_v4_block_cls()
    accepts = inspect.signature(block_cls.__init__).parameters
    config = draft_hf_config(vllm_config)
    kwargs = {}
    if "topk_indices_buffer" in accepts:
        kwargs["topk_indices_buffer"] = torch.empty(
            vllm_config.scheduler_config.max_num_batched_tokens, config.index_topk,
            dtype=torch.int32,
        )
    if "aux_stream_list" in accepts:
        kwargs["aux_stream_list"] = deepseek_v4_aux_streams()
    return block_cls(vllm_config, prefix, **kwargs)


def shard_for_sequence_parallel(normed_embeds: torch.Tensor, normed_hidden: torch.Tensor):
    """This rank's token shard of both normed inputs, before ``e_proj``/``h_proj``, as vLLM's own
    V4 drafter does (``models/deepseek_v4/nvidia/mtp.py``): each rank projects ``ceil(T / tp)``
    tokens instead of all ``T``. The MoE's padding mask is sharded alike, so that the zero rows
    ``sp_shard`` pads with are skipped as padding (``VLLM_MOE_SKIP_PADDING``)."""
    import vllm.envs as envs
    from vllm.forward_context import get_forward_context, is_forward_context_available
    from vllm.models.common.ops.sequence_parallel import sp_padding_mask, sp_shard

    if getattr(envs, "VLLM_MOE_SKIP_PADDING", False) and is_forward_context_available():
        context = get_forward_context()
        context.is_padding = sp_padding_mask(context.is_padding, normed_embeds)
    return sp_shard(normed_embeds), sp_shard(normed_hidden)


class DeepSeekV4MTPLayer(nn.Module):
    """One V4 MTP module. ``forward`` returns the flat pre-``hc_head`` residual ``(T, hc_mult*H)``."""

    def __init__(self, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        config = draft_hf_config(vllm_config)
        quant_config = vllm_config.quant_config
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.hidden_size, self.rms_norm_eps = hidden, eps
        self.hc_mult, self.hc_eps = config.hc_mult, config.hc_eps
        self.enorm = RMSNorm(hidden, eps=eps)
        self.hnorm = RMSNorm(hidden, eps=eps)
        # Separate (FP8-quantized in DeepSeek's checkpoints) projections instead of V3's eh_proj.
        self.e_proj = ReplicatedLinear(hidden, hidden, bias=False, return_bias=False,
                                       quant_config=quant_config, prefix=f"{prefix}.e_proj")
        self.h_proj = ReplicatedLinear(hidden, hidden, bias=False, return_bias=False,
                                       quant_config=quant_config, prefix=f"{prefix}.h_proj")
        self.hc_head_fn = nn.Parameter(
            torch.empty(self.hc_mult, self.hc_mult * hidden, dtype=torch.float32),
            requires_grad=False)
        self.hc_head_base = nn.Parameter(torch.empty(self.hc_mult, dtype=torch.float32),
                                         requires_grad=False)
        self.hc_head_scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)
        self.hc_head = hc_head_op()
        self.shared_head = SharedHeadNorm(hidden, eps)
        self.mtp_block = build_v4_block(vllm_config, prefix)
        if getattr(getattr(self.mtp_block, "ffn", None), "use_native_mega_moe", False):
            raise NotImplementedError(
                "vllm-mtp-plugin's DeepSeek-V4 drafter does not support the native mega-MoE "
                "backend (moe_backend=deep_gemm_mega_moe). Pick another MoE backend, or set "
                "MTP_PLUGIN=off to use vLLM's in-tree drafter."
            )
        # A block that leaves its last hc_post to the caller and has no hc_post of its own
        # (CUDA's) gets vLLM's op, which dispatches to the platform kernel.
        self.mhc_post = None if hasattr(self.mtp_block, "hc_post") else MHCPostOp()

    def fuse_inputs(self, positions: torch.Tensor, previous_hidden_states: torch.Tensor,
                    inputs_embeds: torch.Tensor) -> torch.Tensor:
        """``h_proj(hnorm(h)) + e_proj(enorm(e))`` over ``hc_mult`` streams: ``(T, hc_mult, H)``.

        With sequence parallelism (``mtp_block.use_sequence_parallel``) this rank's token shard
        only, ``(ceil(T / tp), hc_mult, H)``: see ``shard_for_sequence_parallel``.
        """
        # Position 0 has no previous token: its embedding is zeroed (as vLLM and SGLang do).
        inputs_embeds = torch.where(positions.unsqueeze(-1) == 0, 0, inputs_embeds)
        e = self.enorm(inputs_embeds)
        streams = previous_hidden_states.reshape(-1, self.hidden_size)
        h = self.hnorm(streams).view(-1, self.hc_mult, self.hidden_size)
        if self.sequence_parallel:
            e, h = shard_for_sequence_parallel(e, h)
        h = self.h_proj(h.reshape(-1, self.hidden_size)).view(-1, self.hc_mult, self.hidden_size)
        return h + self.e_proj(e).unsqueeze(-2)

    @property
    def sequence_parallel(self) -> bool:
        return bool(getattr(self.mtp_block, "use_sequence_parallel", False))

    def forward(self, positions: torch.Tensor, previous_hidden_states: torch.Tensor,
                inputs_embeds: torch.Tensor) -> torch.Tensor:
        x = self.fuse_inputs(positions, previous_hidden_states, inputs_embeds)
        x, residual, post_mix, res_mix = self.mtp_block(x=x, positions=positions, input_ids=None)
        if residual is not None:  # the block's last hc_post is deferred (fused hyper-connections)
            post = self.mhc_post or self.mtp_block.hc_post
            x = post(x, residual, post_mix, res_mix)
        if self.sequence_parallel:
            from vllm.models.common.ops.sequence_parallel import sp_all_gather

            x = sp_all_gather(x)[: positions.shape[0]]
        return x.flatten(1)

    def logits_input(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``shared_head.norm(hc_head(x))``: the hidden state the target's head turns into logits."""
        streams = hidden_states.view(-1, self.hc_mult, self.hidden_size)
        mixed = self.hc_head(streams, self.hc_head_fn, self.hc_head_scale, self.hc_head_base,
                             self.rms_norm_eps, self.hc_eps)
        return self.shared_head(mixed)


class DeepSeekV4MTP(DeepSeekMultiTokenPredictor):
    """Registered as ``DeepSeekV4MTPModel``: vLLM's V1 proposer takes one tensor from this name.

    Not wrapped in ``support_torch_compile``, like vLLM's own V4 drafter: V4 attention is an
    opaque custom op and the CUDA block overlaps work on side streams.
    """

    layer_cls = DeepSeekV4MTPLayer
    variant = "V4"

    def weight_map(self) -> WeightMap:
        return v4_weight_map(
            fused_moe_expert_params(),
            expert_dtype=getattr(self.config, "expert_dtype", "fp4"),
            num_hidden_layers=self.config.num_hidden_layers,
            num_heads=self.config.num_attention_heads,
        )

    def checkpoint_hint(self, layer: int, report) -> str | None:
        return dspark_hint(self.config.num_hidden_layers)(layer, report)
