"""The rows k = 0 steps keep for the MTP layer (``adaptive_k/first_pass_backlog.py``) and the
patch's decisions around them (``patches/deferred_first_pass_at_k0.py``). The engine test that
the caught-up layer drafts as one that never skipped: ``tests/engine/adaptive_k/
test_deferred_first_pass.py``."""

import logging
import types

import pytest
import torch
from support.logs import plugin_log

from vllm_mtp_plugin.adaptive_k.first_pass_backlog import FirstPassBacklog
from vllm_mtp_plugin.patches import deferred_first_pass_at_k0 as patch

HIDDEN = 4


def step(backlog, req_ids, positions):
    """One deferred decode step: token = 100 * request + position, hidden rows alike."""
    tokens = torch.tensor([100 * int(r[1:]) + p for r, p in zip(req_ids, positions)])
    hidden = tokens.float()[:, None].repeat(1, HIDDEN)
    backlog.defer(req_ids, positions, tokens.tolist(), hidden)


def test_a_batch_takes_its_rows_per_request_in_position_order_shortest_first():
    backlog = FirstPassBacklog(capacity=64)
    step(backlog, ["r1", "r2"], [10, 20])
    step(backlog, ["r1", "r2"], [11, 21])
    step(backlog, ["r2"], [22])  # r1 not scheduled this step
    catch_up = backlog.take(["r2", "r1"], [23, 12])
    assert catch_up.batch_rows == [1, 0]  # r1 (2 rows) before r2 (3 rows)
    assert catch_up.query_lens == [2, 3] and catch_up.first_positions == [10, 20]
    assert catch_up.positions.tolist() == [10, 11, 20, 21, 22]
    assert catch_up.tokens.tolist() == [110, 111, 220, 221, 222]
    assert catch_up.hidden[:, 0].tolist() == [110, 111, 220, 221, 222]
    assert backlog.rows == 0 and backlog.catch_ups == 1 and backlog.caught_up_rows == 5


def test_rows_that_no_longer_fit_the_request_are_dropped_and_others_wait():
    backlog = FirstPassBacklog(capacity=64)
    step(backlog, ["r1", "r2", "r3"], [5, 7, 9])
    # r1's step starts elsewhere (it was recomputed): its rows go; r3 is not in the batch: stays.
    catch_up = backlog.take(["r1", "r2"], [0, 8])
    assert catch_up.query_lens == [1] and catch_up.batch_rows == [1]
    assert backlog.rows == 1 and backlog.owners == ["r3"]
    assert backlog.take(["r3"], [10]).positions.tolist() == [9]
    assert backlog.take(["r3"], [11]) is None


def test_requests_outside_the_batch_keep_their_rows():
    backlog = FirstPassBacklog(capacity=64)
    step(backlog, ["r1", "r2"], [15, 20])
    catch_up = backlog.take(["r1"], [16])
    assert catch_up.batch_rows == [0] and catch_up.positions.tolist() == [15]
    assert backlog.owners == ["r2"] and backlog.take(["r1", "r2"], [17, 21]).batch_rows == [1]


def test_with_prefix_caching_a_kept_block_is_caught_up_before_it_can_be_shared():
    """The first kept position's block must hold the layer's KV once it is full, or, where vLLM
    recomputes the last block a prefix hit matches, once the block after it is full."""
    assert patch.block_needed(0, 16, block_drop=False) == 16
    assert patch.block_needed(15, 16, block_drop=False) == 16
    assert patch.block_needed(16, 16, block_drop=False) == 32
    assert patch.block_needed(5, 16, block_drop=True) == 32
    backlog = FirstPassBacklog(capacity=64)
    step(backlog, ["r1"], [14])
    step(backlog, ["r1"], [15])
    assert backlog.first_position == {"r1": 14}
    backlog.take(["r1"], [16])
    assert backlog.first_position == {}


