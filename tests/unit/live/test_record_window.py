"""``vllm-mtp serve --record``'s windows without an engine: only the window's own rows are written
(other traffic's rows in the same drafter calls are dropped), the shard is streamed (the API
server's memory does not grow with the window: measured on a window of several hundred MB), no
shard outgrows ``--record-max-gb``, and a full disk or a failing window pauses recording, which
then resumes by itself.

The drafter calls are made as vLLM's workers make them (``recording.record`` with token ids,
positions and hidden states, chunked and interleaved with other requests' rows); the engine around
them is a stand-in for ``AsyncLLM`` with the two calls the recorder makes
(``collective_rpc`` and ``generate``). The engine tests (``test_live_record.py``) run the same
through vLLM."""

import asyncio
import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save

from vllm_mtp_plugin import recording
from vllm_mtp_plugin.recording_window import WindowRows
from vllm_mtp_plugin.tools.live import recorder as recorder_module
from vllm_mtp_plugin.tools.live import recording_dir
from vllm_mtp_plugin.tools.live.options import RecordSettings
from vllm_mtp_plugin.tools.live.recorder import TrafficRecorder
from vllm_mtp_plugin.tools.mtp_layer.shard_format import SequenceStore
from vllm_mtp_plugin.tools.mtp_layer.shard_writer import Entry, write_pieces

WIDTH = 8


def state(token_context: tuple, position: int) -> torch.Tensor:
    """A hidden state that depends on the whole context up to ``position`` (as causal attention
    makes it): another request's row at the same position differs."""
    seed = hash((token_context[:position + 1], position)) % (2**31)
    return torch.randn(WIDTH, generator=torch.Generator().manual_seed(seed))


def call_rows(ids: list[int], start: int, stop: int, next_token: int):
    """The drafter's rows of positions ``start .. stop - 1`` of a request: token i + 1 at i, and
    at the request's last position the token the target sampled."""
    fed = ids[1:] + [next_token]
    context = tuple(ids)
    return ([fed[p] for p in range(start, stop)], list(range(start, stop)),
            [state(context, p) for p in range(start, stop)])


def record_call(parts) -> None:
    ids = [t for p in parts for t in p[0]]
    pos = [q for p in parts for q in p[1]]
    hidden = torch.stack([h for p in parts for h in p[2]])
    recording.record(torch.tensor(ids), torch.tensor(pos), hidden)


def test_only_the_windows_rows_are_taken_in_chunks_and_beside_other_traffic():
    mine = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 20, 21]]  # a shared prefix of three tokens
    window = WindowRows(mine)
    # another request's decode row; the first request's first chunk (positions 0-2), which the
    # second request shares: the same tokens up to position 2, so the same states there (the
    # chunk's last row carries the first request's next token, the state is the shared one);
    # the second request's own prefill, its first rows no longer needed, its last row carrying
    # the token the target samples (55)
    ranges, segments = window.take([99, 6, 7, 8, 6, 7, 20, 21, 55], [12, 0, 1, 2, 0, 1, 2, 3, 4])
    assert ranges == [(1, 4), (7, 9)]
    assert segments == [(0, 0, 0, 3, 1), (1, 0, 0, 3, 1), (1, 3, 3, 2, 1)]
    # another user's prefill with the same first tokens comes too late; the first request's
    # last chunk, ending at its last position
    ranges, segments = window.take([6, 7, 30, 9, 10, 11, 77], [0, 1, 2, 3, 4, 5, 6])
    assert ranges == [(3, 7)] and segments == [(0, 0, 3, 4, 1)]
    assert window.take([40], [13]) == ([], [])
    assert window.cursor == [7, 5] and window.rows_kept == 9 and window.rows_dropped == 8


