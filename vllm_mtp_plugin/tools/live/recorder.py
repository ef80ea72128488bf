"""``vllm-mtp serve --record DIR``: training shards from the requests a server finishes.

A sampled fraction of finished requests (prompt + output token ids, from ``tap.py``) is
re-prefilled on the serving engine itself, in windows of up to ``window_requests``, while the
plugin's drafter records what it receives (``vllm_mtp_plugin.recording``, switched on through
``collective_rpc`` for the window only). Each window becomes one shard in the format
``vllm-mtp train --data`` reads (``tools/mtp_layer/shard_format.py``): per request its prompt and
output, and at every position the hidden state the drafter received - what the training pairs
(h_i, t_i+1) -> t_i+2 need.

Why re-prefill instead of keeping what the drafter saw while the request was served: with prefix
caching (vLLM's default) a cached prompt prefix never reaches the drafter, and without its hidden
states the MTP layer's own attention has no context to train on; decode steps hand the drafter
rows of rejected drafts and, under full CUDA graphs, run without Python at all. A re-prefill with
``skip_reading_prefix_cache`` gives every position in one pass, through the same engine and
kernels (``docs/live-traffic.md`` measures both). Its cost is one prefill of each recorded
request, a fraction ``F`` of the prefill work, which is small next to decoding its output.

Bounded: a window holds at most ``window_requests`` requests and ``window_tokens`` tokens, and
never more than a shard within ``--record-max-gb`` holds (a longer request is cut there); only the
window's own rows leave the workers (other traffic's rows are dropped on the device:
``vllm_mtp_plugin/recording_window.py``), and the shard is written from them in pieces
(``window_shard.py``), so the API server's memory does not grow with the window. Shards older than
``--record-max-age`` go too.

Nothing here may fail a user's request: errors are logged and a window that fails is dropped;
after a failure, or when the disk has no room for a window, recording pauses (30 s, doubling up to
30 minutes while it goes on failing) and then resumes by itself; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import errno
import random
import shutil
import time
import uuid
from collections import Counter
from pathlib import Path

from .options import RecordSettings
from .recording_dir import directory_bytes, enforce_bound, raw_dir, remove_leftovers, shard_path
from .tap import OWN_REQUEST_PREFIX, unpatched_generate
from .window_shard import window_rows, write_window_shard

FIRST_PAUSE_S = 30.0
LONGEST_PAUSE_S = 1800.0
SHARD_OVERHEAD_BYTES = 64 * 2**10  # a shard's header and per-request tensors, with room


def _logger():
    from vllm.logger import init_logger

    return init_logger("vllm.vllm_mtp_plugin.record")


def _token_input(token_ids: list[int], cache_salt: str | None = None):
    """A tokenized prompt as this vLLM's ``AsyncLLM.generate`` takes it without re-rendering,
    with the request's cache salt (its blocks stay apart from other tenants' in the prefix
    cache, as the request's own did)."""
    try:
        from vllm.inputs.engine import tokens_input
    except ImportError:  # vLLM before rendered inputs: the plain TokensPrompt dict
        prompt = {"prompt_token_ids": token_ids}
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        return prompt
    return tokens_input(token_ids, cache_salt=cache_salt)


def row_bytes_of(model_config) -> int:
    """Bytes of one recorded row: the state the drafter receives (DeepSeek-V4: its hc_mult
    streams) in the model's dtype. Each window's raw calls correct it."""
    import torch

    streams = getattr(model_config.hf_config, "hc_mult", None) or 1
    return (model_config.get_hidden_size() * streams
            * torch.empty((), dtype=model_config.dtype).element_size())


