"""``vllm-mtp serve --record DIR``: training shards from the requests a server finishes.

A sampled fraction of finished requests (prompt + output token ids, from ``tap.py``) is
re-prefilled on the serving engine itself, in windows of up to ``window_requests``, while the
plugin's drafter records what it receives (``vllm_mtp_plugin.recording``, switched on through
``collective_rpc`` for the window only). Each window becomes one shard in the format
``vllm-mtp train --data`` reads (``tools/train/data.py``): per request its prompt and output, and
at every position the hidden state the drafter received - what the training pairs
(h_i, t_i+1) -> t_i+2 need.

Why re-prefill instead of keeping what the drafter saw while the request was served: with prefix
caching (vLLM's default) a cached prompt prefix never reaches the drafter, and without its hidden
states the MTP layer's own attention has no context to train on; decode steps hand the drafter
rows of rejected drafts and, under full CUDA graphs, run without Python at all. A re-prefill with
``skip_reading_prefix_cache`` gives every position in one pass, through the same engine and
kernels (``docs/live-traffic.md`` measures both). Its cost is one prefill of each recorded
request, a fraction ``F`` of the prefill work, which is small next to decoding its output.

Nothing here may fail a user's request: errors are logged, a window that fails is dropped, and
after three failures in a row recording stops (the server keeps serving).
"""

from __future__ import annotations

import asyncio
import random
import shutil
import time
import uuid
from collections import Counter
from pathlib import Path

from ..train.data import assemble, write_shard
from .options import RecordSettings
from .shards import directory_bytes, enforce_bound, raw_dir, remove_leftovers, shard_path
from .tap import OWN_REQUEST_PREFIX, unpatched_generate

FAILURES_BEFORE_STOPPING = 3


def _logger():
    from vllm.logger import init_logger

    return init_logger("vllm.vllm_mtp_plugin.record")


def _token_input(token_ids: list[int]):
    """A tokenized prompt as this vLLM's ``AsyncLLM.generate`` takes it without re-rendering."""
    try:
        from vllm.inputs.engine import tokens_input
    except ImportError:  # vLLM before rendered inputs: the plain TokensPrompt dict
        return {"prompt_token_ids": token_ids}
    return tokens_input(token_ids)


