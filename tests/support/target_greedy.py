"""What the target alone says: transformers' fp32 greedy continuation of given prompt ids, the
reference for "speculative decoding changed no output" in tests that serve through vLLM in fp32
(``test_trained_model.py`` shows vLLM's fp32 greedy equals it)."""

from pathlib import Path


def mismatches(model_dir: Path, cases: list[tuple[list[int], list[int]]]) -> list[int]:
    """Indices of the ``(prompt_ids, output_ids)`` whose output is not the target's own greedy
    continuation of that length."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    hf = DeepseekV3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    wrong = []
    for i, (prompt, output) in enumerate(cases):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=len(output),
                              do_sample=False, eos_token_id=None)
        if out[0, len(prompt):].tolist() != list(output):
            wrong.append(i)
    return wrong
