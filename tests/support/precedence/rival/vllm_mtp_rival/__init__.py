"""A test-only plugin that competes with vllm-mtp-plugin for the DeepSeek MTP architecture names.

It registers ``DeepSeekMTPModel``, ``DeepseekV32MTPModel`` and ``DeepSeekV4MTPModel`` the way
vllm-ascend's ``register_model`` entry point does (``vllm_ascend/models/__init__.py``), and offers
an out-of-tree platform without a DeepSeek-V4 decoder block, as Ascend's NPU platform is for this
plugin. Putting this folder on ``sys.path`` before or after site-packages (in a child process
only) decides whether vLLM discovers it before or after vllm-mtp-plugin. The platform is active
only with ``VLLM_MTP_RIVAL_NPU=1``.
"""

import os

ARCHITECTURES = {
    "DeepSeekMTPModel": "vllm_mtp_rival.models:RivalDeepSeekMTP",
    "DeepseekV32MTPModel": "vllm_mtp_rival.models:RivalDeepSeekMTP",
    "DeepSeekV4MTPModel": "vllm_mtp_rival.models:RivalDeepSeekV4MTP",
}


def register() -> None:
    from vllm import ModelRegistry

    for arch, target in ARCHITECTURES.items():
        ModelRegistry.register_model(arch, target)


def activate() -> str | None:
    if os.environ.get("VLLM_MTP_RIVAL_NPU") != "1":
        return None
    return "vllm_mtp_rival.platform.RivalNPUPlatform"
