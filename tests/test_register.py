"""The entry point: lazy, idempotent, logged once, and discoverable by vLLM."""

import subprocess
import sys
from importlib.metadata import entry_points

import vllm_mtp_plugin


def test_entry_point_is_declared():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps["vllm_mtp_plugin"] == "vllm_mtp_plugin:register"


def test_importing_the_package_imports_neither_torch_nor_vllm():
    code = "import sys, vllm_mtp_plugin; print('torch' in sys.modules, 'vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_register_is_idempotent_lazy_and_logs_once():
    code = """
import logging, sys
records = []
class Keep(logging.Handler):
    def emit(self, record): records.append(record.getMessage())
import vllm_mtp_plugin
from vllm import ModelRegistry
plugin_logger = logging.getLogger("vllm.vllm_mtp_plugin")
plugin_logger.addHandler(Keep()); plugin_logger.setLevel(logging.INFO)
vllm_mtp_plugin.register(); vllm_mtp_plugin.register()
print(sum("vllm-mtp-plugin" in r for r in records))
print("vllm_mtp_plugin.models" in sys.modules)
print(ModelRegistry.models["DeepSeekMTPModel"].module_name)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "False", "vllm_mtp_plugin.models.v3"]


def test_architecture_table_points_at_importable_classes():
    for arch, target in vllm_mtp_plugin.ARCHITECTURES.items():
        module, _, cls = target.partition(":")
        assert module.startswith("vllm_mtp_plugin.models."), arch
        assert cls
