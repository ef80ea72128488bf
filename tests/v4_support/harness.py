"""Build the V4 drafter outside an engine, the way vLLM's worker does, for tests on one CPU.

vLLM builds a drafter inside a worker: a ``VllmConfig`` with a speculative config is current, the
(single-process) distributed groups exist, the default dtype is the model's. ``single_process_vllm``
sets up exactly that with gloo on a free loopback port and tears it down again.

Two environment facts of the CPU worker are reproduced here, each where it applies:

* ``import vllm.v1.worker.cpu.shm``: vLLM's CPU worker imports it first thing; it replaces
  ``torch.cuda.Event``/``Stream`` with placeholders, which vLLM's shared V4 attention needs
  (``models/deepseek_v4/attention.py`` builds four ``torch.cuda.Event``s on every platform).
* ``pretend_amx``: vLLM's CPU FP8 linear kernels (``kernels/linear/scaled_mm/cpu.py``) refuse to be
  chosen without AMX tiles, so an FP8 drafter cannot even be *built* on a CPU without AMX. With the
  probe answering yes during construction, the FP8 parameters (``float8_e4m3fn`` weights, UE8M0
  ``weight_scale_inv``) are created exactly as on an AMX CPU; tests that use it only load weights
  and never run an FP8 matmul or ``process_weights_after_loading`` (which would pack for AMX).
  It can go when this machine has AMX (see ``tools.cpu_features.deepseek_v4_cpu_blockers``).
"""

import atexit
import contextlib
import functools
import shutil
import socket
import tempfile
from pathlib import Path

import torch

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


def engine_config(model_dir: Path, num_speculative_tokens: int = 1):
    """The target's ``VllmConfig`` with ``method: mtp``, as ``LLM(...)`` would build it."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(model_dir), dtype="bfloat16", enforce_eager=True, max_model_len=512,
        distributed_executor_backend="uni",
        speculative_config={"method": "mtp", "num_speculative_tokens": num_speculative_tokens},
    )
    return args.create_engine_config()


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
def pretend_amx():
    original = torch.cpu._is_amx_tile_supported
    torch.cpu._is_amx_tile_supported = lambda: True
    try:
        yield
    finally:
        torch.cpu._is_amx_tile_supported = original


def build_drafter(vllm_config, amx: bool = False):
    """Our ``DeepSeekV4MTP`` as vLLM's loader builds it (default dtype bf16, fresh layer names)."""
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_mtp_plugin.models.v4 import DeepSeekV4MTP

    # Each build registers its attention layers by name; a rebuild in the same config must not
    # collide with the previous one (an engine builds a drafter once).
    vllm_config.compilation_config.static_forward_context.clear()
    with set_default_torch_dtype(torch.bfloat16), (pretend_amx() if amx else contextlib.nullcontext()):
        return DeepSeekV4MTP(vllm_config=vllm_config, prefix="")


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
