"""``vllm-mtp train``'s data and layer against the served drafter, on the trained tiny DeepSeek.

* the stored hidden states are what the drafter receives while serving (a second engine with
  vLLM's defaults: compiled, prefix caching and chunked prefill on, k = 2), and they are the
  target's output after its final norm (transformers' forward of the same checkpoint);
* the trainer's MTP layer (transformers' ``MtpLayer``) computes what the served layer computes on
  the same weights and inputs (fp32), and a layer with two tensors swapped does not.
"""

import pytest
import torch

from vllm_mtp_plugin.tools.tiny import trained
from vllm_mtp_plugin.tools.mtp_layer.v3_target import open_target
from vllm_mtp_plugin.tools.state_collection import CollectSettings, _engine, collect, cpu_without_bf16
from vllm_mtp_plugin.tools.mtp_layer.drafter_inputs import assemble
from vllm_mtp_plugin.tools.mtp_layer.shard_format import SequenceStore
from vllm_mtp_plugin.tools.mtp_layer.transformers_layer import FrozenTarget, transformers_config, mtp_forward
from vllm_mtp_plugin.tools.mtp_layer.trainable import initial_layer

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

UNI = {"distributed_executor_backend": "uni"}


def collecting_dtype():
    """The collector's engine dtype: the checkpoint's bf16, fp32 on CPUs without AVX512-BF16."""
    return torch.float32 if cpu_without_bf16() else torch.bfloat16


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return trained.write_checkpoint(tmp_path_factory.mktemp("train-data") / "model", 1)


@pytest.fixture(scope="module")
def collected(target, tmp_path_factory):
    prompts = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    prompts.write_text("def index(request):\nThe admin site reads\nclass Meta:\n")
    data = tmp_path_factory.mktemp("data")
    manifest = collect(target, prompts, data, CollectSettings(max_new_tokens=20,
                       samples_per_prompt=2, sequences_per_shard=4), engine_kwargs=UNI)
    return data, manifest


def test_collection_writes_resumable_shards(collected):
    data, manifest = collected
    assert [s["sequences"] for s in manifest["shards"]] == [4, 2]
    store = SequenceStore(data)
    assert len(store) == 6
    for tokens, hidden in zip(store.tokens, store.hidden):
        assert tokens.shape[0] == hidden.shape[0] + 1 and hidden.shape[1] == 256
        assert hidden.dtype == collecting_dtype()  # as vLLM hands it over
    # Samples of one prompt share the prompt and (causal attention) its hidden states.
    n = store.tokens[0].shape[0] - 1
    common = next(i for i in range(n) if store.tokens[0][i] != store.tokens[1][i])
    assert torch.equal(store.hidden[0][:common], store.hidden[1][:common])


def test_stored_states_are_what_the_drafter_gets_while_serving(target, collected, tmp_path):
    from vllm import LLM, SamplingParams, TokensPrompt

    data, _ = collected
    store = SequenceStore(data)
    sequences = [store.tokens[i][:-1].tolist() for i in (0, 2, 4)]
    dtype = str(collecting_dtype()).removeprefix("torch.")
    llm = LLM(str(target), speculative_config={"method": "mtp", "num_speculative_tokens": 2},
              dtype=dtype, worker_extension_cls="vllm_mtp_plugin.recording.RecordingWorkerExtension",
              max_model_len=512, **UNI)
    assert llm.collective_rpc("start_mtp_recording", args=(str(tmp_path / "raw"),)) == [True]
    llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences],
                 SamplingParams(max_tokens=4, temperature=0))
    assert llm.collective_rpc("stop_mtp_recording")[0] > 0
    del llm
    from safetensors.torch import load_file

    calls = [load_file(str(f)) for f in sorted((tmp_path / "raw").glob("call-*"))]
    prefill = [{k: v[:sum(map(len, sequences))] for k, v in calls[0].items()}]
    served = assemble(prefill, [s[1:] + [store.tokens[i][-1].item()] for s, i in
                                zip(sequences, (0, 2, 4))])
    for rows, i in zip(served, (0, 2, 4)):
        assert rows.shape == store.hidden[i].shape
        # bf16 states of a compiled engine against an eager one: equal up to bf16 rounding at
        # almost every position (measured on a 2-core AMD EPYC: 0.4-1.7 % of the mean magnitude
        # per position, median 0.6-0.7 %; largest element 0.5-0.7 % of the largest state). Where
        # two experts' router scores nearly tie, rounding may pick the other expert for that token
        # (measured: 2 of the 76 positions, both in one sequence, at 25 % and 35 %, their
        # neighbours back at 0.6 %). A wrong state (pre-norm, shifted by one, another sequence's)
        # is off at every position.
        ours, theirs = rows.float(), store.hidden[i].float()
        diff = (ours - theirs).abs()
        per_position = diff.mean(dim=1) / theirs.abs().mean()
        assert per_position.median() < 0.01, (i, per_position)
        rounded = per_position < 0.03
        assert rounded.sum() >= 0.85 * len(rows), (i, per_position)
        assert diff[rounded].max() < 0.02 * theirs.abs().max(), (i, diff[rounded].max())


def test_stored_states_are_the_targets_final_norm_output(target, collected):
    from transformers import DeepseekV3ForCausalLM

    data, _ = collected
    store = SequenceStore(data)
    model = DeepseekV3ForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ids = store.tokens[0][:-1][None]
    seen = {}
    model.model.norm.register_forward_hook(lambda m, args, out: seen.update(before=args[0]))
    with torch.no_grad():
        final = model.model(input_ids=ids).last_hidden_state[0]
    before_norm = seen["before"][0]
    stored = store.hidden[0].float()
    scale = final.abs().mean()
    assert (stored - final).abs().mean() < 0.02 * scale
    assert (stored - before_norm).abs().mean() > 0.5 * scale  # not the pre-norm state


def test_trainer_layer_computes_the_served_layer(target, tmp_path):
    """fp32 engine; the served layer's output recorded; transformers' layer on the same inputs."""
    from safetensors.torch import load_file
    from vllm import SamplingParams

    llm = _engine(target, "float32", 128, UNI)
    llm.collective_rpc("start_mtp_recording", args=(str(tmp_path / "raw"), True))
    llm.generate(["The admin site reads metadata from your models to"],
                 SamplingParams(max_tokens=1, temperature=0))
    llm.collective_rpc("stop_mtp_recording")
    del llm
    call = load_file(str(sorted((tmp_path / "raw").glob("call-*"))[0]))
    assert call["hidden_states"].dtype == torch.float32 and call["output"].shape[0] >= 10
    checkpoint = open_target(target)
    config = transformers_config(checkpoint.config)
    layer = initial_layer(checkpoint, config, "checkpoint", 0).eval()
    frozen = FrozenTarget(config, checkpoint.float_tensor("model.embed_tokens.weight"),
                          checkpoint.float_tensor("lm_head.weight"))

    def run(module):
        with torch.no_grad():
            return mtp_forward(module, frozen, call["hidden_states"][None],
                               call["input_ids"][None], call["positions"][None])[0]

    served = call["output"]
    ours = run(layer)
    assert (ours - served).abs().max() < 1e-3 * served.abs().max(), (ours - served).abs().max()
    with torch.no_grad():  # the comparison sees a swapped pair of tensors
        layer.enorm.weight, layer.hnorm.weight = layer.hnorm.weight, layer.enorm.weight
    assert (run(layer) - served).abs().max() > 0.05 * served.abs().max()