class TrafficRecorder:
    """Receives finished requests (``offer``) and writes shards from a background task."""

    def __init__(self, settings: RecordSettings):
        self.settings = settings
        self.directory = Path(settings.directory)
        self.rng = random.Random(settings.seed)
        self.stats: Counter = Counter()
        self.queue: asyncio.Queue | None = None
        self.task: asyncio.Task | None = None
        self.stopped: str | None = None
        self.windows = 0
        self.directory_bytes = directory_bytes(self.directory) if self.directory.is_dir() else 0
        removed = remove_leftovers(self.directory)
        if removed:
            _logger().info("vllm-mtp record: removed %d leftovers of stopped servers in %s",
                           len(removed), self.directory)

    # -- in the server's event loop, from every finished request
    def offer(self, engine, prompt_ids: list[int], output_ids: list[int]) -> None:
        self.stats["finished"] += 1
        if self.stopped or self.rng.random() >= self.settings.fraction:
            return
        if self.task is None:
            self.queue = asyncio.Queue(maxsize=4 * self.settings.window_requests)
            self.task = asyncio.get_running_loop().create_task(self._run(engine))
        try:
            self.queue.put_nowait((prompt_ids + output_ids, len(prompt_ids)))
            self.stats["sampled"] += 1
        except asyncio.QueueFull:  # recording lags behind the traffic: this one is skipped
            self.stats["skipped_busy"] += 1

    async def _next_window(self) -> list[tuple[list[int], int]]:
        loop = asyncio.get_running_loop()
        batch = [await self.queue.get()]
        deadline = loop.time() + self.settings.window_wait_s
        while len(batch) < self.settings.window_requests:
            try:
                batch.append(self.queue.get_nowait())
                continue
            except asyncio.QueueEmpty:
                pass
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self.queue.get(), left))
            except asyncio.TimeoutError:
                break
        return batch

    async def _run(self, engine) -> None:
        failures = 0
        while not self.stopped:
            batch = await self._next_window()
            try:
                await self._window(engine, batch)
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - serving goes on
                failures += 1
                self.stats["failed_windows"] += 1
                _logger().exception("vllm-mtp record: a recording window failed (%s)", exc)
                if failures >= FAILURES_BEFORE_STOPPING:
                    self.stopped = f"{failures} windows failed in a row; last: {exc}"
                    _logger().error("vllm-mtp record: recording stopped (%s); the server goes "
                                    "on serving.", self.stopped)

    async def _window(self, engine, batch: list[tuple[list[int], int]]) -> None:
        limit = engine.model_config.max_model_len - 1  # the re-prefill samples one token
        batch = [(ids[:limit], min(n, limit)) for ids, n in batch if len(ids) >= 2]
        if not batch:
            return
        self.windows += 1
        raw = raw_dir(self.directory, self.windows)
        raw.mkdir(mode=0o700)
        started = time.monotonic()
        try:
            writers = await engine.collective_rpc("start_mtp_recording", args=(str(raw), False))
            if not any(writers):
                raise RuntimeError("no vLLM worker records the drafter's inputs")
            try:
                next_tokens = await asyncio.gather(*(self._prefill(engine, ids)
                                                     for ids, _ in batch))
            finally:
                await engine.collective_rpc("stop_mtp_recording")
            path = shard_path(self.directory, self.windows)
            kept, tokens, removed = await asyncio.to_thread(self._write, raw, batch, next_tokens,
                                                            path)
        finally:
            shutil.rmtree(raw, ignore_errors=True)
            self.stats["window_seconds"] += time.monotonic() - started
        self.stats["recorded"] += kept
        self.stats["incomplete"] += len(batch) - kept
        self.stats["tokens"] += tokens
        self.stats["shards_removed"] += len(removed)
        self.directory_bytes = directory_bytes(self.directory)
        _logger().info(
            "vllm-mtp record: %s: %d of %d requests, %d tokens (%.2f s); %d of %d finished "
            "requests recorded so far; %s holds %.3f GB of %.3f%s", path.name if kept else
            "no shard", kept, len(batch), tokens, time.monotonic() - started,
            self.stats["recorded"], self.stats["finished"], self.directory,
            self.directory_bytes / 1e9, self.settings.max_bytes / 1e9,
            f" (removed the oldest: {', '.join(removed)})" if removed else "")

    async def _prefill(self, engine, token_ids: list[int]) -> int:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                skip_reading_prefix_cache=True)
        final = None
        async for output in unpatched_generate()(engine, _token_input(token_ids), params,
                                                 f"{OWN_REQUEST_PREFIX}{uuid.uuid4().hex}"):
            final = output
        return final.outputs[0].token_ids[0]

    def _write(self, raw: Path, batch, next_tokens, path: Path) -> tuple[int, int, list[str]]:
        """Assemble the window's sequences from the raw calls; write the complete ones."""
        from safetensors.torch import load_file

        calls = [load_file(str(f)) for f in sorted(raw.glob("call-*.safetensors"))]
        fed = [ids[1:] + [t] for (ids, _), t in zip(batch, next_tokens)]
        hidden = assemble(calls, fed, allow_missing=True)
        keep = [i for i, h in enumerate(hidden) if h is not None]
        if not keep:
            return 0, 0, []
        sequences = [batch[i][0] for i in keep]
        write_shard(path, sequences, [next_tokens[i] for i in keep], [hidden[i] for i in keep],
                    [batch[i][1] for i in keep],
                    {"source": "vllm-mtp serve --record", "recorded_at": time.strftime(
                        "%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, private=True)
        return len(keep), sum(map(len, sequences)), enforce_bound(self.directory,
                                                                   self.settings.max_bytes)
