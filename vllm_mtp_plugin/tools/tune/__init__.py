"""``vllm-mtp tune``: the k (num_speculative_tokens) per batch size that serves fastest here.

``cli`` measures (``tools/throughput/measure.py``), predicts (``throughput/prediction.py``) and
prints the ``--speculative-config``; ``check`` holds its pick against a fixed-k sweep; ``plot``."""
