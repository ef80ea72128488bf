"""Record what the MTP drafter receives, while vLLM serves: the training data of ``vllm-mtp train``.

The drafter's first draft step gets, for every token the target just computed, the target's
hidden state (for DeepSeek-V3: after the target's final norm), the next token and the position.
That is exactly the input an MTP layer is trained on, so ``vllm-mtp train`` collects it here,
inside vLLM, so that the same collection serves tensor/expert-parallel engines: rank 0 of each
tensor-parallel group writes (the hidden states are replicated across it), one file per drafter
call (tested with one rank).

Turned on per worker through vLLM's ``worker_extension_cls`` and ``LLM.collective_rpc``
(``RecordingWorkerExtension``), so warm-up and profiling runs are not recorded. Recording is a
Python side effect: the collecting engine runs eagerly (a captured CUDA graph would replay without
it).

While a server serves, a recording window knows its requests (``sequences``): only their rows are
written (``recording_window.py``), each call's file with a ``segments`` table saying which rows
fill which request at which positions, and the window's row counts in ``rows.json`` at the stop.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .recording_window import WindowRows, row_owners, watch_v2_batch

_state: dict = {"directory": None, "outputs": False, "count": 0, "tag": "", "window": None,
                "owners": None}


def active() -> bool:
    return _state["directory"] is not None


def start(directory: str | os.PathLike, outputs: bool = False, tag: str = "",
          sequences: list[list[int]] | None = None, owners=None) -> None:
    """Record every first-step drafter call into ``directory`` (``outputs``: the layer's
    output too, for the parity test between trainer and server); with ``sequences`` (the token
    ids of each request of a window), only the rows of those requests. ``owners(rows)``: per
    row of a call, whether one of the window's requests owns it (None where not known)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    _state.update(directory=Path(directory), outputs=outputs, count=0, tag=tag, errors=0,
                  window=WindowRows(sequences) if sequences is not None else None,
                  owners=owners)


def stop() -> int:
    """Stop recording; returns the number of calls written (a window's row counts go to
    ``rows-<tag>.json`` in its directory)."""
    count, window, directory = _state["count"], _state["window"], _state["directory"]
    _state.update(directory=None, count=0, window=None, owners=None)
    if window is not None and directory is not None:
        counts = {"calls": count, "rows_kept": window.rows_kept,
                  "rows_dropped": window.rows_dropped, "calls_by_tokens": window.calls_by_tokens}
        (Path(directory) / f"rows-{_state['tag']}.json").write_text(json.dumps(counts))
    return count


def _window_rows(window: WindowRows, tensors: dict[str, torch.Tensor], owners) -> dict | None:
    """The call's rows of the window's requests, with their ``segments``; None if none."""
    own = owners(len(tensors["positions"])) if owners is not None else None
    ranges, segments = window.take(tensors["input_ids"].tolist(), tensors["positions"].tolist(),
                                   own)
    if not segments:
        return None
    index = torch.cat([torch.arange(a, b) for a, b in ranges])
    kept = {k: v.index_select(0, index.to(v.device)) for k, v in tensors.items()}
    kept["segments"] = torch.tensor(segments, dtype=torch.int64)
    return kept


def record(input_ids: torch.Tensor | None, positions: torch.Tensor, hidden_states: torch.Tensor,
           output: torch.Tensor | None = None) -> None:
    """Write one drafter call: ``input_ids`` (the token after each position), ``positions``,
    ``hidden_states`` (what the target handed over) and optionally the layer's ``output``.

    Called from inside the drafter's forward, also while a server serves: it never raises there
    (a failed write is logged and counted; the reader finds the positions missing), and it reads
    the directory once, as recording may be stopped between any two lines of a running step."""
    directory, count, window = _state["directory"], _state["count"], _state["window"]
    if directory is None:
        return
    try:
        from safetensors.torch import save_file

        if input_ids is None:
            raise RuntimeError("recording needs the drafter's input token ids, and this host "
                               "called the drafter with embeddings only")
        n = positions.shape[-1]
        tensors = {"input_ids": input_ids[:n], "positions": positions[..., :n].reshape(n),
                   "hidden_states": hidden_states[:n]}
        if output is not None and _state["outputs"]:
            tensors["output"] = output[:n]
        if window is not None and (tensors := _window_rows(window, tensors,
                                                           _state["owners"])) is None:
            return  # rows of other traffic only: nothing leaves the device
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        _state["count"] = count + 1
        save_file(tensors, str(Path(directory) / f"call-{_state['tag']}{count:07d}.safetensors"))
    except Exception as exc:  # noqa: BLE001 - the step goes on without this call's data
        _state["errors"] = _state.get("errors", 0) + 1
        if _state["errors"] == 1:
            from vllm.logger import init_logger

            init_logger("vllm.vllm_mtp_plugin.record").warning(
                "recording a drafter call failed (%s); its positions are left out", exc)


class RecordingWorkerExtension:
    """Methods vLLM adds to its worker class (``LLM(worker_extension_cls=...)``)."""

    def start_mtp_recording(self, directory: str, outputs: bool = False,
                            sequences: list[list[int]] | None = None,
                            own_prefix: str | None = None) -> bool:
        """Start on the writing rank only; returns whether this worker records.
        ``sequences``: a recording window's requests, the only rows written; ``own_prefix``:
        how their request ids start (rows of other requests are dropped by their owner)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        if get_tensor_model_parallel_rank() != 0:
            return False
        parallel = self.vllm_config.parallel_config
        owners = None
        if own_prefix:
            runner, holder = self.model_runner, {"batch": None}
            _state["unwatch"] = watch_v2_batch(runner, holder)

            def owners(rows: int) -> list[bool] | None:
                found = row_owners(runner, rows, holder["batch"])
                return None if found is None else [
                    owner is not None and owner.startswith(own_prefix) for owner in found]

        start(directory, outputs, tag=f"dp{parallel.data_parallel_rank}-pid{os.getpid()}-",
              sequences=sequences, owners=owners)
        return True

    def stop_mtp_recording(self) -> int:
        _state.pop("unwatch", lambda: None)()
        return stop()
