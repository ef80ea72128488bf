"""What a doctor report says about the machine, and the engine mode its checks run in.

The checks run the way this platform serves by default: vLLM's compilation (and CUDA graphs where
the platform has them), the engine core in its own process (vLLM's default process mode), the
model runner vLLM picks. A check that passes in a faster mode proves nothing about that one.
"""

from __future__ import annotations


def device_count(family: str) -> int:
    """Accelerators vLLM could spread tensor parallelism over; a CPU counts as one device."""
    if family == "cpu":
        return 1
    import torch

    for backend in ("cuda", "npu", "xpu"):  # ROCm answers through torch.cuda
        module = getattr(torch, backend, None)
        if module is not None and module.is_available():
            return int(module.device_count())
    return 0


def platform_facts() -> dict:
    """Platform family, device, versions and the default engine mode; ``environment``: the code,
    command and machine of the run (``provenance.environment``), as every results file has it."""
    from importlib import metadata

    from vllm.platforms import current_platform

    from ...platform import platform_family
    from ..provenance import environment

    family = platform_family()
    try:
        device = current_platform.get_device_name()
    except Exception as exc:  # a platform without the probe still gets a report
        device = f"unknown ({type(exc).__name__})"
    try:
        ascend = metadata.version("vllm-ascend")
    except metadata.PackageNotFoundError:
        ascend = None
    env = environment()
    return {"platform": family, "device_type": getattr(current_platform, "device_type", None),
            "device": device, "devices": device_count(family),
            "versions": {"vllm": env["vllm"], "torch": env["torch"], "python": env["python"],
                         "vllm-mtp-plugin": env["package_version"], "vllm-ascend": ascend},
            "engine_mode": engine_mode(current_platform), "environment": env}


def engine_mode(platform) -> dict:
    """The default mode every self-test engine runs in, as this platform defines it: graphs
    captured where vLLM's config does so by default (``config/vllm.py`` asks
    ``support_static_graph_mode``: CUDA, ROCm, XPU, and the NPU platform's own answer)."""
    return {"compilation": "vLLM's default (compiled)",
            "captured_graphs": bool(platform.support_static_graph_mode()),
            "process_mode": "default (engine core in its own process)",
            "model_runner": "vLLM's choice (reported per check)"}
