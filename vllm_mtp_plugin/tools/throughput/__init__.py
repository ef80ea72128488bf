"""Throughput with and without MTP: measured through vLLM per (k, batch size) (``measure``),
expected from the measurements (``prediction``: the throughput model, best k, vLLM's schedule),
and checked against what is physically possible (``plausibility``). ``tune`` picks k with it,
``doctor`` advises on batch size, ``bench`` checks its rows."""