def test_rows_of_other_requests_are_dropped_by_owner_whatever_their_tokens():
    """Another request's decode rows at exactly the position a window request needs next, with
    exactly its token, placed before the window's own chunk: by tokens alone they would be taken
    (and the request's own rows then dropped); with the runner's owners they are dropped."""
    mine = [list(range(10, 20))]
    ids, pos = [11, 12, 13, 14, 15], [0, 1, 2, 3, 4]
    foreign = ([16, 99], [5, 6])  # its token at position 5 equals the window's
    chunk = ([16, 17, 18, 19, 50], [5, 6, 7, 8, 9])
    by_tokens = WindowRows(mine)
    by_tokens.take(ids, pos)
    ranges, segments = by_tokens.take(foreign[0] + chunk[0], foreign[1] + chunk[1])
    assert segments[0] == (0, 0, 5, 2, 1)  # the foreign rows: what owners prevent
    by_owner = WindowRows(mine)
    by_owner.take(ids, pos, own=[True] * 5)
    ranges, segments = by_owner.take(foreign[0] + chunk[0], foreign[1] + chunk[1],
                                     own=[False, False] + [True] * 5)
    assert ranges == [(2, 7)] and segments == [(0, 0, 5, 5, 1)]
    assert by_owner.cursor == [10] and by_owner.rows_dropped == 2


def test_row_owners_read_the_runners_batch():
    """V1: ``input_batch.req_ids`` with ``query_start_loc`` (rows past the batch: padding);
    Model Runner V2: the batch its speculator's ``propose`` is handed, kept while it proposes
    (``watch_v2_batch``, undone at the stop); a call with fewer rows than the batch (rejected
    rows dropped) cannot be told: None."""
    import numpy as np

    from vllm_mtp_plugin.recording_window import row_owners

    v1 = SimpleNamespace(input_batch=SimpleNamespace(num_reqs=2, req_ids=["a", "b", None]),
                         query_start_loc=SimpleNamespace(cpu=torch.tensor([0, 3, 5, 0])))
    assert row_owners(v1, 6) == ["a", "a", "a", "b", "b", None]
    assert row_owners(v1, 4) is None
    from vllm_mtp_plugin.recording_window import watch_v2_batch

    batch = SimpleNamespace(req_ids=["x", "y"], query_start_loc_np=np.array([0, 1, 4]))
    seen = []

    class Speculator:
        def propose(self, input_batch, *args):
            seen.append(row_owners(v2, 4, holder["batch"]))
            return "drafts"

    v2, holder = SimpleNamespace(speculator=Speculator()), {"batch": None}
    unwatch = watch_v2_batch(v2, holder)
    assert v2.speculator.propose(batch, 1, 2) == "drafts"
    assert seen == [["x", "y", "y", "y"]] and holder["batch"] is None
    assert row_owners(v2, 4, None) is None  # outside a propose: not known
    unwatch()
    assert "propose" not in vars(v2.speculator)
    assert row_owners(SimpleNamespace(), 4) is None


def test_a_last_position_alone_is_kept_as_a_candidate_for_one_call():
    """A request whose last chunk is its last position alone: that row's token is the one the
    target samples, unknown to the worker. Lone rows at that position in the next call are kept
    as candidates (``exact`` 0; the recorder keeps the one with the sampled token); a run of
    another request through that position is not one, and a later call has none."""
    window = WindowRows([[1, 2, 3, 4]])
    assert window.take([2, 3, 4], [0, 1, 2]) == ([(0, 3)], [(0, 0, 0, 3, 1)])  # ends at 2
    # next call: another request's run through position 3, then two lone rows at position 3
    assert window.take([50, 51, 52, 60, 70], [2, 3, 4, 3, 3]) == (
        [(3, 4), (4, 5)], [(0, 0, 3, 1, 0), (0, 1, 3, 1, 0)])
    assert window.take([80], [3]) == ([], [])  # the call after: no longer


