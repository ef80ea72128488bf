"""``mla_verify_as_decode`` without an engine: the decode rows the patched builder makes, and the
attention they give through vLLM's own ``CPUMLAImpl.forward_mqa`` (weight-absorbed,
``mla_decode_kvcache``) against the prefill path's computation (latent up-projected through
``kv_b_proj``, causal SDPA) on random inputs; the probe, and a changed vLLM left alone (the
engines: ``tests/engine/patches/test_mla_verify.py``)."""

import importlib
import logging

import pytest
import torch

from vllm_mtp_plugin import patches
from vllm_mtp_plugin.patches import mla_verify_as_decode


LATENT, ROPE, BLOCK = 512, 64, 16  # what vLLM's CPU MLA kernel is built for


@pytest.fixture(scope="module")
def cpu_mla():
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    return importlib.import_module(mla_verify_as_decode.CPU_MLA_MODULE)


@pytest.fixture
def patched_builder(cpu_mla, monkeypatch):
    """The builder the patch gives ``CPUMLABackend`` (vLLM's own restored afterwards)."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder

    backend = cpu_mla.CPUMLABackend  # vLLM 0.32's builder, whether or not the plugin ran here
    monkeypatch.setattr(backend, "get_builder_cls", staticmethod(lambda: MLACommonMetadataBuilder))
    mla_verify_as_decode._install(cpu_mla)
    builder = backend.get_builder_cls()
    assert issubclass(builder, mla_verify_as_decode.DecodeRowPerQueryToken)
    return builder


def test_decode_rows_give_each_query_token_its_causal_length():
    qsl = torch.tensor([0, 1, 4, 6], dtype=torch.int32)
    rows, seq_lens = mla_verify_as_decode.decode_rows(qsl, torch.tensor([10, 20, 5]), 6)
    assert rows.tolist() == [0, 1, 1, 1, 2, 2]
    assert seq_lens.tolist() == [10, 18, 19, 20, 4, 5]
    assert mla_verify_as_decode.decode_rows(torch.tensor([0, 1, 2]), torch.tensor([7, 9]), 2) is None
    with pytest.raises(RuntimeError, match=r"query lengths \[1, 3\] do not add up to 5 decode "
                                           r"tokens; run with VLLM_MTP_MLA_VERIFY=0"):
        mla_verify_as_decode.decode_rows(torch.tensor([0, 1, 4]), torch.tensor([7, 9]), 5)


def prefill_path_attention(q_nope, q_pe, latent, w_uk, w_uv, scale, positions):
    """What vLLM's prefill path computes for one query token at each ``positions`` entry: keys
    and values up-projected from the cached latent (``kv_b_proj``), causal softmax attention."""
    kv_c, k_pe = latent[:, :LATENT], latent[:, LATENT:]
    k_nope = torch.einsum("sl,lhd->shd", kv_c, w_uk)
    values = torch.einsum("sl,lhd->shd", kv_c, w_uv)
    out = []
    for t, pos in enumerate(positions):
        scores = (torch.einsum("hd,shd->hs", q_nope[t], k_nope[: pos + 1])
                  + torch.einsum("hd,sd->hs", q_pe[t], k_pe[: pos + 1])) * scale
        out.append(torch.einsum("hs,shd->hd", scores.softmax(-1), values[: pos + 1]))
    return torch.stack(out)


def test_decode_path_equals_the_prefill_path_on_random_inputs(cpu_mla, patched_builder):
    """Three requests: 1, 2 and 4 query tokens (one decode, k = 1 and k = 3 verifications) over
    contexts of 17, 38 and 50 tokens in scattered blocks; fp32."""
    gen = torch.Generator().manual_seed(0)
    heads, nope, v_dim = 4, 32, 32
    scale = (nope + ROPE) ** -0.5
    seq_lens, query_lens = [17, 38, 50], [1, 2, 4]
    blocks_per_req = [(s + BLOCK - 1) // BLOCK for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    block_table = torch.zeros(3, max(blocks_per_req) + 2, dtype=torch.int32)
    cache = torch.randn(num_blocks, BLOCK, LATENT + ROPE, generator=gen)
    for r, n in enumerate(blocks_per_req):
        block_table[r, :n] = torch.tensor([order.pop() for _ in range(n)])
    w_uk = torch.randn(LATENT, heads, nope, generator=gen) / LATENT ** 0.5
    w_uv = torch.randn(LATENT, heads, v_dim, generator=gen) / LATENT ** 0.5
    tokens = sum(query_lens)
    q_nope = torch.randn(tokens, heads, nope, generator=gen)
    q_pe = torch.randn(tokens, heads, ROPE, generator=gen)
    qsl = torch.tensor([0, 1, 3, 7], dtype=torch.int32)

    builder = object.__new__(patched_builder)  # _build_decode reads nothing from the instance
    decode = builder._build_decode(
        block_table_tensor=block_table, seq_lens_device=torch.tensor(seq_lens, dtype=torch.int32),
        max_seq_len=max(seq_lens), query_start_loc_cpu=qsl, query_start_loc_device=qsl,
        num_decode_tokens=tokens, max_query_len=4, dcp_tot_seq_lens_device=None)
    assert decode.seq_lens.tolist() == [17, 37, 38, 47, 48, 49, 50]
    impl = cpu_mla.CPUMLAImpl(
        heads, LATENT + ROPE, scale, 1, None, None, "auto", None, "decoder", None,
        q_lora_rank=None, kv_lora_rank=LATENT, qk_nope_head_dim=nope, qk_rope_head_dim=ROPE,
        qk_head_dim=nope + ROPE, v_head_dim=v_dim, kv_b_proj=None)
    absorbed = torch.einsum("thd,lhd->thl", q_nope, w_uk)  # what forward_impl does before
    latent_out, _ = impl.forward_mqa((absorbed, q_pe), cache, _Metadata(decode), None)
    decode_path = torch.einsum("thl,lhd->thd", latent_out, w_uv)

    expected = []
    for r, (s, q) in enumerate(zip(seq_lens, query_lens)):
        latent = cache[block_table[r, : blocks_per_req[r]].long()].reshape(-1, LATENT + ROPE)
        first = qsl[r].item()
        expected.append(prefill_path_attention(
            q_nope[first:first + q], q_pe[first:first + q], latent[:s], w_uk, w_uv, scale,
            range(s - q, s)))
    torch.testing.assert_close(decode_path, torch.cat(expected), rtol=1e-5, atol=1e-5)
    # The same request without its speculative tokens: one row, vLLM's metadata untouched.
    single = builder._build_decode(
        block_table_tensor=block_table, seq_lens_device=torch.tensor(seq_lens, dtype=torch.int32),
        max_seq_len=50, query_start_loc_cpu=torch.tensor([0, 1, 2, 3]),
        query_start_loc_device=None, num_decode_tokens=3, max_query_len=1,
        dcp_tot_seq_lens_device=None)
    assert single.block_table is block_table and single.seq_lens.tolist() == seq_lens


class _Metadata:
    def __init__(self, decode):
        self.decode = decode


def test_probe_is_on_for_cpus_and_off_with_the_switch(monkeypatch):
    assert mla_verify_as_decode.probe() is None
    monkeypatch.setenv("VLLM_MTP_MLA_VERIFY", "0")
    assert mla_verify_as_decode.probe() == "switched off (VLLM_MTP_MLA_VERIFY=0)"
    (entry,) = [p for p in patches.REGISTER_PATCHES if p.name == "mla_verify_as_decode"]
    assert entry.apply is mla_verify_as_decode.mla_verify_as_decode and entry.unpatched == mla_verify_as_decode.UNPATCHED


@pytest.mark.parametrize("change", ["forward_mqa", "_build_decode"])
def test_a_changed_vllm_is_left_alone_with_a_warning_naming_it(cpu_mla, monkeypatch, plugin_log,
                                                                 change):
    from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder

    backend = cpu_mla.CPUMLABackend
    monkeypatch.setattr(backend, "get_builder_cls", staticmethod(lambda: MLACommonMetadataBuilder))
    if change == "forward_mqa":
        def forward_mqa(self, q, kv_cache, attn_metadata, layer):
            return attn_metadata.decode.req_to_token  # reads other metadata
        monkeypatch.setattr(cpu_mla.CPUMLAImpl, "forward_mqa", forward_mqa)
        missing = ("decode.block_table, decode.seq_lens, mla_decode_kvcache_cpu in "
                   "test_a_changed_vllm_is_left_alone_with_a_warning_naming_it.<locals>.forward_mqa")
    else:
        class Renamed(MLACommonMetadataBuilder):
            def _build_decode(self, block_table, seq_lens, max_seq_len, query_start_loc_cpu,
                              query_start_loc_device, num_decode_tokens, max_query_len,
                              dcp_tot_seq_lens_device):
                raise AssertionError
        monkeypatch.setattr(backend, "get_builder_cls", staticmethod(lambda: Renamed))
        missing = "keyword(s) block_table_tensor, seq_lens_device of Renamed._build_decode"
    before = backend.get_builder_cls
    mla_verify_as_decode._install(cpu_mla)
    assert backend.get_builder_cls is before
    warnings = [r.getMessage() for r in plugin_log.records if r.levelno == logging.WARNING]
    assert warnings == [f"vllm-mtp-plugin: mla_verify_as_decode not applied: {missing} not "
                        f"found. {mla_verify_as_decode.UNPATCHED}"]


def test_a_builder_that_takes_multi_token_decodes_is_left_alone_quietly(cpu_mla, monkeypatch,
                                                                         plugin_log):
    from vllm.model_executor.layers.attention.mla_attention import (MLACommonMetadataBuilder,
                                                                    QueryLenSupport)

    class Fixed(MLACommonMetadataBuilder):
        query_len_support = QueryLenSupport.UNIFORM

    monkeypatch.setattr(cpu_mla.CPUMLABackend, "get_builder_cls", staticmethod(lambda: Fixed))
    mla_verify_as_decode._install(cpu_mla)
    assert cpu_mla.CPUMLABackend.get_builder_cls() is Fixed
    assert [r.levelno for r in plugin_log.records] == [logging.DEBUG]
