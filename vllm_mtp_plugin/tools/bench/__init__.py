"""``vllm-mtp bench``: acceptance and throughput of MTP speculative decoding, plugin vs in-tree.

Modules: ``sweep`` (the configurations), ``offline_mode`` / ``serve_mode`` (measure them),
``analysis`` (percentiles, speed-ups, the ideal bound), ``report`` (JSON, Markdown, plots),
``crosscheck`` (vLLM's own ``vllm bench serve`` on the same server), ``cli``. From the shared
floor: prompt sets (``prompt_files``), checkpoints and tiny presets (``tiny/presets``), what a
measurement can physically be (``throughput/plausibility``), acceptance intervals (``stats``),
and the engines, their step timings and the CPU other processes took (``engine/``).
"""
