"""Which rows of a drafter call belong to a recording window's own requests.

``vllm-mtp serve --record`` re-prefills a window of finished requests on the serving engine while
other traffic goes on: the drafter's calls then carry rows of both. Only the window's rows may
reach the disk (the others are other users' traffic, and they would only be thrown away later), so
the worker keeps a row when it continues one of the window's requests where that request's
recording stands: at the next position it still needs, carrying its token there (the drafter is
fed token i + 1 of the request at position i, and at the last position the token the target
samples there, which only a row continuing the request's run may carry). A request's rows arrive in
position order (its prefill, in chunks), so each request has one cursor; rows of a request that
arrive again (a preempted request computed anew) are not written twice.

Rows of other traffic are told apart by their request: the worker maps each row of the call to
the request that owns it from the model runner's batch (``row_owners``: V1 and Model Runner V2),
and only rows of the recorder's own requests (their ids start with the prefix it gives) are
matched at all. Where the runner's layout cannot be read (a drafter batch that dropped rejected
rows), the tokens alone decide: a row of other traffic is then kept only if it sits at exactly the
position a window request needs next, with exactly its token, in the same step.

When a request's last chunk is its last position alone (whose token is the one the target
samples, not known here), a lone row at that position in the next call is kept as a candidate:
the recorder keeps the one that carries the sampled token.
"""

from __future__ import annotations

from collections import defaultdict


class WindowRows:
    """Per-request cursors over the window's sequences; ``take`` splits one call's rows."""

    def __init__(self, sequences: list[list[int]]):
        """``sequences``: each request's token ids (prompt and output)."""
        self.fed = [ids[1:] for ids in sequences]
        self.length = [len(ids) for ids in sequences]
        self.cursor = [0] * len(sequences)
        self.waiting: dict[tuple[int, int], set[int]] = defaultdict(set)
        for r, fed in enumerate(self.fed):
            if fed:
                self.waiting[(0, fed[0])].add(r)
        self.last_next: dict[int, set[int]] = {}  # position -> requests; see ``take``
        self.rows_kept = 0
        self.rows_dropped = 0
        self.calls_by_tokens = 0  # calls whose rows' owners were not known

    def _advance(self, r: int, to: int) -> None:
        fed, here = self.fed[r], self.cursor[r]
        self.waiting[(here, fed[here])].discard(r)
        self.cursor[r] = to
        if to < len(fed):
            self.waiting[(to, fed[to])].add(r)
        elif to == len(fed):  # a chunk ended just before the last position: next call, alone
            self.last_next.setdefault(to, set()).add(r)

    def _run(self, r: int, ids: list[int], pos: list[int], o: int, rows: int) -> int:
        """Rows from ``o`` (up to ``rows``) that continue request r: its tokens at consecutive
        positions, then its last position or a chunk's last row (a placeholder token; the state
        is real)."""
        fed, last, n = self.fed[r], self.length[r] - 1, 0
        while (o + n < rows and pos[o + n] == pos[o] + n < last
               and fed[pos[o + n]] == ids[o + n]):
            n += 1
        end = o + n
        if (n and end < rows and pos[end] == pos[o] + n <= last
                and (pos[end] == last or end + 1 == rows or pos[end + 1] != pos[end] + 1)):
            n += 1
        return n

    def take(self, ids: list[int], pos: list[int], own: list[bool] | None = None
             ) -> tuple[list[tuple[int, int]], list[tuple[int, int, int, int, int]]]:
        """``(row ranges to keep, segments)``: each range ``(start, stop)`` of the call's rows;
        each segment ``(request, first kept row, first position, rows, exact)``, the kept row
        counted in the kept rows only (ranges concatenated). ``exact`` 0: a lone row at a
        request's last position in the call after its previous chunk, whose token is the one
        the target sampled there - known to the recorder only once the window ends, which keeps
        the candidate that carries it. ``own``: per row, whether a request of the recorder owns
        it (None: not known); rows of other requests are dropped unread."""
        last_now, self.last_next = self.last_next, {}
        self.calls_by_tokens += own is None
        ranges, segments, kept, o = [], [], 0, 0
        while o < len(ids):
            if own is not None and not own[o]:
                self.rows_dropped += 1
                o += 1
                continue
            rows = len(ids)  # a run ends where another request's rows begin
            if own is not None:
                rows = next((i for i in range(o, len(ids)) if not own[i]), len(ids))
            found = [(self._run(r, ids, pos, o, rows), r)
                     for r in list(self.waiting.get((pos[o], ids[o]), ()))]
            found = [(n, r) for n, r in found if n]
            alone = o + 1 == rows or pos[o + 1] != pos[o] + 1
            if not found and alone and last_now.get(pos[o]):
                for r in sorted(last_now[pos[o]]):
                    segments.append((r, kept, pos[o], 1, 0))
                ranges.append((o, o + 1))
                kept, o = kept + 1, o + 1
                continue
            if not found:
                self.rows_dropped += 1
                o += 1
                continue
            longest = max(n for n, _ in found)
            for n, r in sorted(found, key=lambda f: f[1]):
                segments.append((r, kept, pos[o], n, 1))
                self._advance(r, pos[o] + n)
            ranges.append((o, o + longest))
            kept += longest
            o += longest
        self.rows_kept += kept
        return ranges, segments


def row_owners(runner, rows: int, v2_batch=None) -> list[str | None] | None:
    """The request owning each of a drafter call's ``rows`` (its first step), from the model
    runner's current batch: Model Runner V2's (``v2_batch``, the ``input_batch`` its speculator's
    ``propose`` was handed: ``watch_v2_batch``) or V1's ``input_batch`` with ``query_start_loc``,
    whose layout the first step keeps (vLLM's padded drafter batch, the default; rows past the
    batch are padding, owned by none). None when the call holds fewer rows than the batch (a
    drafter batch without rejected rows) or the batch is not known."""
    if v2_batch is not None:
        req_ids, starts = list(v2_batch.req_ids), v2_batch.query_start_loc_np.tolist()
    elif getattr(runner, "speculator", None) is not None:
        return None  # Model Runner V2 outside a watched propose
    else:
        batch, locs = getattr(runner, "input_batch", None), getattr(runner, "query_start_loc", None)
        if batch is None or locs is None:
            return None
        count = batch.num_reqs
        req_ids, starts = list(batch.req_ids[:count]), locs.cpu[:count + 1].tolist()
    if len(starts) != len(req_ids) + 1 or starts[-1] > rows:
        return None
    owners: list[str | None] = [None] * rows
    for req_id, start, stop in zip(req_ids, starts, starts[1:]):
        owners[start:stop] = [req_id] * (stop - start)
    return owners


def watch_v2_batch(runner, holder: dict):
    """Model Runner V2 clears its step state before drafting and hands the step's batch to
    ``speculator.propose(input_batch, ...)`` (``v1/worker/gpu/model_runner.py``,
    ``sample_tokens``): for the length of a recording window, this runner's speculator keeps
    that batch in ``holder["batch"]`` while it proposes. An attribute of this one speculator
    object, not of vLLM's class; returns the function that takes it away again (nothing to do for
    V1, whose batch stays on the runner)."""
    speculator = getattr(runner, "speculator", None)
    if speculator is None or "propose" in vars(speculator):
        return lambda: None
    original = speculator.propose

    def propose(input_batch, *args, **kwargs):
        holder["batch"] = input_batch
        try:
            return original(input_batch, *args, **kwargs)
        finally:
            holder["batch"] = None

    speculator.propose = propose
    return lambda: vars(speculator).pop("propose", None)