def test_a_streamed_shard_reads_as_safetensors_writes_it(tmp_path):
    tensors = {"tokens": torch.arange(7), "hidden": torch.randn(5, 3).to(torch.bfloat16)}
    entries = [Entry("tokens", torch.int64, (7,), [tensors["tokens"][:3], tensors["tokens"][3:]]),
               Entry("hidden", torch.bfloat16, (5, 3), [tensors["hidden"][i:i + 1]
                                                        for i in range(5)])]
    size = write_pieces(tmp_path / "a.safetensors", entries, {"format": "x"})
    (tmp_path / "b.safetensors").write_bytes(save(tensors, {"format": "x"}))
    streamed, whole = load_file(tmp_path / "a.safetensors"), load_file(tmp_path / "b.safetensors")
    assert size == (tmp_path / "a.safetensors").stat().st_size
    assert streamed.keys() == whole.keys()
    assert all(torch.equal(streamed[k], whole[k]) for k in whole)
    short = [Entry("tokens", torch.int64, (8,), [tensors["tokens"]])]
    with pytest.raises(ValueError, match="tokens: its pieces hold 56 bytes, its shape \\[8\\] "):
        write_pieces(tmp_path / "c.safetensors", short, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "b.safetensors"]


class StandInEngine:
    """``AsyncLLM`` as the recorder uses it: ``collective_rpc`` reaches the recording extension
    of one worker, ``generate`` prefills a request in ``chunk``-token drafter calls, each
    interleaved with two rows of another user's request."""

    def __init__(self, chunk: int = 5, max_model_len: int = 4096):
        self.chunk = chunk
        self.model_config = SimpleNamespace(
            max_model_len=max_model_len, dtype=torch.float32,
            hf_config=SimpleNamespace(), get_hidden_size=lambda: WIDTH)
        self.prefills, self.salts = [], []

    async def collective_rpc(self, method, args=()):
        if method == "start_mtp_recording":
            recording.start(args[0], args[1], tag="dp0-pid1-", sequences=args[2])
            return [True]
        return [recording.stop()]

    async def generate(self, prompt, params, request_id):
        ids = list(prompt["prompt_token_ids"])
        self.prefills.append(len(ids))
        self.salts.append(prompt.get("cache_salt"))
        next_token = sum(ids) % 97
        foreign = list(range(100, 100 + len(ids) + 2))
        for start in range(0, len(ids), self.chunk):
            stop = min(start + self.chunk, len(ids))
            other = call_rows(foreign, start, start + 2, 0)
            record_call([other, call_rows(ids, start, stop, next_token)])
            await asyncio.sleep(0)
        yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[next_token])])


@pytest.fixture
def stand_in(monkeypatch):
    engine = StandInEngine()
    monkeypatch.setattr(recorder_module, "unpatched_generate", lambda: StandInEngine.generate)
    yield engine
    recording.stop()


async def _serve(recorder, engine, requests, settle: float = 0.0):
    for prompt, output in requests:
        recorder.offer(engine, prompt, output)
        await asyncio.sleep(0)
    await asyncio.sleep(settle)


def _settings(tmp_path, **kwargs):
    return RecordSettings(directory=tmp_path / "rec", fraction=1.0, window_wait_s=0.05,
                          min_free_bytes=0, **kwargs)


async def until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the recorder did not get there in time"
        await asyncio.sleep(0.01)


