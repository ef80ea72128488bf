"""V3 and V4 drafters built outside an engine, the way vLLM's worker and loader build them, for
tests on one CPU.

vLLM builds a drafter inside a worker: a ``VllmConfig`` with a speculative config is current, the
(single-process) distributed groups exist, the default dtype is the model's. ``engine_config``
is the target's config as ``LLM(...)`` builds it; ``single_process_vllm`` sets up the rest with
gloo on a free loopback port and tears it down again; ``build_drafter`` constructs either variant
(the class by the config's model type, the dtype the model's) with the config's forward context
cleared (each build registers its attention and MoE layers there by name); ``load_drafter`` loads
every parameter from a checkpoint's tensors (checked) and runs ``process_weights_after_loading``,
as vLLM's loader does.

Two environment facts of the CPU worker are reproduced here, each where it applies:

* ``import vllm.v1.worker.cpu.shm``: vLLM's CPU worker imports it first thing; it replaces
  ``torch.cuda.Event``/``Stream`` with placeholders, which vLLM's shared V4 attention needs
  (``models/deepseek_v4/attention.py`` builds four ``torch.cuda.Event``s on every platform).
* ``cpu_quantized_kernels_selected``: vLLM picks its CPU kernels for quantized layers while it
  *builds* them, and those kernels offer themselves only with AMX tiles (plus, for the FP8 linear
  ``CPUFp8BlockScaledMMKernel``, the ``fp8_scaled_mm_cpu`` op of the AVX512-BF16 kernel build;
  ``kernels/linear/scaled_mm/cpu.py``; for FP4 experts ``CPUExpertsMxfp4``,
  ``fused_moe/experts/cpu_moe.py``). Elsewhere building fails ("Failed to find a kernel that can
  implement the ScaledMM linear layer", "No MXFP4 MoE backend supports the deployment
  configuration"), even on the ``meta`` device. The parameters (``float8_e4m3fn`` weights,
  ``weight_scale_inv`` block scales, packed FP4 experts and their scales) come from the quantization
  method and are the same whichever kernel runs them, so tests of names, shapes and loading select
  those kernels explicitly and run on every CPU. They never run a quantized matmul or
  ``process_weights_after_loading`` (which would pack for AMX).
"""

import atexit
import contextlib
import functools
import shutil
import socket
import tempfile
from pathlib import Path

import pytest
import torch

from vllm_mtp_plugin.tools.engine.eager_reasons import eager_for
from vllm_mtp_plugin.tools.tiny.v4 import build_checkpoint

_ROOT = None


@functools.cache
def tiny_v4_checkpoint(mode: str = "random", **kwargs) -> Path:
    """A tiny V4 checkpoint (``tiny_v4.build_checkpoint``), built once per process."""
    global _ROOT
    if _ROOT is None:
        _ROOT = Path(tempfile.mkdtemp(prefix="tiny-v4-"))
        atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)
    name = "-".join([mode, *(f"{k}={v}" for k, v in sorted(kwargs.items()))])
    return build_checkpoint(_ROOT / name, mode, **kwargs)


def checkpoint_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors"))


def engine_config(model_dir: Path, dtype: str = "bfloat16", num_speculative_tokens: int = 1):
    """The target's ``VllmConfig`` (eager, one process) drafting with ``method: mtp``, in
    ``dtype``, as ``LLM(...)`` would build it (on CPUs with AMX the plugin's ``mla_dtype_on_amx``
    picks an attention backend that holds that dtype)."""
    from vllm.engine.arg_utils import EngineArgs

    spec = {"method": "mtp", "num_speculative_tokens": num_speculative_tokens}
    return EngineArgs(model=str(model_dir), dtype=dtype, enforce_eager=eager_for("direct-call"),
                      max_model_len=512, distributed_executor_backend="uni",
                      speculative_config=spec).create_engine_config()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def single_process_vllm(vllm_config):
    """``vllm_config`` current, world size 1 (gloo), model-parallel groups of 1; undone on exit."""
    import vllm.v1.worker.cpu.shm  # noqa: F401  (the CPU worker's torch.cuda placeholders)
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
        initialize_model_parallel(1, 1)
        try:
            yield vllm_config
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


@contextlib.contextmanager
def cpu_quantized_kernels_selected():
    """vLLM's CPU block-FP8 linear and FP4 expert kernels chosen for layers built here, whatever
    this CPU has (see the module docstring)."""
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsMxfp4

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CPUFp8BlockScaledMMKernel, "is_supported",
                      classmethod(lambda cls, compute_capability=None: (True, None)))
        patch.setattr(CPUExpertsMxfp4, "_supports_current_device", staticmethod(lambda: True))
        yield


