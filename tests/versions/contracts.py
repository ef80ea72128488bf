"""The vLLM contracts the plugin depends on, each a named check on one source tree.

A check returns a ``Result``: ``ok`` (as the plugin expects), ``handled`` (differs, and the plugin
copes: the detail says how), ``fail`` (differs and the plugin would break) or ``info`` (reported,
not relied on). Whether the plugin copes is read from the plugin's own source, so a fix shows up
here without editing this file.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from source_facts import (SourceTree, assigned_attributes, dict_entry, params, required_params,
                          signature, string_constants)

PLUGIN = Path(__file__).resolve().parents[2] / "vllm_mtp_plugin"
SPEC = "vllm.config.speculative"
V4 = "vllm.models.deepseek_v4"


@dataclasses.dataclass
class Result:
    status: str  # ok | handled | fail | info
    detail: str = ""

    def cell(self) -> str:
        text = {"ok": "ok", "handled": "differs (handled)", "fail": "FAILS", "info": "info"}[
            self.status]
        return f"{text}: {self.detail}" if self.detail else text


def plugin_source(relative: str) -> str:
    return (PLUGIN / relative).read_text(encoding="utf-8")


def plugin_function(relative: str, name: str):
    """The (possibly nested) function ``name`` in a plugin module."""
    tree = ast.parse(plugin_source(relative))
    return next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name),
                None)


# ---------------------------------------------------------------------------------------------


def hf_config_override_params(src: SourceTree) -> Result:
    """vLLM calls the (patched) override with the parameters of its own definition; the plugin's
    wrapper (``patches/check_mtp_checkpoint.py: hf_config_override``) must accept them all."""
    func = src.find_function(SPEC, "hf_config_override", cls="SpeculativeConfig")
    if func is None:
        return Result("fail", "SpeculativeConfig.hf_config_override not found")
    theirs = params(func)
    calls = call_forms(src)
    ours = params(plugin_function("patches/check_mtp_checkpoint.py", "hf_config_override"))
    accepts = any(p.startswith("*") for p in ours) or set(theirs) <= set(ours)
    detail = f"{signature(func)}; called {calls}"
    if theirs == ["hf_config"]:
        return Result("ok", detail)
    if accepts:
        return Result("handled", f"{detail}; the plugin's wrapper takes ({', '.join(ours)})")
    return Result("fail", f"{detail}; the plugin's wrapper takes only ({', '.join(ours)})")


def call_forms(src: SourceTree) -> str:
    """How speculative.py calls the override: positional arity and ``partial`` keywords."""
    forms = set()
    for node in ast.walk(src.tree(SPEC)):
        if not isinstance(node, ast.Call):
            continue
        text = ast.unparse(node.func)
        if text.endswith("hf_config_override"):
            forms.add(f"with {len(node.args)} positional")
        elif text.endswith("partial") and node.args and ast.unparse(node.args[0]).endswith(
                "hf_config_override"):
            forms.add("partial(" + ", ".join(f"{k.arg}=" for k in node.keywords) + ")")
    if any("return SpeculativeConfig.hf_config_override" in ast.unparse(n)
           for n in ast.walk(src.tree(SPEC)) if isinstance(n, ast.Return)):
        forms.add("as hf_overrides")
    return " and ".join(sorted(forms)) or "nowhere"


def v32_target_architecture(src: SourceTree) -> Result:
    """Which architecture ``deepseek_v32``/``glm_moe_dsa`` targets get. ``DeepSeekMTPModel`` means
    our V3 class receives V3.2 configs; it must hand them to vLLM's class (indexer buffers)."""
    func = src.find_function(SPEC, "hf_config_override", cls="SpeculativeConfig")
    consts = string_constants(func) if func else set()
    if "deepseek_v32" not in consts:
        return Result("info", "no deepseek_v32 mapping")
    if "DeepseekV32MTPModel" in consts:
        return Result("ok", "DeepseekV32MTPModel (vLLM's class)")
    v3 = ast.parse(plugin_source("models/v3.py"))
    hands_over = any(isinstance(n, ast.FunctionDef) and n.name == "__new__" for n in ast.walk(v3))
    if hands_over:
        return Result("handled", "DeepSeekMTPModel; our V3 class builds vLLM's for V3.2 configs")
    return Result("fail", "DeepSeekMTPModel: our V3 class would build V3.2 without its indexer")


def registry_entries(src: SourceTree) -> Result:
    tree = src.tree("vllm.model_executor.models.registry")
    found = {}
    for arch in ("DeepSeekMTPModel", "DeepseekV32MTPModel", "DeepSeekV4MTPModel"):
        node = dict_entry(tree, "_SPECULATIVE_DECODING_MODELS", arch)
        found[arch] = ast.literal_eval(node)[0] if node is not None else None
    missing = [a for a in ("DeepSeekMTPModel", "DeepSeekV4MTPModel") if not found[a]]
    text = ", ".join(f"{a}->{m}" if m else f"no {a}" for a, m in found.items())
    return Result("fail" if missing else "ok", text)


