"""Loading an MTP layer's tensors through vLLM's own ``weight_loader``s, and the proof that the load
was complete; with every message a bad checkpoint gets, at load and before the engine starts.

``load_mtp_weights`` renames each tensor by a ``WeightMap`` (``rules.py``) and raises
``CheckpointError`` (naming the tensor, its file, the expected and found shapes, and what to do)
instead of a bare ``KeyError``. The messages that the start-up check (``preflight.py``) and
``vllm-mtp inspect`` give for the same fault are the functions below, so each fault reads the same
wherever it is found.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import regex as re

from .experts import fused_shared_experts, local_experts
from .headers import checkpoint_files, tensor_file
from .quantized import needs_no_tensor, quantization_extra
from .rules import Target, WeightMap


class CheckpointError(ValueError):
    """A checkpoint that cannot serve as an MTP drafter; the message says why and what to do."""


def no_mtp_tensors(where: str, j: int, prefix: str, naming: str) -> str:
    """MTP layer ``j`` declared by config.json, but no tensor under ``prefix`` in ``where`` (the
    checkpoint's files: ``headers.checkpoint_files``)."""
    return (f"{where} has no tensors for MTP layer {j} ({prefix}*, {naming}), although "
            "config.json declares it (num_nextn_predict_layers). The checkpoint may have been "
            "quantized or exported without its MTP layers: use a checkpoint that keeps them, or "
            "serve without --speculative-config.")


def dspark_drafter(prefix: str, count: int, markers: Sequence[str]) -> str:
    """``prefix`` holds ``count`` tensors but no enorm/hnorm: a DSpark drafter where the MTP layer
    should be; ``markers``: the DSpark-only tensors seen (``layers.DSPARK_MARKERS``)."""
    what = (f"and DSpark tensors ({', '.join(sorted(markers))}): it is a DSpark drafter"
            if markers else "so it is not a DeepSeek MTP layer; it looks like a DSpark drafter")
    return (f"{prefix}* has {count} tensors but no enorm/hnorm, {what} stored under 'mtp.' (as in "
            "DeepSeek-V4-Flash-0731). Serve it with --speculative-config "
            "'{\"method\": \"dspark\", ...}' instead of \"mtp\".")



def _shape(t) -> tuple[int, ...]:
    return tuple(t.shape)


@dataclasses.dataclass
class LoadReport:
    """What a load did: parameter names loaded, checkpoint tensors per MTP layer, skipped tensors
    (shared with the target, or quantization extras the drafter has no parameter for)."""

    loaded: set[str] = dataclasses.field(default_factory=set)
    shards: dict[str, set] = dataclasses.field(default_factory=dict)
    tensors_per_layer: dict[int, int] = dataclasses.field(default_factory=dict)
    shared_skipped: list[str] = dataclasses.field(default_factory=list)
    extras_skipped: list[str] = dataclasses.field(default_factory=list)


def load_mtp_weights(
    weight_map: WeightMap,
    weights: Iterable[tuple[str, "torch.Tensor"]],  # noqa: F821
    params: dict[str, "torch.nn.Parameter"],  # noqa: F821
    mtp_layers: Sequence[int],
    num_experts: int,
    model_dir: str | None = None,
    checkpoint_hint: Callable[[int, "LoadReport"], str | None] | None = None,
) -> set[str]:
    """Load the MTP tensors of ``weights`` into ``params``; prove every parameter got its data.

    ``weights`` yields ``(name, tensor)``, or ``(name, reader)`` with a zero-argument callable
    that reads the tensor: one skipped by name (the target's, a copy of the shared embedding or
    head, an extra) is then never read (``reload.mtp_weights``: a vocabulary-sized head is
    gigabytes). ``num_experts``: routed experts per MoE layer (``n_routed_experts``). A rank is complete when
    it has the experts it holds (``weights.experts``: expert parallelism, fused shared experts).
    ``checkpoint_hint(layer, report)`` may explain a wrong drafter format before the generic
    "missing tensors" error (V4 uses it to recognise DSpark drafters). Inside vLLM's
    ``disable_mtp_completeness_check()`` (weight sync loads one chunk at a time) the completeness
    checks are skipped, as vLLM's own loaders do; names and shapes are still checked.
    """
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    from ..platform import mtp_completeness_check_enabled

    report = LoadReport()
    wanted = set(mtp_layers)
    for ckpt_name, tensor in weights:
        layer = weight_map.mtp_layer(ckpt_name)
        if layer is None or layer not in wanted:
            continue  # the target's tensors, or MTP layers this config does not use
        report.tensors_per_layer[layer] = report.tensors_per_layer.get(layer, 0) + 1
        target = weight_map.resolve(ckpt_name, params.__contains__)
        if target is None:
            report.shared_skipped.append(ckpt_name)
            continue
        if target.param not in params:
            target = weight_map.fallback(ckpt_name, params.__contains__) or target
        if target.param not in params:
            extra = quantization_extra(target.param, params)
            if extra is None:
                report.extras_skipped.append(ckpt_name)
                continue
            target = dataclasses.replace(target, param=extra)
        param = params.get(target.param)
        if callable(tensor):  # read only now: a skipped tensor is never read
            tensor = tensor()
        if param is None:
            raise CheckpointError(
                f"{tensor_file(model_dir, ckpt_name)}: tensor '{ckpt_name}' (shape "
                f"{list(_shape(tensor))}) maps to parameter '{target.param}', which the "
                f"{weight_map.name} MTP layer does not have. The checkpoint's MTP layer does not "
                "match its config.json (check num_nextn_predict_layers, n_routed_experts, "
                "q_lora_rank), or it is not a DeepSeek MTP drafter."
            )
        for piece, into in _fan_out_fused_shared(target, tensor, param, ckpt_name, num_experts,
                                                 model_dir):
            _load_one(param, piece, into, ckpt_name, model_dir, default_weight_loader)
            if into.shard is not None:
                report.shards.setdefault(into.param, set()).add((into.shard, into.expert_id))
        report.loaded.add(target.param)
    if mtp_completeness_check_enabled():
        _check_complete(weight_map, params, report, mtp_layers, model_dir, checkpoint_hint,
                        num_experts)
    return report.loaded


def _fan_out_fused_shared(target: Target, tensor, param, ckpt_name, num_experts, model_dir):
    """``(tensor, target)`` pairs to load: the tensor itself, or, for shared experts fused into
    the routed experts' tensors, one equal slice per shared expert into slots
    ``num_experts + j`` (gate/up split along dim 0, down along dim 1, as vLLM's DeepSeek loaders)."""
    if not target.fused_shared:
        return [(tensor, target)]
    count = fused_shared_experts(param)
    if count == 0:
        raise CheckpointError(
            f"{tensor_file(model_dir, ckpt_name)}: tensor '{ckpt_name}' holds the layer's shared "
            f"experts, but the MTP layer has no shared-expert MLP and no fused shared-expert slots "
            f"in '{target.param}': config.json's n_shared_experts disagrees with the checkpoint "
            "(set n_shared_experts, or re-export the MTP layer).")
    dim = 1 if target.shard == "w2" and tensor.ndim > 1 else 0
    if tensor.shape[dim] % count:
        raise _shape_error(ckpt_name, tensor, param, target, model_dir,
                           f"dim {dim} does not split into {count} shared experts")
    return [(chunk, dataclasses.replace(target, expert_id=num_experts + j))
            for j, chunk in enumerate(tensor.chunk(count, dim))]


def _load_one(param, tensor, target: Target, ckpt_name, model_dir, default_loader) -> None:
    loader = getattr(param, "weight_loader", default_loader)
    if target.transform is not None:
        tensor = target.transform(tensor, param)
    plain = target.shard is None and target.expert_id is None
    if plain and loader is default_loader and _shape(param) != _shape(tensor):
        raise _shape_error(ckpt_name, tensor, param, target, model_dir)
    try:
        if target.expert_id is not None:
            loader(param, tensor, target.param, shard_id=target.shard, expert_id=target.expert_id)
        elif target.shard is not None:
            loader(param, tensor, target.shard)
        else:
            loader(param, tensor)
    except (AssertionError, RuntimeError, ValueError, IndexError) as exc:
        raise _shape_error(ckpt_name, tensor, param, target, model_dir, exc) from exc


def _shape_error(ckpt_name, tensor, param, target, model_dir, exc=None) -> CheckpointError:
    where = f" (shard {target.shard!r})" if target.shard is not None else ""
    if target.expert_id is not None:
        where = f" (expert {target.expert_id}, {target.shard})"
    detail = f" The loader said: {exc}" if exc else ""
    return CheckpointError(
        f"{tensor_file(model_dir, ckpt_name)}: tensor '{ckpt_name}' has shape "
        f"{list(_shape(tensor))}, but parameter '{target.param}'{where} expects "
        f"{list(_shape(param))} (this rank's slice). The tensor does not match config.json "
        f"(hidden_size, heads, ranks, expert sizes): re-export the MTP layer or fix the config.{detail}"
    )


def _layer_of_param(param_name: str) -> int | None:
    m = re.match(r"model\.layers\.(\d+)\.", param_name)
    return int(m.group(1)) if m else None


def _missing_shards(report: LoadReport, params, num_experts: int) -> list[str]:
    """Stacked parameters that got some shards but not all (e.g. ``gate_proj`` without ``up_proj``),
    and fused-MoE parameters missing an expert this rank holds (``weights.experts``)."""
    missing = []
    for param, seen in report.shards.items():
        experts = {e for _, e in seen}
        if experts == {None}:
            expected = {(0, None), (1, None)}
        else:
            kinds = {"w2"} if {s for s, _ in seen} == {"w2"} else {"w1", "w3"}
            expected = {(k, e) for k in kinds
                        for e in local_experts(params[param], num_experts, experts)}
        for shard, expert in sorted(expected - seen, key=str):
            missing.append(f"{param} [{'expert ' + str(expert) + ' ' if expert is not None else ''}"
                           f"shard {shard}]")
    return missing


def _check_complete(weight_map, params, report: LoadReport, mtp_layers, model_dir, hint,
                    num_experts: int) -> None:
    for layer in mtp_layers:
        if report.tensors_per_layer.get(layer, 0) == 0:
            prefix = weight_map.checkpoint_name(f"model.layers.{layer}.")
            # ``mtp_layers`` are the drafter's, from its first: layer - first is the MTP index.
            raise CheckpointError(no_mtp_tensors(checkpoint_files(model_dir),
                                                 layer - min(mtp_layers), prefix, weight_map.name))
        if hint is not None and (message := hint(layer, report)):
            raise CheckpointError(message)
    missing = sorted(
        weight_map.checkpoint_name(name) for name, param in params.items()
        if name not in report.loaded and _layer_of_param(name) in set(mtp_layers)
        and not needs_no_tensor(name, param)
    ) + _missing_shards(report, params, num_experts)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise CheckpointError(
            f"{model_dir or 'the checkpoint'}: the MTP layer is incomplete; no tensor was found for "
            f"{len(missing)} tensor(s): {shown}. Re-export the checkpoint with every tensor of "
            f"its MTP layers ({weight_map.name} names), or serve without --speculative-config."
        )
