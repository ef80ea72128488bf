"""Checkpoint I/O for every tool: one answer to "how is a checkpoint read or written".

``target`` reads a checkpoint directory once (config.json, safetensors headers; tensors on demand,
block-FP8 dequantized); ``files`` writes a new one beside a target (its files linked, MTP-layer
shards added, index and config updated, the start-up check run); ``quantize`` holds the
quantisation maths (block FP8, FP4, UE8M0 scales); ``report`` is what ``vllm-mtp inspect`` prints
(and ``doctor`` starts from). ``graft``, ``train``, ``tiny``, ``mtp_layer`` and ``inspect`` build
on it. The plugin part's own reading (``weights/``) is what vLLM's processes run; this package
reads through it (``weights.headers``, ``weights.preflight``).
"""
