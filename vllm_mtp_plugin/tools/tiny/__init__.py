"""Tiny DeepSeek checkpoints built on this machine: V3 layout (``v3``), V4 layout (``v4``) and the
byte-level tokenizer both ship (``tokenizer``)."""
