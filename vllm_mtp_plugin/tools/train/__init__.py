"""``vllm-mtp train``: train the MTP layer(s) of a DeepSeek-V3-layout target on its own outputs.

``collect`` (data through vLLM) -> ``trainer`` (transformers' MTP layer, target's embedding and head
frozen) -> ``export`` (a checkpoint the plugin serves). ``cli`` ties them together; ``run`` is one
training run (a process, or a ``torchrun`` rank). Beneath them: ``checkpoint`` (reads the target),
``data`` (prompts in, shards of hidden states out), ``layers`` (the trainable layer in DeepSeek's
names), ``model`` (how the layers start, the per-depth objective), ``memory`` (the memory plan).
"""
