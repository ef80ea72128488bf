"""Patch ``mla_dtype_on_amx``: on a CPU with AMX, an fp32 DeepSeek engine gets ``CPU_MLA`` (target
and drafter) and the reference backend's KV cache and scheduler settings; bf16 keeps ``AMX_MLA``.

Runs on every CPU: vLLM's choices are driven as on an AMX CPU (``torch.cpu.
_is_amx_tile_supported`` answers True; it is what ``platforms/cpu.py`` asks), the configs are
built as ``LLM(...)`` builds them (no engine starts). On a CPU with AMX the engines of the rest of
the suite run fp32 through the patch for real (docs/testing.md, hardware table).
"""

import pytest
import torch

from vllm_mtp_plugin.patches import mla_dtype_on_amx

CPU_MLA = "vllm.v1.attention.backends.mla.cpu_mla.CPUMLABackend"
AMX_MLA = "vllm.v1.attention.backends.mla.amx_mla.AMXMLABackend"


@pytest.fixture
def as_on_amx(monkeypatch):
    """vLLM's platform sees AMX tiles; the patch is applied (a no-op where it already is)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU platform only")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert mla_dtype_on_amx.probe() is None
    mla_dtype_on_amx.mla_dtype_on_amx()
    return type(current_platform)


def _choose(platform, dtype, selected=None, patched=True):
    from vllm.v1.attention.selector import AttentionSelectorConfig

    config = AttentionSelectorConfig(head_size=576, dtype=dtype, kv_cache_dtype=None,
                                     block_size=16, use_mla=True)
    choose = platform.get_attn_backend_cls
    if not patched:
        return choose.__func__.__wrapped__(platform, selected, config)
    return choose(selected, config)


def test_the_backend_follows_the_dtype_for_target_and_drafter(as_on_amx):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert _choose(as_on_amx, torch.float32) == CPU_MLA
    assert _choose(as_on_amx, torch.float32, AttentionBackendEnum.AMX_MLA) == CPU_MLA
    assert _choose(as_on_amx, torch.bfloat16) == AMX_MLA
    # vLLM alone: AMX_MLA for fp32, which stops at load ("expect weight to be bfloat16, ...").
    assert _choose(as_on_amx, torch.float32, patched=False) == AMX_MLA


def _engine_config(model, dtype: str, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), dtype=dtype, max_model_len=256,
                      speculative_config={"method": "mtp", "num_speculative_tokens": 1},
                      **kwargs).create_engine_config()


def test_an_fp32_engine_is_configured_for_cpu_mla(as_on_amx, checkpoints, monkeypatch):
    import logging

    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    said = []  # the patch's own lines (vLLM's logging set-up may leave no handler a test sees)

    class Kept(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    logger = logging.getLogger("test_amx_mla_dtype")
    logger.addHandler(Kept())
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    monkeypatch.setattr(mla_dtype_on_amx, "logger", logger)

    model = checkpoints("oracle")
    fp32 = _engine_config(model, "float32")
    assert fp32.attention_config.backend == AttentionBackendEnum.CPU_MLA
    # vLLM's settings for its reference MLA backend (platforms/cpu.py), as on CPUs without AMX.
    assert fp32.cache_config.block_size == 16
    assert not fp32.cache_config.enable_prefix_caching
    assert not fp32.scheduler_config.enable_chunked_prefill
    bf16 = _engine_config(model, "bfloat16")
    assert bf16.attention_config.backend is None
    assert bf16.cache_config.block_size == 128 and bf16.cache_config.enable_prefix_caching
    named = _engine_config(model, "float32", attention_backend="AMX_MLA")
    assert named.attention_config.backend == AttentionBackendEnum.CPU_MLA
    assert "vllm-mtp-plugin: mla_dtype_on_amx: MLA in torch.float32 runs on CPU_MLA (AMX_MLA " \
        "holds bfloat16 weights only)" in said


def test_not_applied_without_amx(monkeypatch):
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU platform only")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert mla_dtype_on_amx.probe().startswith("no AMX tiles")
