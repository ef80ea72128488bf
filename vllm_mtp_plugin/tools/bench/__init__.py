"""``vllm-mtp bench``: acceptance and throughput of MTP speculative decoding, plugin vs in-tree.

Modules: ``prompts`` (prompt sets), ``checkpoints`` (paths or tiny presets), ``sweep`` (the
configurations), ``offline_mode`` / ``serve_mode`` (measure them), ``steptimer`` (the engine's own
per-step timings), ``interference`` (CPU other processes took meanwhile), ``plausibility`` (what
a measurement can physically be), ``stats`` (acceptance intervals), ``loadgen`` (streaming
OpenAI client), ``analysis`` (medians, percentiles, speed-ups, the ideal bound), ``report`` (JSON,
Markdown, plots), ``crosscheck`` (vLLM's own ``vllm bench serve`` on the same server), ``cli``.
"""