def proposer_tuple_contract(src: SourceTree) -> Result:
    """V1 unpacks a tuple for the architecture names in ``model_returns_tuple``: V3 must be in the
    set (our V3 returns a tuple), V4 must not (our V4 returns one tensor)."""
    for module in ("vllm.v1.spec_decode.llm_base_proposer", "vllm.v1.spec_decode.eagle"):
        func = src.find_function(module, "model_returns_tuple", cls=proposer_class(src, module))
        if func is not None:
            names = string_constants(func)
            ok = "DeepSeekMTPModel" in names and "DeepSeekV4MTPModel" not in names
            tuple_archs = sorted(n for n in names if n.endswith("MTPModel") and "Deep" in n)
            return Result("ok" if ok else "fail",
                          f"{module.rsplit('.', 1)[1]}: tuple for {', '.join(tuple_archs)}")
    return Result("fail", "model_returns_tuple not found")


def proposer_class(src: SourceTree, module: str) -> str | None:
    tree = src.tree(module)
    for node in tree.body if tree else []:
        methods = [f.name for f in getattr(node, "body", []) if isinstance(f, ast.FunctionDef)]
        if isinstance(node, ast.ClassDef) and "model_returns_tuple" in methods:
            return node.name
    return None


def proposer_shares_embedding_and_head(src: SourceTree) -> Result:
    """A drafter without ``has_own_embed_tokens``/``has_own_lm_head`` gets the target's copies."""
    tree = src.tree("vllm.v1.spec_decode.llm_base_proposer")
    names = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)} if tree else set()
    ok = {"has_own_embed_tokens", "has_own_lm_head"} <= names
    return Result("ok" if ok else "fail", "" if ok else "sharing attributes not found")


def fused_moe_mapping(src: SourceTree) -> Result:
    """``platform.fused_moe_expert_params`` calls it with the keywords model,
    ckpt_gate_proj_name, ckpt_down_proj_name, ckpt_up_proj_name, num_experts."""
    func = src.find_function("vllm.model_executor.layers.fused_moe.layer",
                             "fused_moe_make_expert_params_mapping")
    if func is None:
        return Result("fail", "fused_moe_make_expert_params_mapping not found")
    head = params(func)[:5]
    want = ["model", "ckpt_gate_proj_name", "ckpt_down_proj_name", "ckpt_up_proj_name",
            "num_experts"]
    extra = [p for p in required_params(func) if p not in want]
    ok = head == want and not extra
    return Result("ok" if ok else "fail", signature(func) if not ok else "")


def decoder_layer(src: SourceTree) -> Result:
    """Our V3 layer builds ``DeepseekV2DecoderLayer(vllm_config, prefix, config=...)``, calls it
    with ``positions=, hidden_states=, residual=`` and reads ``mlp`` and
    ``use_sequence_parallel_moe``."""
    module = "vllm.model_executor.models.deepseek_v2"
    cls = src.find_class(module, "DeepseekV2DecoderLayer")
    init = src.find_function(module, "__init__", cls="DeepseekV2DecoderLayer")
    fwd = src.find_function(module, "forward", cls="DeepseekV2DecoderLayer")
    if cls is None or init is None or fwd is None:
        return Result("fail", "DeepseekV2DecoderLayer not found")
    problems = []
    if params(init)[1:3] != ["vllm_config", "prefix"] or "config" not in params(init):
        problems.append(signature(init))
    if extra := [p for p in required_params(init) if p not in ("self", "vllm_config", "prefix")]:
        problems.append(f"requires {extra}")
    if not {"positions", "hidden_states", "residual"} <= set(params(fwd)):
        problems.append(signature(fwd))
    if missing := {"mlp", "use_sequence_parallel_moe"} - assigned_attributes(cls):
        problems.append(f"no {sorted(missing)}")
    for name in ("DeepseekV2MoE", "DeepseekV2MixtureOfExperts"):
        if src.find_class(module, name) is None:
            problems.append(f"no {name}")
    return Result("fail" if problems else "ok",
                  "; ".join(problems) or signature(init).replace("__init__", "init"))


def torch_compile_decorator(src: SourceTree) -> Result:
    """Our V3 MTP layer class is decorated bare (``@support_torch_compile``, one compiled graph
    per layer): its first parameter is the class."""
    func = src.find_function("vllm.compilation.decorators", "support_torch_compile")
    if func is None:
        return Result("fail", "support_torch_compile not found")
    ok = params(func)[0] == "cls" and "cls" not in required_params(func)
    keywords = [p for p in params(func)[1:]]
    return Result("ok" if ok else "fail", f"keywords: {', '.join(keywords)}")


def completeness_scope(src: SourceTree) -> Result:
    """Weight sync (RL) loads MTP weights in chunks inside ``disable_mtp_completeness_check()``; a
    loader that insists on a complete MTP layer would fail there."""
    module = "vllm.model_executor.model_loader.mtp_validation"
    if src.find_function(module, "is_mtp_completeness_check_enabled") is None:
        return Result("ok", "no mtp_validation (every load is complete)")
    probe = plugin_function("platform.py", "mtp_completeness_check_enabled")
    loader = ast.parse(plugin_source("weights/loader.py"))
    used = any(isinstance(n, ast.Name) and n.id == "mtp_completeness_check_enabled"
               for n in ast.walk(loader))
    if probe is not None and used:
        return Result("ok", "present; the loader skips its completeness checks in that scope")
    return Result("fail", "present; the loader would reject partial (chunked) loads")


def spec_layer_helper(src: SourceTree) -> Result:
    """vLLM's V3 loader finds MTP tensors with it; the plugin uses its own table
    (``weights/v3.py``)."""
    func = src.find_function("vllm.model_executor.models.utils",
                             "get_spec_layer_idx_from_weight_name")
    return Result("info", signature(func) if func else "absent (not used by the plugin)")
