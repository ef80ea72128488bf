"""``vllm-mtp tune``: the k (num_speculative_tokens) per batch size that serves fastest here."""