def test_a_position_that_does_not_follow_restarts_the_request():
    backlog = FirstPassBacklog(capacity=64)
    step(backlog, ["r1"], [5])
    step(backlog, ["r1"], [0])  # preempted, recomputed, decoding again from elsewhere
    assert backlog.take(["r1"], [1]).positions.tolist() == [0]


def test_finished_requests_free_their_rows_and_the_bound_holds():
    backlog = FirstPassBacklog(capacity=4)
    step(backlog, ["r1", "r2"], [1, 1])
    step(backlog, ["r1", "r2"], [2, 2])
    assert not backlog.fits(1)
    with pytest.raises(ValueError, match="do not fit: 4 of 4 kept"):
        step(backlog, ["r1"], [3])
    backlog.forget(["r2", "r9"])
    assert backlog.rows == 2 and backlog.fits(2) and not backlog.fits(3)
    assert sum(t.shape[0] for t in backlog.hidden) == 2  # memory follows the rows kept
    with pytest.raises(ValueError, match="at least 1 row"):
        FirstPassBacklog(0)


def test_kept_rows_are_copies():
    backlog = FirstPassBacklog(capacity=8)
    hidden = torch.ones(1, HIDDEN)
    backlog.defer(["r1"], [3], [7], hidden)
    hidden.zero_()  # vLLM reuses its output buffers at the next step
    assert backlog.take(["r1"], [4]).hidden.sum() == HIDDEN


def cad(query_lens, seq_lens):
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return types.SimpleNamespace(
        query_start_loc_cpu=torch.tensor(starts), seq_lens_cpu_upper_bound=torch.tensor(seq_lens),
        seq_lens=torch.tensor(seq_lens), max_query_len=max(query_lens),
        num_actual_tokens=sum(query_lens), num_reqs=len(query_lens))


def test_only_one_decode_token_per_request_past_its_prompt_is_deferred():
    one_each = cad([1, 1], [9, 12])
    starts = patch.first_positions(one_each)
    assert starts == [8, 11]
    assert patch.one_decode_token_each(one_each, starts, [5, 11])
    assert not patch.one_decode_token_each(one_each, starts, [5, 12])  # a one-token prompt chunk
    import numpy as np  # the runner's own array of prompt lengths

    assert patch.one_decode_token_each(one_each, starts, np.array([5, 11], dtype=np.int32))
    assert not patch.one_decode_token_each(one_each, starts, np.array([5, 12], dtype=np.int32))
    verify = cad([3, 1], [9, 12])  # drafts verified: 3 tokens for the first request
    assert patch.first_positions(verify) == [6, 11]
    assert not patch.one_decode_token_each(verify, patch.first_positions(verify), [1, 1])


def test_arguments_are_read_by_name_as_bind_reads_them():
    """The wrappers read vLLM's arguments by parameter name, whether vLLM passes them by
    position or by name; one not passed (a default) reads as None, as ``bind().arguments.get``
    gave it."""
    import inspect

    def propose(self, scheduler_output, sampled, sampling_metadata, hidden_states,
                aux_hidden_states=None, common_attn_metadata=None):
        """Stands for vLLM's runner method."""

    arguments = patch.PassedArguments(propose)
    passed = [(("runner", "out", "ids", "meta", "hidden"), {"common_attn_metadata": "cad"}),
              (("runner", "out", "ids", "meta", "hidden", "aux", "cad"), {}),
              (("runner",), dict(scheduler_output="out", sampled="ids", sampling_metadata="meta",
                                 hidden_states="hidden"))]
    for args, kwargs in passed:
        call = arguments.of(args, kwargs)
        bound = inspect.signature(propose).bind(*args, **kwargs).arguments
        for name in inspect.signature(propose).parameters:
            assert call(name) == bound.get(name), (name, args, kwargs)


class Proposer(types.SimpleNamespace):
    def propose(self):
        """Stands for vLLM's proposer as the patch leaves it."""

    propose.patch = patch.NAME


