"""``vllm-mtp train``: train the MTP layer(s) of a DeepSeek-V3-layout target on its own outputs.

Collection (data through vLLM: ``tools/state_collection.py``) -> ``trainer`` (transformers' MTP
layer, target's embedding and head frozen) -> ``export`` (a checkpoint the plugin serves). ``cli``
ties them together; ``run`` is one training run (a process, or a ``torchrun`` rank); ``memory`` is
the memory plan. The layer itself, its target, its data shards and its optimiser are
``tools/mtp_layer/``'s, shared with ``doctor``, ``live`` and the tiny model's pretraining.
"""
