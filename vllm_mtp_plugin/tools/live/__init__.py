"""What ``vllm-mtp serve`` adds to ``vllm serve`` for live traffic: ``--record DIR`` writes the
drafter's inputs of a sample of served requests as training shards (``recorder.py``)."""