class OwnProposer(Proposer):
    def propose(self):
        """A proposer of its own (another model's MTP), which the patch does not wrap."""


def drafter(cls=Proposer, **changes):
    config = types.SimpleNamespace(num_speculative_tokens_per_batch_size=[[1, 256, 0]])
    fields = dict(method="mtp", speculative_config=config, max_num_tokens=32,
                  needs_extra_input_slots=False, uses_mrope=False,
                  vllm_config=types.SimpleNamespace(parallel_config=types.SimpleNamespace(
                      decode_context_parallel_size=1)),
                  draft_model_config=types.SimpleNamespace(hf_config=types.SimpleNamespace()))
    fields.update(changes)
    return cls(**fields)


def test_the_backlog_is_made_only_where_the_layer_may_skip(monkeypatch):
    with plugin_log(logging.INFO) as messages:
        backlog = patch.backlog_for(drafter())
    assert backlog.capacity == 32 and any("at most 32 rows kept" in m for m in messages)
    assert patch.backlog_for(drafter(speculative_config=types.SimpleNamespace(
        num_speculative_tokens_per_batch_size=None))) is None  # fixed k: never 0
    v4 = types.SimpleNamespace(hf_config=types.SimpleNamespace(hc_mult=4))
    assert patch.backlog_for(drafter(draft_model_config=v4)) is None
    assert patch.backlog_for(drafter(needs_extra_input_slots=True)) is None
    assert patch.backlog_for(drafter(OwnProposer)) is None
    assert patch.backlog_for(drafter()).prefix_caching is False
    caching = types.SimpleNamespace(parallel_config=types.SimpleNamespace(
        decode_context_parallel_size=1), cache_config=types.SimpleNamespace(
        enable_prefix_caching=True))
    config = types.SimpleNamespace(num_speculative_tokens_per_batch_size=[[1, 256, 0]],
                                   use_eagle_block_drop=lambda: True)
    made = patch.backlog_for(drafter(vllm_config=caching, speculative_config=config))
    assert (made.prefix_caching, made.block_drop) == (True, True)
    monkeypatch.setenv(patch.SWITCH, "0")
    assert patch.backlog_for(drafter()) is None


def test_the_patch_names_what_vllm_renamed(plugin_log):
    patch._install_proposer(types.SimpleNamespace())
    assert "deferred_first_pass_at_k0 not applied" in plugin_log.text
    assert "still runs the MTP layer" in plugin_log.text


def test_the_installed_vllm_reads_what_the_patch_needs():
    import inspect

    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    source = inspect.getsource(SpecDecodeBaseProposer.propose)
    assert all(text in source for text in patch.PROPOSER_READS)


class FakeRunner:
    """What the runner-side wrapper reads of vLLM's GPUModelRunner, two requests decoding."""

    def __init__(self, **changes):
        import numpy as np

        self.drafter = drafter(block_size=16)
        self.requests = {"r1": request_state(), "r2": request_state()}
        self.input_batch = types.SimpleNamespace(req_ids=["r1", "r2"], num_reqs=2,
                                                 num_prompt_tokens=np.array([4, 4]))
        self.discard_request_mask = types.SimpleNamespace(np=np.zeros(2, dtype=bool))
        self.use_async_spec_decode = False
        self.valid_sampled_token_count_event = None
        self.original_calls = 0
        self.__dict__.update(changes)

    def get_model(self):
        return types.SimpleNamespace()


def request_state(prompt_tokens=4):
    """vLLM's CachedRequestState as the wrapper reads it (set per step by ``propose_step``)."""
    return types.SimpleNamespace(num_prompt_tokens=prompt_tokens, num_computed_tokens=0,
                                 num_tokens=prompt_tokens)


