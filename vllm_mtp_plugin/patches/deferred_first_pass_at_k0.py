"""A k = 0 step no longer runs the MTP layer; the next step that runs it catches up first (patch
``deferred_first_pass_at_k0``, documented on the function that applies it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import dataclasses
import functools
import inspect
import os

from .framework import NotFound, Patch, logger, missing_in
from .import_hooks import after_import

if TYPE_CHECKING:  # annotations only
    import torch

NAME = "deferred_first_pass_at_k0"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
PROPOSER_MODULE = "vllm.v1.spec_decode.llm_base_proposer"
# What vLLM's proposer must still do for the patch to apply (read in its source).
PROPOSER_READS = ("if self.num_speculative_tokens == 0:", "set_inputs_first_pass")
# The parameters the wrappers read and pass by name.
PROPOSER_PARAMETERS = ("num_speculative_tokens", "target_token_ids", "target_positions",
                       "target_hidden_states", "next_token_ids", "token_indices_to_sample",
                       "common_attn_metadata", "sampling_metadata", "mm_embed_inputs")
RUNNER_PARAMETERS = ("scheduler_output", "sampled_token_ids", "sampling_metadata",
                     "hidden_states", "aux_hidden_states", "common_attn_metadata")
UNPATCHED = ("A step at k = 0 (adaptive k, or a num_speculative_tokens_per_batch_size table with "
             "k = 0) still runs the MTP layer over its tokens, as vLLM does: slower than serving "
             "without speculation by that layer's share of a step.")
_vllm_propose = None  # vLLM's SpecDecodeBaseProposer.propose, kept by _install_proposer
BACKLOG = "_mtp_first_pass_backlog"  # the drafter's backlog (None: not deferring)
STEP = "_mtp_first_pass_step"  # the runner's step, while it proposes
ALT_HIDDEN = "_mtp_drafter_reads_target_output"  # the runner's: not V4's other hidden states
SWITCH = "VLLM_MTP_DEFERRED_FIRST_PASS"  # 0: every k = 0 step runs the layer, as in vLLM


def switched_off() -> bool:
    return os.environ.get(SWITCH, "1").strip().lower() in ("0", "false", "off", "no")


def probe() -> str | None:
    """Needed wherever vLLM has per-step k (the dynamic table); what its proposer and runner
    look like is checked when vLLM imports them (``_install_*``)."""
    from vllm.config.speculative import SpeculativeConfig

    if "num_speculative_tokens_per_batch_size" not in getattr(SpeculativeConfig,
                                                               "__dataclass_fields__", {}):
        return "this vLLM has no per-step k (num_speculative_tokens_per_batch_size)"
    return None


def deferred_first_pass_at_k0() -> None:
    """At a k = 0 decode step, keep the MTP layer's inputs instead of running it; run them before
    the layer's next first pass.

    What it changes: vLLM's V1 proposer (``v1/spec_decode/llm_base_proposer.py`` ``propose``,
    ~512-610) runs the MTP layer over every step's tokens before it looks at k, also at k = 0,
    so that the layer's KV cache stays whole ("the prefill forward pass above already ran to
    keep the drafter KV cache in sync"). That forward is one layer beside a full target but a
    large share of a step on a target of few layers, and it is paid at every k = 0 step. Here a
    step that verifies nothing, schedules one token per request and drafts nothing keeps, per
    request, the token the layer would read, its position and the target's hidden state
    (``adaptive_k/first_pass_backlog.py``) and returns no drafts; the next step that runs the
    layer (one that drafts, verifies or prefills, or whose rows would not fit the drafter's
    buffer) first runs the kept rows of its requests as one query each through vLLM's own
    ``propose`` at k = 0, then its own pass: the cache ends as if the layer had run at every
    step, and the drafts are those of a layer that never skipped. Not deferred: a step with a
    sample vLLM throws away, or under async speculative decoding one whose positions are
    optimistic; with prefix caching a step where a kept block must hold the layer's KV (it may be
    shared as soon as it is full) catches the batch up at once. Applies to MTP drafters with
    per-step k on V1, not DeepSeek-V4's (hyper-connection states), nor with parallel drafting,
    M-RoPE or decode context parallelism (other input layouts); Model Runner V2 runs the layer at
    k = 0 as vLLM does. How to see it: adaptive k's engine test counts the layer's calls
    (``tests/engine/adaptive_k/test_adaptive_k.py``), and one skipping without catching up loses
    acceptance after k = 0 (the same file). When it can go: when vLLM's proposer skips k = 0
    steps itself and keeps the layer's cache whole.
    """
    after_import(PROPOSER_MODULE, _install_proposer)
    after_import(RUNNER_MODULE, _install_runner)


def _install_proposer(module) -> None:
    proposer = getattr(module, "SpecDecodeBaseProposer", None)
    propose = getattr(proposer, "propose", None)
    missing = [] if propose is None else missing_in(propose, PROPOSER_READS, PROPOSER_PARAMETERS)
    if propose is None or missing:
        logger.warning("vllm-mtp-plugin: %s not applied: %s. %s", NAME, NotFound(
            f"{PROPOSER_MODULE}.SpecDecodeBaseProposer.propose reading {missing}"), UNPATCHED)
        return
    global _vllm_propose
    if getattr(propose, "patch", None) != NAME:
        _vllm_propose = propose
        proposer.propose = _deferring(propose)


def _install_runner(module) -> None:
    runner = getattr(module, "GPUModelRunner", None)
    propose = getattr(runner, "propose_draft_token_ids", None)
    missing = [] if propose is None else [
        name for name in RUNNER_PARAMETERS if name not in inspect.signature(propose).parameters]
    if propose is None or missing:
        logger.warning("vllm-mtp-plugin: %s not applied: %s. %s", NAME, NotFound(
            f"{RUNNER_MODULE}.GPUModelRunner.propose_draft_token_ids taking {missing or 'it'}"),
            UNPATCHED)
        return
    if getattr(propose, "patch", None) != NAME:
        runner.propose_draft_token_ids = _deferring_runner(propose)


def _deferring_runner(propose_draft_token_ids):
    """The runner's side: which request each batch row is, which requests are gone (their kept
    rows go), whether the step may skip the layer. Such a step is deferred here, before vLLM prepares
    the drafter's inputs, where nothing else needs them (no async scheduling, which reads the
    prepared next tokens); otherwise the drafter's ``propose`` decides (``_deferring``)."""

    arguments = PassedArguments(propose_draft_token_ids)

    @functools.wraps(propose_draft_token_ids)
    def propose_draft_token_ids_deferring_k0(self, scheduler_output, sampled_token_ids, *args,
                                             **kwargs):
        drafter = getattr(self, "drafter", None)
        backlog = backlog_for(drafter) if getattr(drafter, "method", None) == "mtp" else None
        if backlog is None:
            return propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args,
                                           **kwargs)
        call = arguments.of((self, scheduler_output, sampled_token_ids) + args, kwargs)
        batch = self.input_batch
        n = batch.num_reqs
        req_ids = batch.req_ids[:n]
        # Rows of requests the runner no longer holds (finished, even at a step that drafted
        # nothing) or that were preempted (recomputed later) go.
        if backlog.next_position:
            backlog.forget([r for r in backlog.next_position if r not in self.requests])
            backlog.forget(getattr(scheduler_output, "preempted_req_ids", None) or ())
        # The common k = 0 decode step is told from Python objects the step has just updated;
        # the first touch of the runner's arrays after a forward costs more here than all of
        # the deferral's own work.
        may_skip = (scheduler_output.num_spec_tokens_to_schedule == 0 and backlog.fits(n)
                    and call("aux_hidden_states") is None)
        starts = None
        if (may_skip and not isinstance(sampled_token_ids, list)
                and not getattr(self, "use_async_spec_decode", False) and inputs_unread(self)):
            starts = decode_starts(self.requests, req_ids,
                                   scheduler_output.total_num_scheduled_tokens)
        cad = call("common_attn_metadata")
        step = Step(req_ids=req_ids, starts=starts if starts is not None else first_positions(cad),
                    cad=cad, sampling_metadata=call("sampling_metadata"))
        # Elsewhere (the drafter's propose decides, e.g. under async scheduling) from the arrays.
        step.deferrable = starts is not None or (
            may_skip and one_decode_token_each(cad, step.starts, batch.num_prompt_tokens[:n])
            and rows_are_final(self, n))
        if step.deferrable and backlog.prefix_caching:
            step.catch_up_all = any(
                start + 1 >= block_needed(backlog.first_position.get(r, start),
                                          drafter.block_size, backlog.block_drop)
                for r, start in zip(step.req_ids, step.starts))
        if starts is not None:
            self._draft_probs = None
            self._draft_prob_req_ids = None
            # [num_reqs, 1] at a step without drafts: one read-back, no slicing on the device
            next_tokens = [row[0] for row in sampled_token_ids.tolist()[:n]]
            defer(drafter, backlog, step, next_tokens, call("hidden_states")[:n],
                  sampled_token_ids.dtype)
            # No drafts, as vLLM's list-returning proposers (n-gram) give them: no device tensor
            # to copy to the host and read back for the scheduler (``_copy_draft_token_ids_to_cpu``,
            # ``take_draft_token_ids``). Not under async scheduling, whose next step reads a
            # tensor of drafts.
            if getattr(self, "use_async_scheduling", False):
                import torch

                return torch.empty(n, 0, dtype=torch.int64, device=sampled_token_ids.device)
            return [[] for _ in range(n)]
        setattr(drafter, STEP, step)
        try:
            return propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args,
                                           **kwargs)
        finally:
            setattr(drafter, STEP, None)

    propose_draft_token_ids_deferring_k0.patch = NAME
    return propose_draft_token_ids_deferring_k0


