"""What users run around the plugin; vLLM never imports anything here.

The commands: ``cli`` (``vllm-mtp``), ``demo``, ``inspect``, ``graft``, ``tiny/`` (``build-tiny``),
``train/``, ``bench/``, ``tune/``, ``doctor/``, and ``live/`` (what ``vllm-mtp serve`` adds for
live traffic: ``--record``). They run vLLM through ``engine/`` (offline engines, servers,
their counters and timings). Shared between them: ``provenance`` (the code, command and machine a
results file records), ``prompt_files`` (every tool's prompt-file reader) and ``checkpoint/``
(reading a checkpoint once, writing one beside a target, the quantisation maths, ``inspect``);
``data/`` holds the bundled prompts and the trained tiny DeepSeek.

The plugin part of the package (``register``, ``patches``, ``platform``, ``ops``, ``models``,
``weights``, ...) never imports from here (``tests/unit/repo/test_layout.py``).
"""