class TrafficRecorder:
    """Receives finished requests (``offer``) and writes shards from a background task."""

    def __init__(self, settings: RecordSettings):
        self.settings = settings
        self.directory = Path(settings.directory)
        self.rng = random.Random(settings.seed)
        self.stats: Counter = Counter()
        self.queue: asyncio.Queue | None = None
        self.task: asyncio.Task | None = None
        # (token ids, prompt length, cache salt) drawn, but over the last window's budget
        self.held: tuple[list[int], int, str | None] | None = None
        self.paused_until = 0.0  # time.monotonic(); offers before it are skipped
        self.failures = 0  # in a row
        self.row_bytes: int | None = None
        self.windows = 0
        self.directory_bytes = directory_bytes(self.directory) if self.directory.is_dir() else 0
        removed = remove_leftovers(self.directory)
        if removed:
            _logger().info("vllm-mtp record: removed %d leftovers of stopped servers in %s",
                           len(removed), self.directory)

    # -- in the server's event loop, from every finished request
    def offer(self, engine, prompt_ids: list[int], output_ids: list[int],
              cache_salt: str | None = None) -> None:
        self.stats["finished"] += 1
        if self.rng.random() >= self.settings.fraction:
            return
        if time.monotonic() < self.paused_until:
            self.stats["skipped_paused"] += 1
            return
        if self.task is None:
            self.queue = asyncio.Queue(maxsize=4 * self.settings.window_requests)
            self.task = asyncio.get_running_loop().create_task(self._run(engine))
        ids, prompt = prompt_ids + output_ids, len(prompt_ids)
        cut = min(self.window_tokens(engine), engine.model_config.max_model_len - 1)
        if len(ids) > cut:  # cut now: the queue holds at most its length of windows' tokens
            self.stats["cut_requests"] += 1
            ids, prompt = ids[:cut], min(prompt, cut)
        try:
            self.queue.put_nowait((ids, prompt, cache_salt))
            self.stats["sampled"] += 1
        except asyncio.QueueFull:  # recording lags behind the traffic: this one is skipped
            self.stats["skipped_busy"] += 1

    def window_tokens(self, engine) -> int:
        """Tokens one window may hold: ``window_tokens``, within a shard of ``max_bytes`` and
        the model's length (a re-prefill samples one token after the last)."""
        if self.row_bytes is None:
            self.row_bytes = row_bytes_of(engine.model_config)
        fit = (self.settings.max_bytes - SHARD_OVERHEAD_BYTES) // (self.row_bytes + 8)
        return max(2, min(self.settings.window_tokens, fit))

    async def _next_window(self, budget: int, limit: int
                           ) -> list[tuple[list[int], int, str | None]]:
        """Up to ``window_requests`` requests of at most ``budget`` tokens in all, each cut to
        ``min(budget, limit)`` tokens; one that does not fit waits for the next window."""
        loop = asyncio.get_running_loop()
        batch, tokens = [], 0
        deadline = None
        while len(batch) < self.settings.window_requests:
            item, self.held = self.held, None
            if item is None:
                try:
                    item = self.queue.get_nowait()
                except asyncio.QueueEmpty:
                    if deadline is None:
                        item = await self.queue.get()
                    elif (left := deadline - loop.time()) <= 0:
                        break
                    else:
                        try:
                            item = await asyncio.wait_for(self.queue.get(), left)
                        except asyncio.TimeoutError:
                            break
            ids, prompt, salt = item
            cut = min(budget, limit)
            if len(ids) > cut:
                self.stats["cut_requests"] += 1
                ids, prompt = ids[:cut], min(prompt, cut)
            if batch and tokens + len(ids) > budget:
                self.held = (ids, prompt, salt)
                break
            batch.append((ids, prompt, salt))
            tokens += len(ids)
            if deadline is None:
                deadline = loop.time() + self.settings.window_wait_s
        return batch

    async def _run(self, engine) -> None:
        while True:
            limit = engine.model_config.max_model_len - 1  # the re-prefill samples one token
            batch = await self._next_window(self.window_tokens(engine), limit)
            try:
                self._room_for(sum(len(ids) for ids, _, _ in batch))
                await self._window(engine, batch)
                self.failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - serving goes on
                await self._pause(exc)

    def _room_for(self, tokens: int) -> None:
        """Refuse a window the disk has no room for: its raw rows and its shard, and
        ``min_free_bytes`` left for everything else on the disk."""
        need = 2 * tokens * (self.row_bytes or 0) + self.settings.min_free_bytes
        free = shutil.disk_usage(self.directory).free
        if free < need:
            raise OSError(errno.ENOSPC, f"{free / 1e9:.3g} GB free on the recording disk, a "
                          f"window of {tokens} tokens needs {need / 1e9:.3g} GB with the "
                          "margin kept free (--record-min-free-gb)")

    async def _pause(self, exc: Exception) -> None:
        """Drop the failed window, skip offers for a while, then go on."""
        self.failures += 1
        self.stats["failed_windows"] += 1
        pause = min(LONGEST_PAUSE_S, FIRST_PAUSE_S * 2 ** (self.failures - 1))
        self.paused_until = time.monotonic() + pause
        self.stats["pauses"] += 1
        full = isinstance(exc, OSError) and exc.errno == errno.ENOSPC
        _logger().error("vllm-mtp record: a recording window failed (%s%s); recording pauses "
                        "for %.0f s, the server goes on serving.", "disk full: " if full else "",
                        exc, pause, exc_info=not full)
        while self.queue is not None and not self.queue.empty():
            self.queue.get_nowait()
            self.stats["skipped_paused"] += 1
        self.held = None
        await asyncio.sleep(pause)
        self.paused_until = 0.0

    async def _window(self, engine, batch: list[tuple[list[int], int, str | None]]) -> None:
        batch = [(ids, n, salt) for ids, n, salt in batch if len(ids) >= 2]
        if not batch:
            return
        self.windows += 1
        raw = raw_dir(self.directory, self.windows)
        raw.mkdir(mode=0o700)
        started = time.monotonic()
        try:
            sequences = [ids for ids, _, _ in batch]
            writers = await engine.collective_rpc(
                "start_mtp_recording", args=(str(raw), False, sequences, OWN_REQUEST_PREFIX))
            if not any(writers):
                raise RuntimeError("no vLLM worker records the drafter's inputs")
            try:
                next_tokens = await asyncio.gather(*(self._prefill(engine, ids, salt)
                                                     for ids, _, salt in batch))
            finally:
                await engine.collective_rpc("stop_mtp_recording")
            path = shard_path(self.directory, self.windows)
            kept, tokens, row_bytes = await asyncio.to_thread(
                self._write, raw, [(ids, n) for ids, n, _ in batch], next_tokens, path)
            self.row_bytes = row_bytes or self.row_bytes
        finally:
            shutil.rmtree(raw, ignore_errors=True)
            self.stats["window_seconds"] += time.monotonic() - started
        removed = await asyncio.to_thread(enforce_bound, self.directory, self.settings.max_bytes,
                                          self.settings.max_age_s)
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

    async def _prefill(self, engine, token_ids: list[int], cache_salt: str | None) -> int:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                skip_reading_prefix_cache=True)
        final = None
        prompt = _token_input(token_ids, cache_salt)
        async for output in unpatched_generate()(engine, prompt, params,
                                                 f"{OWN_REQUEST_PREFIX}{uuid.uuid4().hex}"):
            final = output
        return final.outputs[0].token_ids[0]

    def _write(self, raw: Path, batch, next_tokens, path: Path) -> tuple[int, int, int | None]:
        """The window's complete requests, streamed into one shard (``write_window_shard``);
        the workers' row counts into the stats."""
        rows = window_rows(raw)
        self.stats["rows_written"] += rows.get("rows_kept", 0)
        self.stats["rows_dropped"] += rows.get("rows_dropped", 0)
        self.stats["calls_by_tokens"] += rows.get("calls_by_tokens", 0)
        return write_window_shard(raw, batch, next_tokens, path, {
            "source": "vllm-mtp serve --record",
            "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