class PassedArguments:
    """The arguments of a call by parameter name, as ``inspect.Signature.bind`` gives them but
    without binding at every step: vLLM passes them by position (or by name)."""

    def __init__(self, function):
        self.index = {name: i for i, name in
                      enumerate(inspect.signature(function).parameters)}

    def of(self, args: tuple, kwargs: dict):
        index = self.index

        def argument(name: str):
            i = index[name]
            return args[i] if i < len(args) else kwargs.get(name)

        return argument


def rows_are_final(runner, n: int) -> bool:
    """The step's rows are what the layer would read: not under async speculative decoding after
    a step that verified drafts (positions optimistic, every draft assumed accepted; vLLM
    corrects them on the device; its record of that, filled for this step in
    ``_update_states``), and no request's sample thrown away."""
    if getattr(runner, "use_async_spec_decode", False):
        previous_drafts = getattr(runner, "prev_num_draft_tokens", None)
        if previous_drafts is None or previous_drafts.np.any():
            return False
    discarded = getattr(runner, "discard_request_mask", None)
    return discarded is None or not discarded.np[:n].any()


def inputs_unread(runner) -> bool:
    """Nothing but the drafter reads the inputs vLLM would prepare for it (so the runner may
    defer before preparing them): no copy of the valid-token count overlapping them (async
    scheduling), and the target hands the drafter its own output, not other hidden states
    (V4's; the model's class does not change while it serves, so this is asked once)."""
    if getattr(runner, "valid_sampled_token_count_event", None) is not None:
        return False
    own_output = getattr(runner, ALT_HIDDEN, None)
    if own_output is None:
        own_output = getattr(runner.get_model(), "get_mtp_target_hidden_states", None) is None
        setattr(runner, ALT_HIDDEN, own_output)
    return own_output