def build_drafter(vllm_config, cls=None, quantized: bool = False):
    """``cls`` (default: ours for the config's model type, ``DeepSeekMTP`` or ``DeepSeekV4MTP``)
    as vLLM's loader builds it: the model's default dtype, fresh layer names."""
    from vllm.utils.torch_utils import set_default_torch_dtype

    if cls is None:
        if vllm_config.model_config.hf_config.model_type == "deepseek_v4":
            from vllm_mtp_plugin.models.v4 import DeepSeekV4MTP as cls
        else:
            from vllm_mtp_plugin.models.v3 import DeepSeekMTP as cls
    # Each build registers its attention layers by name; a rebuild in the same config must not
    # collide with the previous one (an engine builds a drafter once).
    vllm_config.compilation_config.static_forward_context.clear()
    kernels = cpu_quantized_kernels_selected() if quantized else contextlib.nullcontext()
    with set_default_torch_dtype(vllm_config.model_config.dtype), kernels:
        return cls(vllm_config=vllm_config, prefix="")


def load_drafter(vllm_config, tensors: dict[str, torch.Tensor], cls=None, before_loading=None):
    """``build_drafter``, every parameter loaded from ``tensors`` (checked), then processed.
    ``before_loading(drafter)`` runs between construction and loading (to load through another
    weight map, say)."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    drafter = build_drafter(vllm_config, cls)
    if before_loading is not None:
        before_loading(drafter)
    loaded = drafter.load_weights(iter(tensors.items()))
    assert loaded == {name for name, _ in drafter.named_parameters()}
    process_weights_after_loading(drafter, vllm_config.model_config, torch.device("cpu"))
    return drafter


def v4_kernels_missing() -> list[str]:
    """Why vLLM's CPU V4 kernels (``_C``: the block's attention packing, ``hc_head``) are absent."""
    from vllm_mtp_plugin.platform import platform_family
    from vllm_mtp_plugin.tools.cpu_features import CPU_FEATURES_FOR_V4, missing_cpu_features

    return missing_cpu_features(*CPU_FEATURES_FOR_V4) if platform_family() == "cpu" else []


def process_loaded_drafter(drafter, vllm_config) -> None:
    """vLLM's ``process_weights_after_loading``, as its loader runs it after ``load_weights``.

    Where this CPU lacks vLLM's V4 kernels, each layer's ``mtp_block`` (vLLM's CPU V4 block, whose
    attention packs its weights with ``_C.convert_weight_packed``) is left unprocessed and
    ``hc_head`` runs the plugin's portable formula (``ops.hc_head``, equal to vLLM's kernel:
    ``test_v4_ops.py``): everything the drafter adds around the block still runs here.
    Tests that run the block itself need ``v4_kernels_missing() == []``.
    """
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    device = torch.device("cpu")
    if not v4_kernels_missing():
        process_weights_after_loading(drafter, vllm_config.model_config, device)
        return
    layers = list(drafter.model.layers.values())
    blocks = [layer._modules.pop("mtp_block") for layer in layers]
    try:
        process_weights_after_loading(drafter, vllm_config.model_config, device)
    finally:
        for layer, block in zip(layers, blocks):
            layer._modules["mtp_block"] = block
    for layer in layers:
        layer.hc_head = FormulaHCHead()


class FormulaHCHead(torch.nn.Module):
    """``hc_head`` as the plugin's plain-PyTorch formula, for CPUs without vLLM's kernel."""

    def forward(self, *args):
        from vllm_mtp_plugin.ops import hc_head

        return hc_head(*args)


def attach_target_parts(drafter, tensors: dict[str, torch.Tensor]) -> None:
    """What vLLM's proposer does after loading: the target's embedding and ``lm_head`` go in."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    vocab, hidden = tensors["embed.weight"].shape
    with torch.device("cpu"):
        embed = VocabParallelEmbedding(vocab, hidden, params_dtype=torch.bfloat16)
        head = ParallelLMHead(vocab, hidden, params_dtype=torch.bfloat16)
    embed.weight.data.copy_(tensors["embed.weight"])
    head.weight.data.copy_(tensors["head.weight"])
    head.quant_method.process_weights_after_loading(head)  # the target's head was processed too
    drafter.model.embed_tokens = embed
    drafter.lm_head = head


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
