"""``vllm-mtp doctor``: does MTP work on this machine, and why is a checkpoint's acceptance low.

``selftest`` (no model): the plugin checked on tiny checkpoints in this platform's default engine
mode; ``diagnosis`` (a user's checkpoint): the start-up check, a served probe and the layer
evaluated outside vLLM (``mtp_layer/evaluation``), turned into a verdict (``verdict``) with
advice; ``platform_facts`` what the report says about the machine, ``checks`` the
table and the JSON every run writes.
"""
