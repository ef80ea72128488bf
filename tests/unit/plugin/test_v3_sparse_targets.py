"""DeepSeek-V3.2 / GLM-5 (DSA) targets reach our ``DeepSeekMTPModel`` class on vLLM releases that
route them to that architecture name (0.27); it hands them to vLLM's own class, which builds the
indexer's buffers. Checked on a config object, without an engine: vLLM's CPU build cannot run DSA.
"""

import logging
from types import SimpleNamespace

import pytest
from support.logs import plugin_log
from transformers import PretrainedConfig

import vllm.model_executor.models.deepseek_mtp as in_tree_module
from vllm_mtp_plugin.models import v3
from vllm_mtp_plugin.models.v3 import DeepSeekMTP, uses_sparse_attention


def draft_config(model_type: str, **fields) -> PretrainedConfig:
    """The draft hf_config as vLLM makes it from a target config (``hf_config_override``)."""
    from vllm.config.speculative import SpeculativeConfig

    config = PretrainedConfig(architectures=["DeepseekV3ForCausalLM"], num_nextn_predict_layers=1,
                              num_hidden_layers=2, **fields)
    config.model_type = model_type
    return SpeculativeConfig.hf_config_override(config)


def vllm_config(draft, target_type):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=draft)),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type=target_type)))


@pytest.fixture
def in_tree(monkeypatch):
    """vLLM's class, replaced by a stand-in that records how it was built."""
    built = []

    class InTree:
        def __init__(self, *, vllm_config, prefix=""):
            built.append((vllm_config, prefix))

    monkeypatch.setattr(in_tree_module, "DeepSeekMTP", InTree)
    return InTree, built


@pytest.mark.parametrize("target_type", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_attention_targets_get_vllms_class_with_one_log_line(in_tree, target_type):
    cls, built = in_tree
    config = vllm_config(draft_config(target_type, index_topk=2048), target_type)
    with plugin_log(logging.INFO, v3.logger) as lines:
        drafter = DeepSeekMTP(vllm_config=config, prefix="draft")
    assert type(drafter) is cls and built == [(config, "draft")]
    (line,) = lines
    assert target_type in line and f"vLLM's own {cls.__module__}:InTree" in line


def test_v3_targets_keep_our_class(in_tree):
    _, built = in_tree
    config = vllm_config(draft_config("deepseek_v3"), "deepseek_v3")
    assert not uses_sparse_attention(config.speculative_config.draft_model_config.hf_config)
    drafter = DeepSeekMTP.__new__(DeepSeekMTP, vllm_config=config, prefix="draft")
    assert isinstance(drafter, DeepSeekMTP) and built == []
