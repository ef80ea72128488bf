"""Tiny DeepSeek checkpoints built on this machine.

Constructed weights, acceptance known by construction: ``v3`` (DeepSeek-V3 layout), ``v4``
(DeepSeek-V4 layout), and ``tokenizer`` (the byte-level tokenizer both ship). The trained tiny
DeepSeek, acceptance measured: ``corpus`` (its text), ``pretrain`` (target and MTP layer trained
together), ``export`` (written as a DeepSeek-V3 checkpoint), ``trained`` (rebuild it, or write the
shipped files). ``build`` is ``vllm-mtp build-tiny``; ``presets`` turns a checkpoint argument of
``bench`` and ``tune`` (a directory or ``PRESET[:MODE[:ACCEPTANCE]]``) into a directory, building
the preset once.

This file imports nothing, so that ``vllm-mtp --help`` lists the modes without loading torch.
"""

CONSTRUCTED_MODES = ("random", "oracle", "noisy")  # what v3 and v4 build
BUILD_TINY_MODES = (*CONSTRUCTED_MODES, "trained")  # what ``vllm-mtp build-tiny --mode`` accepts