@dataclasses.dataclass
class Step:
    """The runner's step as the drafter sees it while it proposes."""

    req_ids: list[str]
    starts: list[int]  # where each request's tokens of the step start
    cad: object  # the step's CommonAttentionMetadata (block-table rows, slot dtype)
    sampling_metadata: object
    deferrable: bool = False
    # With prefix caching a full block may be handed to another request at once, so the layer's
    # KV in it must be written by then: a step where some request's kept rows reach that point
    # catches every request of the batch up (one forward), then nothing is due for a while.
    catch_up_all: bool = False


def block_needed(first_kept: int, block_size: int, block_drop: bool) -> int:
    """The context length at which the block of a request's first kept position must hold the
    layer's KV: when it is full, or, where vLLM recomputes the last block a prefix hit matches
    for MTP drafters (``use_eagle_block_drop``), when the block after it is full."""
    return (first_kept // block_size + (2 if block_drop else 1)) * block_size


def defer(drafter, backlog, step: Step, next_tokens: list[int], hidden: torch.Tensor,
          token_dtype) -> None:
    """Keep the step's rows, catch up at once the requests whose block the step filled; the
    caller answers with no drafts."""
    backlog.defer(step.req_ids, step.starts, next_tokens, hidden, token_dtype)
    if step.catch_up_all:
        catch_up = backlog.take(step.req_ids, [s + 1 for s in step.starts])
        if catch_up is not None:
            run_catch_up(_vllm_propose, drafter, catch_up, step.cad, step.sampling_metadata,
                         hidden.dtype)
    drafter.num_speculative_tokens = 0
    drafter._last_draft_probs = None


def backlog_for(drafter):
    """The drafter's backlog, made on its first step: None (never deferring) unless it is an MTP
    drafter with per-step k whose inputs are one row per token."""
    backlog = getattr(drafter, BACKLOG, False)
    if backlog is not False:
        return backlog
    from ..adaptive_k.first_pass_backlog import FirstPassBacklog

    config = drafter.speculative_config
    parallel = drafter.vllm_config.parallel_config
    hf_config = getattr(drafter.draft_model_config, "hf_config", None)
    eligible = (not switched_off() and drafter.method == "mtp"
                # a proposer of its own (another model's MTP) would never catch up
                and getattr(getattr(type(drafter), "propose", None), "patch", None) == NAME
                and getattr(config, "num_speculative_tokens_per_batch_size", None) is not None
                and not getattr(drafter, "needs_extra_input_slots", False)
                and not getattr(drafter, "uses_mrope", False)
                and getattr(parallel, "decode_context_parallel_size", 1) == 1
                and getattr(parallel, "prefill_context_parallel_size", 1) == 1
                and getattr(hf_config, "hc_mult", None) is None)
    backlog = None
    if eligible:
        cache = getattr(drafter.vllm_config, "cache_config", None)
        drop = getattr(config, "use_eagle_block_drop", None)
        backlog = FirstPassBacklog(
            drafter.max_num_tokens,
            prefix_caching=bool(getattr(cache, "enable_prefix_caching", False)),
            block_drop=bool(drop()) if callable(drop) else False)
    setattr(drafter, BACKLOG, backlog)
    if backlog is not None:
        logger.info("vllm-mtp-plugin: %s: k = 0 steps skip the MTP layer, the next step that "
                    "runs it catches up (at most %d rows kept)", NAME, backlog.capacity)
    return backlog


def _deferring(propose):
    """The drafter's side: a deferrable step the runner left to it is kept here; any other step
    first catches up the kept rows of its requests."""
    arguments = PassedArguments(propose)

    @functools.wraps(propose)
    def propose_deferring_k0(self, *args, **kwargs):
        step = getattr(self, STEP, None)
        backlog = getattr(self, BACKLOG, None) if step is not None else None
        if backlog is None:
            return propose(self, *args, **kwargs)
        call = arguments.of((self,) + args, kwargs)
        n = call("common_attn_metadata").num_reqs
        if step.deferrable and call("num_speculative_tokens") == 0 and \
                call("mm_embed_inputs") is None:
            next_tokens = call("next_token_ids")
            defer(self, backlog, step, next_tokens[:n].tolist(), call("target_hidden_states")[:n],
                  next_tokens.dtype)
            import torch

            return torch.empty(n, 0, dtype=torch.int64, device=next_tokens.device)  # vLLM's k = 0
        catch_up = backlog.take(step.req_ids, step.starts)
        if catch_up is not None:
            run_catch_up(propose, self, catch_up, call("common_attn_metadata"),
                         call("sampling_metadata"), call("target_hidden_states").dtype)
        return propose(self, *args, **kwargs)

    propose_deferring_k0.patch = NAME
    return propose_deferring_k0


def first_positions(cad) -> list[int]:
    """Where each request's tokens of this step start (context length before the step)."""
    seq_lens = cad.seq_lens_cpu_upper_bound
    seq_lens = (seq_lens if seq_lens is not None else cad.seq_lens).tolist()
    query_start = cad.query_start_loc_cpu.tolist()
    return [int(s) - (query_start[i + 1] - query_start[i]) for i, s in enumerate(seq_lens)]


def decode_starts(requests: dict, req_ids: list[str], scheduled_tokens: int) -> list[int] | None:
    """Each request's position at a step that schedules one token per request, every one past
    its prompt and with its sample kept (None: not such a step), from the runner's request states
    (``CachedRequestState``: the computed tokens before the step; the tokens before this step's
    sample, which the runner appends after proposing). A sample is thrown away where the step
    ends short of the request's tokens (vLLM's ``discard_request_mask``, ``_prepare_inputs``:
    computed + scheduled < tokens; optimistic counts only under async speculative decoding,
    which the caller excludes)."""
    if scheduled_tokens != len(req_ids):  # every request runs at least one token
        return None
    starts = []
    for req_id in req_ids:
        state = requests[req_id]
        start = state.num_computed_tokens
        if start < state.num_prompt_tokens or start + 1 < state.num_tokens:
            return None
        starts.append(start)
    return starts


def one_decode_token_each(cad, starts: list[int], prompt_lens) -> bool:
    """A step the layer may skip at k = 0: one token per request (so no draft verified, none
    rejected), every request past its prompt (a one-token chunk of a prompt samples a token vLLM
    throws away). ``prompt_lens``: a list or the runner's array."""
    if not (cad.max_query_len == 1 and cad.num_actual_tokens == cad.num_reqs):
        return False
    lens = prompt_lens.tolist() if hasattr(prompt_lens, "tolist") else prompt_lens
    return all(start >= n for start, n in zip(starts, lens))


def run_catch_up(propose, drafter, catch_up, cad, sampling_metadata, dtype) -> None:
    """The kept rows through vLLM's own first pass at k = 0: each request one query of its
    skipped positions, its block-table row from this step, its context up to its first one."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    device = cad.query_start_loc.device
    lens = torch.tensor(catch_up.query_lens, dtype=torch.int32)
    query_start = torch.zeros(len(lens) + 1, dtype=torch.int32)
    torch.cumsum(lens, 0, out=query_start[1:])
    seq_lens = torch.tensor([f + n for f, n in zip(catch_up.first_positions, catch_up.query_lens)],
                            dtype=torch.int32)
    rows = torch.tensor(catch_up.batch_rows, dtype=torch.long, device=device)
    block_table = cad.block_table_tensor.index_select(0, rows)
    positions = catch_up.positions.to(device)
    owner = torch.repeat_interleave(torch.arange(len(lens), device=device), lens.to(device))
    block_size = drafter.block_size
    slots = (block_table[owner, positions // block_size].to(torch.int64) * block_size
             + positions % block_size)
    catch_up_cad = CommonAttentionMetadata(
        query_start_loc=query_start.to(device), query_start_loc_cpu=query_start,
        seq_lens=seq_lens.to(device), num_reqs=len(lens), num_actual_tokens=int(lens.sum()),
        max_query_len=int(lens.max()), max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table, slot_mapping=slots.to(cad.slot_mapping.dtype),
        positions=positions, seq_lens_cpu_upper_bound=seq_lens)
    tokens = catch_up.tokens.to(device)
    last = query_start[1:].to(device).long() - 1
    propose(drafter, num_speculative_tokens=0, target_token_ids=torch.roll(tokens, 1),
            target_positions=positions, target_hidden_states=catch_up.hidden.to(dtype),
            next_token_ids=tokens[last], token_indices_to_sample=None,
            common_attn_metadata=catch_up_cad, sampling_metadata=sampling_metadata)


PATCH = Patch(NAME, probe, deferred_first_pass_at_k0, UNPATCHED)
