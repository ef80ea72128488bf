"""Concurrent streaming completions with the ``openai`` client, timed the way vLLM times them.

Per request: TTFT = first streamed chunk carrying a choice - send time; latency = last such chunk -
send time; TPOT = (latency - TTFT) / (output tokens - 1), output tokens from the usage chunk. These
are ``vllm bench serve``'s definitions (``benchmarks/lib/endpoint_request_func.py``,
``benchmarks/serve.py``), so the two tools can be compared on one server. Requests use
``ignore_eos``: every request produces exactly ``max_tokens`` tokens. They are greedy unless a
temperature is given; sampled requests carry the seed ``seed + i`` (request i of the pass). A
prompt given as a message list is sent as a chat completion (the model's chat template).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def _stream(client, model: str, prompt: str | list[dict], max_tokens: int,
                  temperature: float, seed: int | None):
    """A streamed completion, or a chat completion when ``prompt`` is a message list."""
    fields = dict(model=model, max_tokens=max_tokens, temperature=temperature, stream=True,
                  stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                  **({"seed": seed} if seed is not None and temperature else {}))
    if isinstance(prompt, list):
        return await client.chat.completions.create(messages=prompt, **fields)
    return await client.completions.create(prompt=prompt, **fields)


def _carries_output(chunk) -> bool:
    """A chunk with generated text (a chat stream opens with a role-only delta)."""
    if not chunk.choices:
        return False
    delta = getattr(chunk.choices[0], "delta", None)
    return delta is None or bool(delta.content)


async def _one(client, model: str, prompt: str | list[dict], max_tokens: int,
               temperature: float = 0.0, seed: int | None = None) -> dict:
    start = time.perf_counter()
    ttft = None
    last = start
    tokens = None
    stream = await _stream(client, model, prompt, max_tokens, temperature, seed)
    async for chunk in stream:
        if _carries_output(chunk):
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
               on_done: Callable[[], None] | None, temperature: float,
               seed: int | None) -> tuple[list[dict], float]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0, timeout=3600.0)
    gate = asyncio.Semaphore(concurrency)

    async def limited(i: int, prompt: str) -> dict:
        async with gate:
            result = await _one(client, model, prompt, max_tokens, temperature,
                                None if seed is None else seed + i)
        if on_done:
            on_done()
        return result

    try:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(limited(i, p) for i, p in enumerate(prompts)))
        return list(results), time.perf_counter() - t0
    finally:
        await client.close()


def run_requests(base_url: str, model: str, prompts: list[str], max_tokens: int,
                 concurrency: int, on_done: Callable[[], None] | None = None,
                 temperature: float = 0.0, seed: int | None = None):
    """Send every prompt, at most ``concurrency`` at a time. Returns (per-request, wall seconds)."""
    return asyncio.run(_run(base_url, model, prompts, max_tokens, concurrency, on_done,
                            temperature, seed))


def served_model(base_url: str) -> str:
    """The first model a server lists (for a server given by ``--base-url``)."""
    from openai import OpenAI

    with OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0) as client:
        return client.models.list().data[0].id
