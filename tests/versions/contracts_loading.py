"""Contracts of plugin precedence and of the loading paths besides a cold, complete start."""

from __future__ import annotations

import ast

from contracts import Result
from source_facts import SourceTree, params, string_constants, top_level_names

REGISTRY = "vllm.model_executor.models.registry"
WEIGHT_UTILS = "vllm.model_executor.model_loader.weight_utils"


def plugin_precedence(src: SourceTree) -> Result:
    """``precedence.py`` keeps claimed architectures while a frame of ``vllm.plugins.
    load_general_plugins`` is on the stack, and reads the registry's in-tree table."""
    problems = []
    if src.find_function("vllm.plugins", "load_general_plugins") is None:
        problems.append("no vllm.plugins.load_general_plugins (the guard would never act)")
    tree = src.tree(REGISTRY)
    names = top_level_names(tree) if tree else set()
    problems += [f"no registry.{n}" for n in ("_VLLM_MODELS", "_resolve_module_name")
                 if n not in names]
    if src.find_function(REGISTRY, "register_model", cls="_ModelRegistry") is None:
        problems.append("no _ModelRegistry.register_model")
    return Result("fail" if problems else "ok", "; ".join(problems))


def kv_scale_remap(src: SourceTree) -> Result:
    """``weights/quantized.py`` calls ``maybe_remap_kv_scale_name(name, params_dict)``."""
    func = src.find_function(WEIGHT_UTILS, "maybe_remap_kv_scale_name")
    if func is None:
        return Result("fail", "maybe_remap_kv_scale_name not found")
    ok = params(func)[:2] == ["name", "params_dict"]
    return Result("ok" if ok else "fail", "" if ok else f"parameters {params(func)}")


def unused_shard_skipping(src: SourceTree) -> Result:
    """The loader asks ``model.is_unused_checkpoint_weight``; without it every shard is read
    (slower, still correct)."""
    tree = src.tree("vllm.model_executor.model_loader.default_loader")
    asked = tree is not None and "is_unused_checkpoint_weight" in string_constants(tree)
    return Result("ok" if asked else "info",
                  "shards without MTP tensors skipped" if asked else "every shard is read")


def ep_expert_map(src: SourceTree) -> Result:
    """``weights/experts.py`` asks the MoE layer bound to a parameter's ``weight_loader`` for
    ``_map_global_expert_id_to_local_expert_id`` (absent: only the experts the weight stream brings are expected, with a warning)."""
    for module in ("vllm.model_executor.layers.fused_moe.runner.moe_runner",
                   "vllm.model_executor.layers.fused_moe.layer"):
        tree = src.tree(module)
        if tree is not None and any(getattr(n, "name", None) ==
                                    "_map_global_expert_id_to_local_expert_id"
                                    for n in ast.walk(tree)):
            return Result("ok", module.rsplit(".", 1)[1])
    return Result("info", "no global->local expert map (no EP weight filter to follow)")
