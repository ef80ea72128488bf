"""A test-only out-of-tree vLLM platform, declared the way vLLM's plugin tests declare one.

vLLM finds platforms through the ``vllm.platform_plugins`` entry-point group; this folder carries a
``.dist-info`` with that entry point, so putting the folder on ``PYTHONPATH`` (in a child process
only) is the whole installation. ``activate`` returns the platform only when
``VLLM_MTP_FAKE_NPU=1`` as well, so the folder never changes a process by accident.
"""

import os


def activate() -> str | None:
    if os.environ.get("VLLM_MTP_FAKE_NPU") != "1":
        return None
    return "vllm_mtp_fake_npu.platform.FakeNPUPlatform"