def propose_step(runner, k=0, seq_lens=(9, 12), discarded=()):
    """One step's call of the wrapped ``propose_draft_token_ids``: each request decodes one token
    (context ``seq_lens``); a request in ``discarded`` has tokens beyond the step (a sample vLLM
    throws away), in its state and in vLLM's mask alike."""
    for i, (req_id, seq_len) in enumerate(zip(runner.input_batch.req_ids, seq_lens)):
        state = runner.requests[req_id]
        state.num_computed_tokens = seq_len - 1
        state.num_tokens = seq_len + (4 if req_id in discarded else 0)
        runner.discard_request_mask.np[i] = req_id in discarded

    def original(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                 sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                 common_attn_metadata, slot_mappings):
        self.original_calls += 1
        return "vLLM's"

    wrapped = patch._deferring_runner(original)
    scheduler_output = types.SimpleNamespace(num_spec_tokens_to_schedule=k,
                                             total_num_scheduled_tokens=len(seq_lens),
                                             preempted_req_ids=set())
    return wrapped(runner, scheduler_output, torch.tensor([[7], [8]]), None,
                   torch.ones(2, HIDDEN), None, None, None, cad([1, 1], list(seq_lens)), None)


def test_the_runner_defers_only_steps_whose_rows_are_what_the_layer_would_read():
    runner = FakeRunner()
    drafts = propose_step(runner)
    # no drafts as vLLM's n-gram proposer gives them (a list per request): nothing to copy
    assert drafts == [[], []] and runner.original_calls == 0
    backlog = runner.drafter._mtp_first_pass_backlog
    assert backlog.rows == 2 and backlog.tokens == [7, 8]
    assert propose_step(runner, k=2, seq_lens=(10, 13)) == "vLLM's"  # drafts asked for
    assert propose_step(FakeRunner(), discarded={"r2"}) == "vLLM's"  # a sample thrown away
    optimistic = FakeRunner(use_async_spec_decode=True, prev_num_draft_tokens=types.SimpleNamespace(
        np=torch.tensor([0, 2]).numpy()))  # positions assume the last drafts accepted
    assert propose_step(optimistic) == "vLLM's"
    # under async scheduling (were the runner to defer there) the next step reads a tensor
    drafts = propose_step(FakeRunner(use_async_scheduling=True))
    assert tuple(drafts.shape) == (2, 0) and drafts.dtype == torch.int64
    gone = FakeRunner()
    propose_step(gone)
    gone.requests.pop("r2")  # finished at a step that drafted nothing; r3 took its place
    gone.requests["r3"] = request_state()
    gone.input_batch.req_ids = ["r1", "r3"]
    propose_step(gone, seq_lens=(10, 13))
    assert "r2" not in gone.drafter._mtp_first_pass_backlog.next_position


def test_decode_starts_reads_the_request_states_as_vllm_masks_samples():
    def state(computed, prompt, tokens):
        return types.SimpleNamespace(num_computed_tokens=computed, num_prompt_tokens=prompt,
                                     num_tokens=tokens)

    decoding = {"a": state(8, 4, 9), "b": state(11, 4, 12)}
    assert patch.decode_starts(decoding, ["a", "b"], 2) == [8, 11]
    assert patch.decode_starts(decoding, ["b"], 1) == [11]
    assert patch.decode_starts(decoding, ["a", "b"], 3) is None  # a request ran two tokens
    # the last token of a prompt's chunk samples the first output: kept, but not a decode step
    assert patch.decode_starts({"a": state(3, 4, 4)}, ["a"], 1) is None
    # a recomputed request (preempted) one token at a time: its samples are thrown away
    assert patch.decode_starts({"a": state(6, 4, 9)}, ["a"], 1) is None


def test_caught_up_tokens_keep_the_sampled_dtype():
    backlog = FirstPassBacklog(8)
    backlog.defer(["r1"], [5], [42], torch.ones(1, HIDDEN), torch.int32)
    catch_up = backlog.take(["r1"], [6])
    assert catch_up.tokens.dtype == torch.int32 and catch_up.tokens.tolist() == [42]
