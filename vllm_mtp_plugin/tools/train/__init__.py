"""``vllm-mtp train``: train the MTP layer(s) of a DeepSeek-V3-layout target on its own outputs.

``collect`` (data through vLLM) -> ``trainer`` (transformers' MTP layer, target's embedding and head
frozen) -> ``export`` (a checkpoint the plugin serves). ``cli`` ties them together; ``run`` is one
training run (a process, or a ``torchrun`` rank). Beneath them: ``target`` (the target training
accepts, read through ``tools/checkpoint``), ``data`` (prompts in, shards of hidden states out),
``layers`` (the trainable layer in DeepSeek's names), ``model`` (how the layers start, the
per-depth objective), ``optim`` (optimiser settings, schedule and expert balancing, shared with the
tiny model's pretraining), ``memory`` (the memory plan).
"""
