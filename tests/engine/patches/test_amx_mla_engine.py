"""vLLM's ``AMX_MLA`` backend (bf16 MLA on CPUs with AMX) with MTP, on purpose where it differs
from the ``CPU_MLA`` path the rest of the suite runs elsewhere: prefix caching and chunked prefill
on (vLLM keeps both for MLA only there), and a layer reload where the attention keeps ``W_UK``/
``W_UV`` packed in its own tensors and releases ``kv_b_proj``'s weight after packing
(``reload._unreleased_kv_b_proj``), including a reload that fails part-way, which must put the
whole old layer back (``drafter_snapshot.py``).

One bf16 engine, compiled (vLLM's default), 32-token KV blocks and 64-token steps, serving the
trained tiny DeepSeek's layer with noise added; the layer is swapped through the worker extension
``vllm-mtp serve`` installs (``LiveWorkerExtension.reload_mtp_layer``), as ``POST
/mtp/reload`` does. The served-layer figures are vLLM's counters on the same prompts before and
after, one request at a time.
"""

import copy
import json
from types import SimpleNamespace

import pytest
import torch

from vllm_mtp_plugin.tools.cpu_features import AMX
from vllm_mtp_plugin.tools.tiny import trained
from vllm_mtp_plugin.tools.tiny.tokenizer import bundled_prompt_texts

from support.checkpoint_edits import edited_copy, noise
from support.hardware import needs_cpu

pytestmark = [pytest.mark.engine,
              needs_cpu(*AMX, part="vLLM's AMX_MLA attention backend (bf16 MLA)")]

MTP_LAYER = trained.ARCH.num_hidden_layers
PROMPTS = [json.loads(line)["prompt"] for line in (trained.shipped_dir().parent /
                                                   "trained_prompts.jsonl").read_text().splitlines()
           ][::3]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from vllm import LLM

    root = tmp_path_factory.mktemp("amx-reload")
    good = trained.write_checkpoint(root / "trained", 1)
    noised = edited_copy(good, root / "noised", tensors=noise(f"model.layers.{MTP_LAYER}.", 1.0))
    llm = LLM(str(noised), dtype="bfloat16", max_model_len=512, disable_log_stats=False,
              block_size=32, max_num_batched_tokens=64,
              speculative_config={"method": "mtp", "num_speculative_tokens": 1},
              worker_extension_cls="vllm_mtp_plugin.live_worker.LiveWorkerExtension")
    served = json.loads((noised / "config.json").read_text())
    yield SimpleNamespace(llm=llm, good=good, noised=noised, served=served)
    del llm


