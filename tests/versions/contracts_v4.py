"""DeepSeek-V4 contracts: the platform's decoder blocks, ``hc_head``'s op, ``attn_sink`` loading."""

from __future__ import annotations

import ast

from contracts import V4, Result, plugin_function
from source_facts import SourceTree, params, required_params, string_constants

# What ``models/v4.py:build_v4_block`` can pass a block's constructor.
BLOCK_ARGS = {"self", "vllm_config", "prefix", "topk_indices_buffer", "aux_stream_list"}


def block_modules() -> dict[str, str]:
    from vllm_mtp_plugin.platform import V4_BLOCK_MODULES  # no vLLM import at module level

    return V4_BLOCK_MODULES


def plugin_stops_cleanly_without_block() -> bool:
    """``platform.deepseek_v4_block_qualname`` checks that the module exists before naming it."""
    func = plugin_function("platform.py", "deepseek_v4_block_qualname")
    return func is not None and "v4_module_exists" in ast.unparse(func)


def v4_blocks(src: SourceTree) -> Result:
    notes, problems, absent = [], [], []
    for family, module in block_modules().items():
        cls = src.find_class(module, "DeepseekV4DecoderLayer")
        if cls is None:
            absent.append(family)
            continue
        init = src.find_function(module, "__init__", cls="DeepseekV4DecoderLayer")
        fwd = src.find_function(module, "forward", cls="DeepseekV4DecoderLayer")
        if extra := [p for p in required_params(init) if p not in BLOCK_ARGS]:
            problems.append(f"{family} requires {extra}")
        if not {"x", "positions", "input_ids"} <= set(params(fwd)):
            problems.append(f"{family} forward({', '.join(params(fwd)[1:])})")
        notes.append(family)
    detail = f"blocks: {', '.join(notes)}"
    if problems:
        return Result("fail", "; ".join(problems))
    if absent:
        how = ("the plugin stops with a clear error there" if plugin_stops_cleanly_without_block()
               else "the plugin would fail with a bare ImportError")
        return Result("handled" if plugin_stops_cleanly_without_block() else "fail",
                      f"{detail}; no {', '.join(absent)} block: {how}")
    return Result("ok", detail)


def hc_head_op(src: SourceTree) -> Result:
    """``HCHeadOp``: kernels per platform; ``forward_native`` raises, so out-of-tree platforms get
    the plugin's portable op (``ops.py``)."""
    module = "vllm.model_executor.layers.mhc"
    cls = src.find_class(module, "HCHeadOp")
    if cls is None:
        return Result("fail", "no HCHeadOp in model_executor/layers/mhc.py")
    methods = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
    kernels = sorted(m.removeprefix("forward_") for m in methods
                     if m.startswith("forward_") and m != "forward_native")
    native = src.find_function(module, "forward_native", cls="HCHeadOp")
    raises = native is not None and any(isinstance(n, ast.Raise) for n in ast.walk(native))
    detail = f"kernels {'/'.join(kernels)}; native {'raises' if raises else 'computes'}"
    if "hc_head" not in string_constants(cls) and not any(
            "hc_head" in ast.unparse(d) for d in cls.decorator_list):
        return Result("fail", f"{detail}; not registered as 'hc_head'")
    if "cpu" not in kernels:
        cpu_block = src.find_class(block_modules()["cpu"], "DeepseekV4DecoderLayer")
        if cpu_block is None and plugin_stops_cleanly_without_block():
            return Result("handled", f"{detail}; no CPU V4 block either (clear error first)")
        return Result("fail", f"{detail}; CPU would hit the raising native path")
    return Result("ok", detail)


def register_oot(src: SourceTree) -> Result:
    module = "vllm.model_executor.custom_op"
    func = src.find_function(module, "register_oot", cls="CustomOp")
    registry = src.defines(module, "op_registry_oot")
    ok = func is not None and "name" in params(func) and registry
    return Result("ok" if ok else "fail", "" if ok else "CustomOp.register_oot/op_registry_oot")


def attn_sink_loading(src: SourceTree) -> Result:
    """Who narrows ``attn_sink`` to this rank's heads: the plugin's rule (plain parameter) or the
    parameter's own ``weight_loader`` (``make_attention_sink``). It must happen exactly once."""
    tree = src.tree(f"{V4}.attention")
    if tree is None:
        return Result("info", "no deepseek_v4/attention.py")
    made = [ast.unparse(n.value.func) for n in ast.walk(tree) if isinstance(n, ast.Assign)
            and any(ast.unparse(t) == "self.attn_sink" for t in n.targets)
            and isinstance(n.value, ast.Call)]
    if not made:
        return Result("fail", "attn_sink not created in attention.py")
    if made[0].endswith("Parameter"):
        return Result("ok", "plain Parameter: the plugin's rule narrows per rank")
    loader = "weight_loader" in ast.unparse(
        src.find_function("vllm.model_executor.model_loader.weight_utils", made[0]) or ast.Pass())
    rule = plugin_function("weights/v4.py", "attn_sink_for_rank")
    defers = rule is not None and "narrows_per_rank" in ast.unparse(rule)
    what = f"{made[0]}(){' with its own weight_loader' if loader else ''}"
    if not loader:
        return Result("ok", what)
    return Result("handled" if defers else "fail",
                  f"{what}: {'the rule defers to it' if defers else 'the rule narrows again'}")
