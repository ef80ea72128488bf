"""What users run around the plugin; vLLM never imports anything here.

The commands stand side by side, each importing only the shared floor below them, never another
command (``tests/unit/repo/test_layout.py`` reads the table in ``cli`` and checks it): ``demo``,
``inspect_cli`` (``inspect``), ``graft``, ``train/``, ``bench/``, ``tune/``, ``doctor/`` and
``live/`` (``serve``, ``reload``: what ``vllm-mtp serve`` adds for live traffic); ``cli`` is the
``vllm-mtp`` dispatcher, a table of ``"module:function"``.

The shared floor: ``engine/`` (offline engines, servers, their counters and timings),
``checkpoint/`` (reading a checkpoint once, writing one beside a target, the quantisation maths,
``inspect``'s report), ``tiny/`` (tiny checkpoints and presets; ``build-tiny``), ``mtp_layer/``
(the MTP layer in PyTorch, its data shards and its evaluation outside vLLM), ``state_collection``
(the drafter's inputs recorded through vLLM), ``throughput/`` (measured and expected throughput
per k and batch size), ``stats`` (intervals and medians), ``provenance`` (the code, command and
machine a results file records), ``cpu_features`` (the CPU's kernels and the engine arguments
that follow), ``prompt_files`` (every tool's prompt reader), ``plotting``; ``data/`` holds the
bundled prompts and the trained tiny DeepSeek.

The plugin part of the package (``register``, ``patches``, ``platform``, ``ops``, ``models``,
``weights``, ...) never imports from here (``tests/unit/repo/test_layout.py``).
"""
