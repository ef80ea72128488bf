"""Child process of test_v4_reference_parity.py: serve a bf16 tiny V4 target with our drafter (k = 1,
greedy) and record what the drafter received and returned, and the drafts it made.

* ``OUT/raw/call-*.safetensors``: the plugin's recording (``vllm_mtp_plugin.recording``, turned on
  through vLLM's ``worker_extension_cls``): per first-step drafter call, the token after each
  position, the positions, the target's hidden state (pre-``hc_head`` streams) and the layer's
  output;
* ``OUT/drafts.safetensors``: every row ``compute_logits`` turned into a draft (with k = 1, the
  layer's output at each request's last position) and its logits (float32), caught by wrapping the
  drafter class's ``compute_logits`` in this process (the engine runs in it: no engine-core process,
  one worker);
* ``OUT/generated.json``: the prompts' token ids and what the target generated.

Argv: model directory, output directory, prompts as JSON (lists of token ids), max tokens.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def catch_drafts(caught: list) -> None:
    from vllm_mtp_plugin.models.v4 import DeepSeekV4MTP

    original = DeepSeekV4MTP.compute_logits

    def compute_logits(self, hidden_states, spec_step_idx: int = 0):
        logits = original(self, hidden_states, spec_step_idx)
        if logits is not None:
            caught.append((hidden_states.detach().clone(), logits.detach().float()))
        return logits

    DeepSeekV4MTP.compute_logits = compute_logits


def main(model_dir: str, out: str, prompts_json: str, max_tokens: str) -> None:
    import torch
    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams, TokensPrompt

    from vllm_mtp_plugin.tools.engine.eager_reasons import eager_for

    out_dir, prompts = Path(out), json.loads(prompts_json)
    caught: list = []
    catch_drafts(caught)
    llm = LLM(model_dir, dtype="bfloat16", enforce_eager=eager_for("interpreted-v4"),
              max_model_len=256, distributed_executor_backend="uni",
              worker_extension_cls="vllm_mtp_plugin.recording.RecordingWorkerExtension",
              speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    assert llm.collective_rpc("start_mtp_recording", args=(str(out_dir / "raw"), True)) == [True]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                           SamplingParams(max_tokens=int(max_tokens), temperature=0))
    llm.collective_rpc("stop_mtp_recording")
    save_file({"hidden_states": torch.cat([h for h, _ in caught]).contiguous(),
               "logits": torch.cat([lg for _, lg in caught]).contiguous()},
              str(out_dir / "drafts.safetensors"))
    (out_dir / "generated.json").write_text(json.dumps(
        {"prompts": prompts, "generated": [list(o.outputs[0].token_ids) for o in outputs]}))


if __name__ == "__main__":
    main(*sys.argv[1:])
