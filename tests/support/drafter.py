"""A V3 drafter built and loaded outside an engine, the way vLLM's worker and loader do it.

The config is the target's ``VllmConfig`` with ``method: mtp`` (as ``LLM(...)`` builds it); the
drafter is constructed under the model's default dtype with the config's forward context cleared
(each build registers its attention and MoE layers there by name), loaded from the checkpoint's
tensors, then ``process_weights_after_loading`` runs, as vLLM's loader runs it. The distributed
set-up around it is ``v4_support.harness.single_process_vllm``; V4 drafters have their own
builder there (``build_drafter``).
"""

from pathlib import Path

import torch
from vllm_mtp_plugin.tools.engine_modes import eager_for


def v3_engine_config(model_dir: Path, dtype: str = "float32", num_speculative_tokens: int = 1):
    """The target's ``VllmConfig`` (eager, one process) drafting with ``method: mtp``, in
    ``dtype``; on CPUs whose attention backend cannot hold that dtype, the backend that can
    (``cpu_features.engine_args_for_dtype``)."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_mtp_plugin.tools.cpu_features import engine_args_for_dtype

    backend, spec = engine_args_for_dtype(
        dtype, {"method": "mtp", "num_speculative_tokens": num_speculative_tokens})
    return EngineArgs(model=str(model_dir), dtype=dtype, enforce_eager=eager_for("direct-call"),
                      max_model_len=512,
                      distributed_executor_backend="uni", speculative_config=spec,
                      **backend).create_engine_config()


def build_v3_drafter(vllm_config, dtype: torch.dtype = torch.float32, cls=None):
    """``cls`` (default: our ``DeepSeekMTP``) constructed as vLLM's loader constructs it."""
    from vllm.utils.torch_utils import set_default_torch_dtype

    if cls is None:
        from vllm_mtp_plugin.models.v3 import DeepSeekMTP as cls
    vllm_config.compilation_config.static_forward_context.clear()
    with set_default_torch_dtype(dtype):
        return cls(vllm_config=vllm_config, prefix="")


def load_v3_drafter(vllm_config, tensors: dict[str, torch.Tensor],
                    dtype: torch.dtype = torch.float32, cls=None, before_loading=None):
    """``build_v3_drafter``, every parameter loaded from ``tensors`` (checked), then processed.
    ``before_loading(drafter)`` runs between construction and loading (to load through another
    weight map, say)."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    drafter = build_v3_drafter(vllm_config, dtype, cls)
    if before_loading is not None:
        before_loading(drafter)
    loaded = drafter.load_weights(iter(tensors.items()))
    assert loaded == {name for name, _ in drafter.named_parameters()}
    process_weights_after_loading(drafter, vllm_config.model_config, torch.device("cpu"))
    return drafter


def v3_target_embedding_and_head(tensors: dict[str, torch.Tensor]):
    """The target's ``embed_tokens`` and ``lm_head`` (vLLM's parallel layers) holding the
    checkpoint's tensors, the head processed as the target's loader leaves it: what vLLM's
    proposers hand the drafter after loading."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    vocab, hidden = tensors["model.embed_tokens.weight"].shape
    embed, head = VocabParallelEmbedding(vocab, hidden), ParallelLMHead(vocab, hidden)
    embed.weight.data.copy_(tensors["model.embed_tokens.weight"])
    head.weight.data.copy_(tensors["lm_head.weight"])
    head.quant_method.process_weights_after_loading(head)
    return embed, head