def _counters(llm) -> tuple[int, int]:
    found = {m.name: m.value for m in llm.get_metrics()
             if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")}
    return found["vllm:spec_decode_num_drafts"], found["vllm:spec_decode_num_accepted_tokens"]


def _greedy(llm):
    """Every prompt's tokens and the (drafts, accepted) they moved, one request at a time."""
    from vllm import SamplingParams

    before = _counters(llm)
    tokens = [llm.generate([p], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    after = _counters(llm)
    return [list(t) for t in tokens], (after[0] - before[0], after[1] - before[1])


def _attention(worker):
    from vllm_mtp_plugin.live_worker import runner_drafter

    drafter = runner_drafter(worker.model_runner)
    [mla] = [m for m in drafter.modules() if type(m).__name__ == "MLAAttention"]
    return drafter, mla


def _state(worker) -> dict:
    """Everything the drafter computes with: its tensors (values), its attention's packed
    matrices, and the kernel closures vLLM's CPU linear layers keep (by identity)."""
    drafter, mla = _attention(worker)
    state = {f"tensor:{n}": t.detach().clone() for n, t in drafter.state_dict().items()}
    for name in ("_w_uk_packed", "_w_uv_packed"):
        state[f"packed:{name}"] = getattr(mla.impl, name).clone()
    state.update({f"closure:{n}": id(m.cpu_linear) for n, m in drafter.named_modules()
                  if hasattr(m, "cpu_linear")})
    return state


def _reload(engine, path, fault_after: int | None = None) -> dict:
    def reload(worker):
        import vllm_mtp_plugin.reload as reload_module

        real = reload_module.mtp_weights

        def weights(checkpoint, first):
            for i, item in enumerate(real(checkpoint, first)):
                if i == fault_after:
                    raise OSError(f"injected fault after {i} of the layer's tensors")
                yield item

        reload_module.mtp_weights = weights
        try:
            return worker.reload_mtp_layer(str(path), engine.served)
        finally:
            reload_module.mtp_weights = real

    [answer] = engine.llm.collective_rpc(reload)
    return answer


def _packed_as_amx_packs(worker, checkpoint) -> dict:
    """What vLLM's ``AMXMLAImpl.process_weights_after_loading`` packs from ``checkpoint``'s
    ``kv_b_proj``, run on a copy of the served implementation with that weight."""
    from safetensors import safe_open

    _, mla = _attention(worker)
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        weight = f.get_tensor(f"model.layers.{MTP_LAYER}.self_attn.kv_b_proj.weight")
    stand_in = copy.copy(mla.impl)
    stand_in.kv_b_proj = SimpleNamespace(weight=weight.to(torch.bfloat16), quant_method=None)
    type(mla.impl).process_weights_after_loading(stand_in, torch.bfloat16)
    return {"_w_uk_packed": stand_in._w_uk_packed, "_w_uv_packed": stand_in._w_uv_packed}


def test_the_drafter_runs_amx_mla_with_kv_b_proj_released(engine):
    [(impl, released)] = engine.llm.collective_rpc(lambda w: (
        type(_attention(w)[1].impl).__name__, _attention(w)[1].kv_b_proj.weight.numel()))
    assert (impl, released) == ("AMXMLAImpl", 0)


def test_prefix_caching_and_chunked_prefill_serve_mtp(engine):
    """A prompt five steps long, prefilled in chunks, then again from the prefix cache: the same
    tokens, drafts made and accepted both times."""
    from vllm import SamplingParams

    config = engine.llm.llm_engine.vllm_config
    assert config.cache_config.enable_prefix_caching
    assert config.scheduler_config.enable_chunked_prefill
    tokenizer = engine.llm.get_tokenizer()
    texts = iter(bundled_prompt_texts())
    prompt = next(texts)
    while len(tokenizer.encode(prompt)) < 5 * 64:
        prompt += " " + next(texts)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    runs = []
    for _ in range(2):
        before = _counters(engine.llm)
        [out] = engine.llm.generate([prompt], params, use_tqdm=False)
        after = _counters(engine.llm)
        runs.append((list(out.outputs[0].token_ids), out.num_cached_tokens or 0,
                     after[0] - before[0], after[1] - before[1]))
    (tokens, cached, drafts, accepted), (again, cached_again, drafts_again, _) = runs
    assert cached_again >= max(cached + 64, 4 * 64)
    assert again == tokens and drafts > 0 and accepted > 0 and drafts_again > 0


def test_a_reload_that_fails_part_way_puts_the_whole_old_layer_back(engine):
    tokens, counters = _greedy(engine.llm)
    [before] = engine.llm.collective_rpc(_state)
    answer = _reload(engine, engine.good, fault_after=9)
    assert "injected fault after 9" in answer["error"] and answer["refused"] is False
    [after] = engine.llm.collective_rpc(_state)
    assert after.keys() == before.keys()
    changed = [k for k in before if (before[k] != after[k] if k.startswith("closure:")
                                     else not torch.equal(before[k], after[k]))]
    assert changed == []
    assert _greedy(engine.llm) == (tokens, counters)


def test_a_reload_repacks_the_attention_and_a_reload_back_restores_the_start(engine):
    tokens, (drafts, accepted) = _greedy(engine.llm)
    answer = _reload(engine, engine.good)
    assert "error" not in answer, answer
    assert answer["kv_b_proj_unreleased"] == 1 and answer["packed_in_place"] == 2
    [(served, expected)] = engine.llm.collective_rpc(lambda w: (
        {n: getattr(_attention(w)[1].impl, n).clone() for n in ("_w_uk_packed", "_w_uv_packed")},
        _packed_as_amx_packs(w, engine.good)))
    assert all(torch.equal(served[n], expected[n]) for n in expected)
    new_tokens, (new_drafts, new_accepted) = _greedy(engine.llm)
    assert new_tokens == tokens  # lossless: the target decides every token
    assert new_accepted / new_drafts > accepted / drafts + 0.3
    answer = _reload(engine, engine.noised)
    assert "error" not in answer, answer
    assert _greedy(engine.llm) == (tokens, (drafts, accepted))
