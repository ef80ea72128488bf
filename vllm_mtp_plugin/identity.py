"""What this package is and what it serves: its version, the vLLM architectures it implements, and
whether ``register()`` ran in this process.

A module of its own, below everything: the drafter's start-up line and the tools' worker reports
read these, and importing the package root for them would put every reader above the patches and
the precedence rules that ``register()`` imports.
"""

from __future__ import annotations

VERSION = "0.1.0"

# vLLM architecture name -> our implementation. Keeping vLLM's names means
# `--speculative-config '{"method": "mtp"}'` picks these with no other change.
ARCHITECTURES: dict[str, str] = {
    "DeepSeekMTPModel": "vllm_mtp_plugin.models.v3:DeepSeekMTP",
    "DeepSeekV4MTPModel": "vllm_mtp_plugin.models.v4:DeepSeekV4MTP",
}


class Registration:
    """Whether ``vllm_mtp_plugin.register()`` has run in this process (vLLM calls it in each
    process it starts; with ``VLLM_PLUGINS=""`` it never does)."""

    done = False