def test_windows_write_only_their_requests_within_their_budget(tmp_path, stand_in):
    (tmp_path / "rec").mkdir(mode=0o700)
    recorder = TrafficRecorder(_settings(tmp_path, window_tokens=40))
    requests = [([1, 2, 3, 4, 5, 6], [7, 8, 9, 10]), ([11] * 12, [12] * 10),  # 10, 22 tokens
                ([21, 22], list(range(30, 90)))]  # 62 tokens: cut to the window's 40

    async def traffic():
        recorder.offer(stand_in, *requests[0])
        recorder.offer(stand_in, *requests[1], cache_salt="tenant-b")  # re-prefilled with it
        await _serve(recorder, stand_in, requests[2:], settle=0)
        await until(lambda: recorder.stats["recorded"] == 3)

    asyncio.run(traffic())
    assert stand_in.prefills == [10, 22, 40] and stand_in.salts == [None, "tenant-b", None]
    assert recorder.stats["cut_requests"] == 1
    assert len(list((tmp_path / "rec").glob("shard-*"))) == 2  # 10 + 22, then 40: the budget
    store = SequenceStore(tmp_path / "rec")
    assert sorted(len(store.hidden[i]) for i in range(len(store))) == [10, 22, 40]
    for i in range(len(store)):
        ids = store.tokens[i].tolist()[:-1]
        assert store.tokens[i][-1] == sum(ids) % 97
        assert torch.equal(store.hidden[i], torch.stack([state(tuple(ids), p)
                                                         for p in range(len(ids))]))
    # other traffic's two rows per drafter call never reached the disk
    assert recorder.stats["rows_written"] == 72
    assert recorder.stats["rows_dropped"] == 2 * (2 + 5 + 8)  # per chunk of 5 rows


def test_no_shard_outgrows_the_bound(tmp_path, stand_in, monkeypatch):
    """8 KiB of shards at most: a window holds (8192 - 1024) / (32 + 8) = 179 tokens of 32-byte
    rows (1 KiB kept for a shard's header and tables), so 300-token requests are cut to it;
    uncut, one would make a 12 KB shard."""
    monkeypatch.setattr(recorder_module, "SHARD_OVERHEAD_BYTES", 1024)
    (tmp_path / "rec").mkdir(mode=0o700)
    recorder = TrafficRecorder(_settings(tmp_path, max_bytes=8192))
    requests = [(list(range(1, 100)), list(range(100, 301)))] * 3

    async def traffic():
        await _serve(recorder, stand_in, requests, settle=0)
        await until(lambda: recorder.stats["recorded"] == 3)

    asyncio.run(traffic())
    assert recorder.window_tokens(stand_in) == 179 and stand_in.prefills == [179] * 3
    sizes = [p.stat().st_size for p in (tmp_path / "rec").glob("shard-*")]
    assert sizes and max(sizes) <= 8192 and max(sizes) > 179 * 32
    assert sum(sizes) <= 8192  # the directory's bound removed the older shards


