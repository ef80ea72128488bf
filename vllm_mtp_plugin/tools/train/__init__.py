"""``vllm-mtp train``: train the MTP layer(s) of a DeepSeek-V3-layout target on its own outputs.

``collect`` (data through vLLM) -> ``trainer`` (transformers' MTP layer, target's embedding and head
frozen) -> ``export`` (a checkpoint the plugin serves). ``cli`` ties them together.
"""
