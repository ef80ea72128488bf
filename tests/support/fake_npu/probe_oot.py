"""Child process of test_v4_platform.py: the V4 drafter under the test-only out-of-tree platform.

Run with ``tests/support/fake_npu/platform_plugin`` on ``PYTHONPATH`` and ``VLLM_MTP_FAKE_NPU=1``. It builds
and loads the drafter, runs ``compute_logits`` and the input fusion, and prints one JSON line of
facts for the test to assert on: the platform vLLM chose, the ``vllm.models.deepseek_v4`` modules
the drafter's construction imported, how many CUDA streams were created, which ``hc_head`` op
was built and how often the portable formula ran, and the logits next to a plain computation.

(The block's forward does not run here: vLLM's fused MoE has no out-of-tree path of its own; a real
out-of-tree platform brings its MoE, as it brings its V4 block.)
"""

import json
import sys
from pathlib import Path

import torch

CUDA_STREAMS = []


class RecordingStream:
    def __init__(self, *args, **kwargs):
        CUDA_STREAMS.append(args)


def main(model_dir: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the shared support
    from support.drafters import attach_target_parts, build_drafter, checkpoint_tensors, engine_config

    import vllm.v1.worker.cpu.shm  # noqa: F401  (placeholder Event, as in a CPU-backed worker)
    from vllm.platforms import current_platform

    torch.cuda.Stream = RecordingStream  # after shm: any torch.cuda.Stream() from here is counted
    config = engine_config(model_dir)
    from support.drafters import single_process_vllm

    import vllm_mtp_plugin.ops as ops

    calls = []
    portable = ops.hc_head
    ops.hc_head = lambda *a: calls.append(a[0].shape) or portable(*a)
    with single_process_vllm(config):
        before = {m for m in sys.modules if m.startswith("vllm.models.deepseek_v4")}
        drafter = build_drafter(config)
        imported = sorted({m for m in sys.modules if m.startswith("vllm.models.deepseek_v4")} - before)
        package_after = "vllm.models.deepseek_v4" in sys.modules
        tensors = checkpoint_tensors(model_dir)
        loaded_all = drafter.load_weights(tensors.items()) == {n for n, _ in drafter.named_parameters()}
        attach_target_parts(drafter, tensors)
        layer = drafter.model.layer_for_step(0)
        hidden = torch.randn(3, 4 * 256, generator=torch.Generator().manual_seed(0)).bfloat16()
        logits = drafter.compute_logits(hidden)
        mixed = portable(hidden.view(3, 4, 256), layer.hc_head_fn, layer.hc_head_scale,
                         layer.hc_head_base, 1e-6, 1e-6).float()
        normed = mixed * torch.rsqrt(mixed.square().mean(-1, keepdim=True) + 1e-6)
        expected = (normed * tensors["mtp.0.norm.weight"].float()) @ tensors["head.weight"].float().T
        ids, positions = torch.tensor([5, 6, 7]), torch.arange(3)
        fused = layer.fuse_inputs(positions, hidden, drafter.embed_input_ids(ids))
        import vllm.models.deepseek_v4 as package  # vLLM's own __init__ still runs afterwards

    print(json.dumps({
        "platform": type(current_platform).__name__,
        "out_of_tree": current_platform.is_out_of_tree(),
        "is_cpu": current_platform.is_cpu(),
        "block": f"{type(layer.mtp_block).__module__}:{type(layer.mtp_block).__name__}",
        "imported_by_construction": imported,
        "package_before_construction": "vllm.models.deepseek_v4" in before,
        "package_after_construction": package_after,
        "cuda_streams_created": len(CUDA_STREAMS),
        "hc_head_op": type(layer.hc_head).__name__,
        "hc_head_dispatch": layer.hc_head._forward_method.__name__,
        "portable_hc_head_calls": [list(s) for s in calls],
        "loaded_all": loaded_all,
        "logits_shape": list(logits.shape),
        "logits_max_abs_diff": (logits.float() - expected).abs().max().item(),
        "fused_shape": list(fused.shape),
        "package_reimported_with_its_classes": hasattr(package, "DeepseekV4ForCausalLM"),
    }))


if __name__ == "__main__":
    main(sys.argv[1])
