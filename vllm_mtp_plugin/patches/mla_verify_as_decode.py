"""Speculative verification through vLLM's CPU MLA decode kernel (patch ``mla_verify_as_decode``).

What it fixes: vLLM's CPU MLA backends (``v1/attention/backends/mla/cpu_mla.py``, and
``amx_mla.py``, which picks its builder up from the same base) keep the shared MLA builder's
``query_len_support = SINGLE_ONLY`` (``model_executor/layers/attention/mla_attention.py``), so
``reorder_batch_threshold`` stays 1 and every speculative verification (k + 1 query tokens per
request) goes down the prefill path. On ``CPU_MLA`` that path up-projects the whole cached latent
through ``kv_b_proj`` and runs SDPA over it, at every step and in every layer: measured on an AMD
EPYC without AVX-512 (fp32, batch 1), MTP at k = 1 ran at 0.54x the speed of not speculating.
The decode path (``forward_mqa`` -> ``ops.mla_decode_kvcache_cpu``, weight-absorbed) takes any
number of query rows, each with its own block-table row and sequence length; the k + 1 query
tokens of a request are k + 1 such rows over the same blocks with causal lengths
``S - k ... S`` (their KV is written before attention runs). This builds the decode metadata that
way: the builder says ``VARLEN`` (vLLM then sets ``reorder_batch_threshold`` to 1 + k, and a
request with up to k + 1 new tokens is a decode) and ``_build_decode`` gives every query token
its request's block-table row and its own causal length. Requests with more tokens (prompts) keep
the prefill path in the same batch; a prompt of at most k + 1 tokens is a decode, exact by the
same causal lengths. Without a speculative config vLLM leaves the threshold at 1 and every decode
row is one request, as before: nothing changes.

``AMX_MLA`` (bf16, chosen where the CPU has AMX) has the same limitation: its
``AMXMLAMetadataBuilder`` (``amx_mla.py``) sets no ``query_len_support``, so verification takes its
prefill path, ``forward_mha`` -> ``cpu_mla_extend``. That path is weight-absorbed already (no
``kv_b_proj`` up-projection), so less is at stake there; its decode kernel (``cpu_mla_decode``)
reads ``req_to_token``, ``req_pool_indices`` and ``seq_lens_i64``, which its ``build`` derives from
``decode.block_table`` and ``decode.seq_lens``: the same per-token rows reach it, and it is covered
the same way.

How to see it: serve a DeepSeek-V3 MTP model on CPU in fp32 with ``--speculative-config
'{"method": "mtp", "num_speculative_tokens": 1}'`` and compare tokens/s with and without it
(``vllm-mtp bench``); ``VLLM_MTP_MLA_VERIFY=0`` leaves vLLM's path in place for comparison. When it
can go: when vLLM's CPU MLA builder supports multi-token decode queries (the probe then finds its
``query_len_support`` is no longer ``SINGLE_ONLY`` and leaves vLLM alone).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import sys

from .framework import NotFound, Patch, cpu_only, logger
from .import_hooks import after_import

NAME = "mla_verify_as_decode"
SWITCH = "VLLM_MTP_MLA_VERIFY"
CPU_MLA_MODULE = "vllm.v1.attention.backends.mla.cpu_mla"
AMX_MLA_MODULE = "vllm.v1.attention.backends.mla.amx_mla"
# The keyword arguments vLLM's ``build`` passes to ``_build_decode`` that this reads or replaces.
BUILD_DECODE_ARGS = ("block_table_tensor", "seq_lens_device", "query_start_loc_cpu",
                     "num_decode_tokens")


@dataclasses.dataclass(frozen=True)
class Backend:
    """One of vLLM's CPU MLA backends, and what must hold for per-token decode rows to reach its
    kernel: ``impl_reads`` in its ``forward_mqa``, ``builder_reads`` in its builder's ``build``
    (where that derives the kernel's arguments from ``decode.block_table`` and ``seq_lens``)."""

    module: str
    backend: str
    impl: str
    impl_reads: tuple[str, ...]
    builder_reads: tuple[str, ...] = ()


BACKENDS = (
    Backend(CPU_MLA_MODULE, "CPUMLABackend", "CPUMLAImpl",
            ("decode.block_table", "decode.seq_lens", "mla_decode_kvcache_cpu")),
    Backend(AMX_MLA_MODULE, "AMXMLABackend", "AMXMLAImpl",
            ("decode.seq_lens_i64", "decode.req_to_token", "decode.req_pool_indices",
             "cpu_mla_decode"),
            ("decode.block_table", "decode.seq_lens")),
)
# What may go wrong without the patch (``Patch.unpatched``).
UNPATCHED = (
    "Speculative decoding with a DeepSeek (MLA) model on CPU then verifies its drafts through "
    "the prefill path, which up-projects the whole cached latent at every step: MTP may run "
    "slower than not speculating (measure with `vllm-mtp bench`).")


def probe() -> str | None:
    """Needed on CPU platforms whose vLLM has the CPU MLA backend; whether its builder still
    takes single-token decodes only is checked when vLLM imports it (``_install``), without
    importing it here (seconds, and most processes never serve an MLA model)."""
    from pathlib import Path

    import vllm

    if os.environ.get(SWITCH, "1").strip() == "0":
        return f"switched off ({SWITCH}=0)"
    if reason := cpu_only():
        return reason
    relative = CPU_MLA_MODULE.removeprefix("vllm.").replace(".", "/") + ".py"
    if not (Path(vllm.__file__).parent / relative).is_file():
        return NotFound(f"module {CPU_MLA_MODULE} not found")
    return None


def mla_verify_as_decode() -> None:
    """Verify speculative tokens through vLLM's CPU MLA decode kernels (module docstring).
    Applied to each backend when vLLM imports it (``import_hooks.after_import``)."""
    for backend in BACKENDS:
        after_import(backend.module, functools.partial(_install, backend=backend))


def decode_rows(query_start_loc_cpu, seq_lens, num_decode_tokens: int):
    """``(rows, causal_seq_lens)``, one entry per decode query token: the request it belongs to
    and how many tokens it attends to (its request's length less the query tokens after it).
    ``None`` when every decode request has one token (vLLM's metadata is already per token)."""
    import torch

    num_requests = query_start_loc_cpu.numel() - 1
    query_lens = query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]
    if num_decode_tokens == num_requests and bool((query_lens == 1).all()):
        return None
    if int(query_start_loc_cpu[-1]) != num_decode_tokens or bool((query_lens < 0).any()):
        raise RuntimeError(
            f"{NAME}: the decode requests' query lengths {query_lens.tolist()} do not add up to "
            f"{num_decode_tokens} decode tokens; run with {SWITCH}=0 and report this vLLM "
            "version.")
    device = seq_lens.device
    rows = torch.repeat_interleave(torch.arange(num_requests, device=device),
                                   query_lens.to(device), output_size=num_decode_tokens)
    later = query_start_loc_cpu[1:].to(device)[rows] - 1 - torch.arange(
        num_decode_tokens, device=device)
    return rows, seq_lens[rows] - later.to(seq_lens.dtype)


