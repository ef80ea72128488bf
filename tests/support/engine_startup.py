"""Child process of test_v4_e2e.py: start a real vLLM engine with a V4 target and our drafter.

Prints one JSON line: the model runner (V1 or V2, whichever the environment selects), the
drafter's class, whether vLLM's proposer gave it the target's embedding, head and top-k buffer, and
the draft attention layers in the KV-cache config. It generates nothing:
on CPUs without what ``tools.cpu_features.deepseek_v4_cpu_blockers`` lists, the first step fails in vLLM's
V4 attention metadata (a Triton kernel), after everything checked here has happened.
"""

import json
import os
import sys
from vllm_mtp_plugin.tools.engine.eager_reasons import eager_for

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def report(worker) -> dict:
    from vllm_mtp_plugin.tools.engine.worker_report import drafter_model, model_runner_kind

    runner = worker.model_runner
    target, drafter = runner.model, drafter_model(runner)
    layer = next(iter(drafter.model.layers.values()))
    return {
        "runner": model_runner_kind(runner),
        "class": f"{type(drafter).__module__}:{type(drafter).__name__}",
        "embedding_shared": drafter.model.embed_tokens is target.model.embed_tokens,
        "head_shared": drafter.lm_head is target.lm_head,
        "topk_buffer_shared": layer.mtp_block.attn.topk_indices_buffer
        is target.model.topk_indices_buffer,
        "draft_attention_layers": sorted(
            name for group in runner.kv_cache_config.kv_cache_groups for name in group.layer_names
            if name.startswith(f"model.layers.{target.config.num_hidden_layers}.")),
    }


def main(model_dir: str) -> None:
    from vllm import LLM

    llm = LLM(model_dir, dtype="bfloat16", enforce_eager=eager_for("interpreted-v4"),
              max_model_len=512,
              distributed_executor_backend="uni",
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    print(json.dumps(llm.collective_rpc(report)[0]))


if __name__ == "__main__":
    main(sys.argv[1])