def test_a_full_disk_pauses_recording_and_it_resumes(tmp_path, stand_in, monkeypatch):
    """Faults injected: the shard write fails with ENOSPC, then the disk reports too little
    free room; each pauses recording (offers meanwhile are counted, not queued), and once the
    pause is over the next window is written. No exception reaches the caller of ``offer``."""
    (tmp_path / "rec").mkdir(mode=0o700)
    monkeypatch.setattr(recorder_module, "FIRST_PAUSE_S", 0.3)
    recorder = TrafficRecorder(_settings(tmp_path))
    real_write, real_usage = recorder_module.write_window_shard, recorder_module.shutil.disk_usage
    faults = {"enospc": 1, "free": None}

    def failing_write(*args, **kwargs):
        if faults["enospc"]:
            faults["enospc"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(*args, **kwargs)

    def usage(path):
        return SimpleNamespace(free=faults["free"]) if faults["free"] is not None \
            else real_usage(path)

    monkeypatch.setattr(recorder_module, "write_window_shard", failing_write)
    monkeypatch.setattr(recorder_module.shutil, "disk_usage", usage)
    request = ([1, 2, 3], [4, 5, 6])
    paused = lambda: time.monotonic() < recorder.paused_until  # noqa: E731

    async def traffic():
        await _serve(recorder, stand_in, [request], settle=0)
        await until(lambda: recorder.stats["pauses"] == 1)
        await _serve(recorder, stand_in, [request], settle=0)  # during the pause: skipped
        assert recorder.stats["skipped_paused"] == 1
        await until(lambda: not paused())
        await _serve(recorder, stand_in, [request], settle=0)  # resumed: written
        await until(lambda: recorder.stats["recorded"] == 1)
        faults["free"] = 10  # bytes free: below --record-min-free-gb
        recorder.settings.min_free_bytes = 1000
        await _serve(recorder, stand_in, [request], settle=0)
        await until(lambda: recorder.stats["pauses"] == 2)
        assert recorder.stats["recorded"] == 1
        assert len(stand_in.prefills) == 2  # the window without room never prefilled
        faults["free"] = None
        await until(lambda: not paused())
        await _serve(recorder, stand_in, [request], settle=0)
        await until(lambda: recorder.stats["recorded"] == 2)

    asyncio.run(traffic())
    assert recorder.stats["failed_windows"] == 2
    assert len(list((tmp_path / "rec").glob("shard-*.safetensors"))) == 2
    assert not list((tmp_path / "rec").glob(".raw-*")) and not list(
        (tmp_path / "rec").glob("*.partial"))


def test_old_shards_go_after_max_age(tmp_path):
    for i, age_h in enumerate((30, 10, 1)):
        path = tmp_path / f"shard-{i}.safetensors"
        path.write_bytes(b"x" * 10)
        then = time.time() - age_h * 3600
        os.utime(path, (then, then))
    assert recording_dir.enforce_bound(tmp_path, 10**9, max_age_s=24 * 3600) == ["shard-0.safetensors"]
    assert recording_dir.enforce_bound(tmp_path, 10**9, max_age_s=3600 / 2) == [
        "shard-1.safetensors", "shard-2.safetensors"]  # the newest too, once it is too old


PEAK_SCRIPT = r"""
import json, sys
from pathlib import Path
import torch
from vllm_mtp_plugin.tools.live.window_shard import write_window_shard


def peak_kib():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])


raw, out = Path(sys.argv[1]), Path(sys.argv[2])
batch = json.loads((raw / "batch.json").read_text())
Path("/proc/self/clear_refs").write_text("5")  # the peak restarts from what is resident now
before = peak_kib()
kept, tokens, row_bytes = write_window_shard(raw, [tuple(b) for b in batch],
                                             [0] * len(batch), out, {})
print(json.dumps({"kept": kept, "tokens": tokens, "growth_kib": peak_kib() - before,
                  "vllm_imported": "vllm" in sys.modules}))
"""


def test_writing_a_large_window_keeps_memory_bounded(tmp_path):
    """A window of 16 requests x 4096 tokens of 2048-wide fp32 states (512 MiB of raw rows, as
    32 drafter calls): the process that writes its shard grows by less than 96 MiB (a piece is
    16 MiB; the rest is the shard's token tables and the allocator)."""
    raw = tmp_path / "raw"
    raw.mkdir()
    width, length, requests = 2048, 4096, 16
    batch = [([r] + list(range(1, length)), length // 2) for r in range(requests)]
    for r in range(requests):
        for half in range(2):
            rows = length // 2
            hidden = torch.full((rows, width), float(r))
            segments = torch.tensor([[r, 0, half * rows, rows, 1]])
            Path(raw / f"call-{r:03d}-{half}.safetensors").write_bytes(save(
                {"hidden_states": hidden, "segments": segments,
                 "input_ids": torch.zeros(rows, dtype=torch.int64),
                 "positions": torch.arange(half * rows, (half + 1) * rows)}))
    (raw / "batch.json").write_text(json.dumps(batch))
    out = tmp_path / "shard-x.safetensors"
    script = tmp_path / "peak.py"  # a process of its own for its peak memory; it runs no vLLM
    script.write_text(PEAK_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(raw), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["kept"] == requests and figures["tokens"] == requests * length
    assert not figures["vllm_imported"]
    assert out.stat().st_size > requests * length * width * 4
    assert figures["growth_kib"] < 96 * 1024, figures
    from safetensors import safe_open
    with safe_open(str(out), "pt") as handle:
        rows = handle.get_slice("hidden")
        assert rows[length * 5:length * 5 + 2].eq(5.0).all()
        assert rows[-1:].eq(float(requests - 1)).all()