class DecodeRowPerQueryToken:
    """Mixed into a CPU MLA backend's metadata builder: one decode row per query token (module
    docstring). ``_install`` makes the class, with ``query_len_support = VARLEN``."""

    backend_name = ""
    _announced: set = set()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.reorder_batch_threshold > 1 and self.backend_name not in self._announced:
            self._announced.add(self.backend_name)
            logger.info("vllm-mtp-plugin: %s: %s verifies up to %d query tokens per request "
                        "through its decode kernel", NAME, self.backend_name,
                        self.reorder_batch_threshold)

    def _build_decode(self, **kwargs):
        rows = decode_rows(kwargs["query_start_loc_cpu"], kwargs["seq_lens_device"],
                           kwargs["num_decode_tokens"])
        if rows is not None:
            index, seq_lens = rows
            kwargs["block_table_tensor"] = kwargs["block_table_tensor"][index]
            kwargs["seq_lens_device"] = seq_lens
        return super()._build_decode(**kwargs)


def _not_applied(what: str) -> None:
    logger.warning("vllm-mtp-plugin: %s not applied: %s not found. %s", NAME, what, UNPATCHED)


def _unread(function, names: tuple[str, ...]) -> list[str]:
    source = inspect.getsource(function)
    return [name for name in names if name not in source]


def _install(module, backend: Backend = BACKENDS[0]) -> None:
    """Give one of vLLM's CPU MLA backends a builder with one decode row per query token.

    Run when vLLM has imported the backend's module. What it looks for and does not find (the
    backend, its builder's ``_build_decode`` keywords, the metadata its ``forward_mqa`` and
    builder read) leaves vLLM as it is with one warning naming it; a builder that already takes
    multi-token decodes is left alone quietly.
    """
    from vllm.model_executor.layers.attention import mla_attention

    cls, impl = getattr(module, backend.backend, None), getattr(module, backend.impl, None)
    support = getattr(mla_attention, "QueryLenSupport", None)
    if cls is None or impl is None or support is None:
        missing = [f"{module.__name__}.{n}" for n, o in ((backend.backend, cls),
                                                         (backend.impl, impl)) if o is None]
        _not_applied(" and ".join(missing or [f"{mla_attention.__name__}.QueryLenSupport"]))
        return
    base = cls.get_builder_cls()
    if issubclass(base, DecodeRowPerQueryToken):
        return
    if getattr(base, "query_len_support", None) != support.SINGLE_ONLY:
        logger.debug("vllm-mtp-plugin: %s not needed: %s.query_len_support is %s", NAME,
                     base.__name__, getattr(base, "query_len_support", None))
        return
    params = inspect.signature(base._build_decode).parameters
    missing = [name for name in BUILD_DECODE_ARGS if name not in params]
    if missing:
        _not_applied(f"keyword(s) {', '.join(missing)} of {base.__name__}._build_decode")
        return
    for function, names in ((impl.forward_mqa, backend.impl_reads),
                            (base.build, backend.builder_reads)):
        unread = _unread(function, names)
        if unread:
            _not_applied(f"{', '.join(unread)} in {function.__qualname__}")
            return
    name = f"{base.__name__}DecodeRowPerQueryToken"
    builder = type(name, (DecodeRowPerQueryToken, base),
                   {"__module__": __name__, "query_len_support": support.VARLEN,
                    "backend_name": cls.get_name()})
    setattr(sys.modules[__name__], name, builder)  # picklable by qualified name
    cls.get_builder_cls = staticmethod(_builder_cls(builder))


def _builder_cls(builder: type):
    def get_builder_cls() -> type:
        return builder

    return get_builder_cls


PATCH = Patch(NAME, probe, mla_verify_as_decode, UNPATCHED)
