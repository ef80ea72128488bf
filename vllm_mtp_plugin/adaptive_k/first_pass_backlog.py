"""The MTP layer's first-pass inputs of the k = 0 steps it skipped, kept per request until a step
that runs the layer again catches them up in one forward.

Why: at k = 0 vLLM still runs the MTP layer over each step's tokens, only to keep the layer's KV
cache whole for the next draft (skipping it leaves the cache stale: TensorRT-LLM's k = 0 trap).
That forward is one layer beside a full DeepSeek target, but a large share of a step on a target
of few layers, and adaptive k then cannot match serving without speculation where no k pays.
What the layer needs of a skipped decode step is small: the token it would have read (the one the
target sampled), the position and the target's hidden state. Kept here, they are run before the
next first pass, every request's skipped positions as one query: the cache ends as if the layer
had run at every step (``patches/deferred_first_pass_at_k0.py`` runs them).

Bounded: at most ``capacity`` rows (the drafter's own input buffer, so the catch-up fits one
forward); a step that would pass it runs the layer as vLLM does, catching up first. While rows
are taken they are gathered into one piece and the rest compacted: for that moment up to three
times the kept rows.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class CatchUp:
    """The skipped rows of the requests of one batch, request by request (shortest first: MLA
    backends want decode-length queries before longer ones), each request's rows in position
    order, contiguous and ending where this step's first token stands."""

    batch_rows: list[int]  # each request's row in the step's batch (its block-table row)
    query_lens: list[int]
    first_positions: list[int]
    tokens: torch.Tensor  # [n]: the token the layer reads at each position (the next one)
    positions: torch.Tensor  # [n]
    hidden: torch.Tensor  # [n, hidden]: the target's hidden state at each position


class FirstPassBacklog:
    """Rows of skipped steps: ``defer`` one decode step's, ``take`` what a batch needs."""

    def __init__(self, capacity: int, prefix_caching: bool = False, block_drop: bool = False):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 row, got {capacity}")
        self.capacity = capacity
        self.tokens: list[int] = []  # one per row, as ints: a step's are read back anyway
        self.positions: list[int] = []  # one per row (a tensor only when rows are taken)
        self.hidden: list[torch.Tensor] = []
        self.owners: list[str] = []  # the request of every row, in row order
        self.next_position: dict[str, int] = {}
        self.first_position: dict[str, int] = {}  # each request's first kept position
        self.prefix_caching = prefix_caching  # a full KV block may be shared at once
        self.block_drop = block_drop  # vLLM recomputes the last block a prefix hit matches
        self.token_dtype = torch.int64  # the sampled tokens' (vLLM's int32 or int64)
        self.deferred_steps = 0
        self.catch_ups = 0
        self.caught_up_rows = 0

    @property
    def rows(self) -> int:
        return len(self.owners)

    def fits(self, rows: int) -> bool:
        return self.rows + rows <= self.capacity

    def defer(self, req_ids: list[str], positions: list[int], tokens: list[int],
              hidden: torch.Tensor, token_dtype: torch.dtype = torch.int64) -> None:
        """Keep one decode step's rows (one per request: ``tokens[i]`` read at ``positions[i]``
        with ``hidden[i]``; ``token_dtype``: the sampled tokens' dtype). A request whose position
        does not follow its kept rows (it was preempted and recomputed) loses them: they no
        longer describe its cache."""
        if not self.fits(len(req_ids)):
            raise ValueError(f"{len(req_ids)} rows do not fit: {self.rows} of {self.capacity} "
                             "kept (check fits() first)")
        broken = {r for r, p in zip(req_ids, positions)
                  if r in self.next_position and self.next_position[r] != p}
        if broken:
            self.forget(broken)
        for r, p in zip(req_ids, positions):
            self.first_position.setdefault(r, p)
            self.next_position[r] = p + 1
        self.owners.extend(req_ids)
        self.token_dtype = token_dtype
        self.tokens.extend(tokens)
        self.positions.extend(positions)
        self.hidden.append(hidden.detach().clone())
        self.deferred_steps += 1

    def forget(self, req_ids) -> None:
        """Drop the rows of requests that finished (or whose rows no longer apply)."""
        gone = set(req_ids) & self.next_position.keys()
        if not gone:
            return
        keep = [i for i, r in enumerate(self.owners) if r not in gone]
        for r in gone:
            del self.next_position[r]
            self.first_position.pop(r, None)
        self._keep_rows(keep)

    def take(self, req_ids: list[str], first_positions: list[int]) -> CatchUp | None:
        """The rows of the batch's requests (``req_ids[i]`` starts this step at
        ``first_positions[i]``) whose kept rows end right there; they leave the backlog. Rows of
        a request whose step starts elsewhere are dropped (nothing can place them any more); rows
        of requests not in the batch stay."""
        if not self.owners:
            return None
        rows_of: dict[str, list[int]] = {}
        for i, r in enumerate(self.owners):
            rows_of.setdefault(r, []).append(i)
        chosen, in_batch = [], set()
        for batch_row, (r, first) in enumerate(zip(req_ids, first_positions)):
            if r in rows_of:
                in_batch.add(r)
                self.first_position.pop(r, None)
                if self.next_position.pop(r) == first:
                    chosen.append((len(rows_of[r]), batch_row, r))
        if not chosen:
            self._keep_rows([i for i, r in enumerate(self.owners) if r not in in_batch])
            return None
        chosen.sort()  # shortest queries first
        order = [i for _, _, r in chosen for i in rows_of[r]]
        device = self.hidden[0].device
        index = torch.tensor(order, dtype=torch.long, device=device)
        positions = torch.tensor([self.positions[i] for i in order], dtype=torch.long,
                                 device=device)
        catch_up = CatchUp(batch_rows=[b for _, b, _ in chosen],
                           query_lens=[n for n, _, _ in chosen],
                           first_positions=[first_positions[b] - n for n, b, _ in chosen],
                           tokens=torch.tensor([self.tokens[i] for i in order],
                                               dtype=self.token_dtype, device=device),
                           positions=positions,
                           hidden=torch.cat(self.hidden).index_select(0, index))
        self.catch_ups += 1
        self.caught_up_rows += len(order)
        self._keep_rows([i for i, r in enumerate(self.owners) if r not in in_batch])
        return catch_up

    def _keep_rows(self, keep: list[int]) -> None:
        """Keep only these rows, in one piece (memory follows the rows kept)."""
        if len(keep) == len(self.owners):
            return
        if not keep:
            self.tokens, self.positions, self.hidden, self.owners = [], [], [], []
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.hidden[0].device)
        self.tokens = [self.tokens[i] for i in keep]
        self.positions = [self.positions[i] for i in keep]
        self.hidden = [torch.cat(self.hidden).index_select(0, index)]
        self.owners = [self.owners[i] for i in keep]
