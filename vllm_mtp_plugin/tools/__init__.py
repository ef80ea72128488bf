"""What users run around the plugin: the ``vllm-mtp`` command, demo, server launcher, metrics,
offline runner, checkpoint inspector, tiny checkpoints and the benchmark.

vLLM never imports anything here; the plugin part of the package (``register``, ``patches``,
``platform``, ``ops``, ``models``, ``weights``) never imports from here.
"""
