"""Runtime-adaptive k: the number of drafts per engine step chosen from measured acceptance and
measured step cost (``controller.py``), handed to vLLM's scheduler through the per-step
spec-token count its static ``num_speculative_tokens_per_batch_size`` table drives
(``patches/adaptive_k_in_scheduler.py``). Switched on by ``VLLM_MTP_ADAPTIVE_K=1``."""
