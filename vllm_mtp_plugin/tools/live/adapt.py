"""``vllm-mtp serve MODEL --adapt DIR``: the server trains its own MTP layer on the traffic it
serves, and swaps it in when it is better.

One asyncio task in the API server process, over the recorder (``recorder.py``, shards in
``DIR/shards``) and the layer reload (``endpoints.py``, layers in ``DIR/layers``):

1. every ``every_tokens`` newly recorded tokens, ``vllm-mtp train SERVING --data`` runs in a
   process of its own (``threads`` CPU threads, lower priority), from the layer that serves, on
   the shards recorded so far (a snapshot: ``DIR/rounds/N/data``, hard links that keep a shard
   the recording bound removes readable until the round has evaluated, then removed);
2. the candidate and the serving layer are evaluated (``evaluate.py``, a process too) on the
   first shards recorded *after* the snapshot that hold ``min_heldout_tokens`` - traffic neither
   has seen, its size bounded - for their agreement with the
   target's next-next token at the first draft position;
3. the candidate is swapped in only when its 95 % interval lies above the serving layer's;
4. after a swap, once the new layer has drafted ``window_drafts`` draft tokens, its served
   acceptance (vLLM's counters, per version) is compared with its predecessor's: if its interval
   lies below, the predecessor is loaded back (a rollback).

Every decision is logged and kept in ``DIR/adapt.json`` (the last ``HISTORY`` events) and
``GET /mtp/adapt``. Run for weeks, the directory stays bounded besides the shards (which
``--record-max-gb`` bounds): after each round only the serving layer, its rollback target and the
newest ``keep_rounds`` candidates stay in ``DIR/layers``, and only the newest ``keep_rounds``
rounds stay in ``DIR/rounds`` (trainer state, logs, evaluation; the history keeps what they
decided). A server restarted on the same DIR numbers its rounds on from the last one and loads
the layer that served when it stopped; a second server on a DIR another one holds is refused
(``hold_directory``: rounds, pruning and ``adapt.json`` would collide). ``adapt.json`` is
replaced whole (written aside, then renamed); a failed write is logged and the loop goes on.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path

from .options import RELOAD_KEY_ENV, AdaptSettings, LiveOptionError

HISTORY = 500  # events kept in adapt.json and /mtp/adapt


def _logger():
    from vllm.logger import init_logger

    return init_logger("vllm.vllm_mtp_plugin.adapt")


def better_beyond_noise(candidate: dict, serving: dict) -> bool:
    """The candidate's first-position agreement interval lies above the serving layer's."""
    a, b = candidate.get("agreement_interval"), serving.get("agreement_interval")
    return bool(a and b and a[0] > b[1])


def served_worse(new: dict[str, float], old: dict[str, float]) -> bool:
    """The new layer's served acceptance (accepted / draft tokens) interval lies below the old
    one's."""
    from ..stats import wilson

    key_a, key_n = "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_draft_tokens"
    a, b = wilson(new[key_a], new[key_n]), wilson(old[key_a], old[key_n])
    return bool(a and b and a[1] < b[0])


def _numbered(directory: Path, prefix: str) -> list[tuple[int, Path]]:
    """``(N, path)`` of the entries ``{prefix}N`` of ``directory``."""
    if not directory.is_dir():
        return []
    return [(int(p.name[len(prefix):]), p) for p in directory.iterdir()
            if p.name.startswith(prefix) and p.name[len(prefix):].isdigit()]


def last_round(directory: Path) -> int:
    """The highest round number a server on this DIR used (0: none): a restart goes on from it
    instead of failing on the rounds' existing directories."""
    found = _numbered(directory / "rounds", "") + _numbered(directory / "layers", "round-")
    return max((n for n, _ in found), default=0)


def earlier_history(directory: Path) -> list[dict]:
    """The events the last server on this DIR kept (bounded), to go on from."""
    try:
        history = json.loads((directory / "adapt.json").read_text()).get("history")
    except (OSError, ValueError, AttributeError):
        return []
    return [e for e in history if isinstance(e, dict)][-HISTORY:] if isinstance(history, list) \
        else []


def serving_when_stopped(directory: Path) -> Path | None:
    """The candidate layer that served when the last server on this DIR wrote adapt.json, if it
    is still there (a layer of DIR/layers; the checkpoint's own needs no reload)."""
    try:
        serving = json.loads((directory / "adapt.json").read_text()).get("serving")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(serving, str):
        return None
    path = Path(serving)
    layers = (directory / "layers").resolve()
    return path if path.is_relative_to(layers) and (path / "config.json").is_file() else None


def hold_directory(directory: Path):
    """An exclusive lock on ``DIR/.adapt.lock`` for the life of this process (kept open), or
    ``LiveOptionError`` when another server holds the DIR."""
    import fcntl

    handle = open(directory / ".adapt.lock", "a")  # noqa: SIM115 - held until the process ends
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise LiveOptionError(f"--adapt {directory}: another server adapts in this directory; "
                              "give each server a DIR of its own (they may share --record "
                              "directories, not --adapt ones).") from None
    return handle


def _shard_tokens(shard: Path) -> int:
    """Positions a shard holds, from its header (``hidden`` rows)."""
    from safetensors import safe_open

    with safe_open(str(shard), "pt") as handle:
        return handle.get_slice("hidden").get_shape()[0]


def _link_shards(shards: list[Path], into: Path) -> Path:
    """The round's view of ``shards``: hard links where the filesystem allows, so a shard the
    recording bound removes meanwhile stays readable until the round is done with it (its links
    go then: ``Adapter._step``), else symbolic links."""
    into.mkdir(parents=True, exist_ok=True)
    for shard in shards:
        link = into / shard.name
        try:
            os.link(shard, link)
        except FileNotFoundError:
            continue  # removed by the bound since it was listed
        except OSError:  # another filesystem, or no hard links there
            link.symlink_to(shard.resolve())
    return into


class Adapter:
    """The loop above. ``recorder``: the server's ``TrafficRecorder``; ``endpoints``: its
    ``LiveEndpoints`` (reload, versions)."""

    def __init__(self, settings: AdaptSettings, recorder, endpoints):
        self.settings = settings
        self.recorder, self.endpoints = recorder, endpoints
        self.directory = Path(settings.directory)
        self.state = "recording"
        self.round = last_round(self.directory)
        self.history: list[dict] = earlier_history(self.directory)
        self.task: asyncio.Task | None = None
        self.tokens_at_round = 0
        self.resume_from = serving_when_stopped(self.directory)
        self.lock = hold_directory(self.directory)

    def status(self) -> dict:
        versions = getattr(self.endpoints, "versions", None)
        return {"state": self.state, "round": self.round,
                "recorded_tokens": self.recorder.stats["tokens"],
                "next_round_at_tokens": self.tokens_at_round + self.settings.every_tokens,
                "serving": versions.current["path"] if versions else None,
                "history": self.history}

    def start(self) -> None:
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run())

    def _save(self, event: dict) -> None:
        self.history.append({"time": time.time(), "round": self.round, **event})
        del self.history[:-HISTORY]
        _logger().info("vllm-mtp adapt: %s", json.dumps(event))
        aside = self.directory / "adapt.json.partial"
        try:
            aside.write_text(json.dumps(self.status(), indent=1))
            aside.replace(self.directory / "adapt.json")
        except OSError as exc:  # a full disk: the history stays in memory and on /mtp/adapt
            _logger().error("vllm-mtp adapt: could not write %s (%s); going on",
                            self.directory / "adapt.json", exc)

    async def _resume(self) -> None:
        """Load the layer that served when the server on this DIR stopped (a candidate it had
        swapped in), so a restart does not fall back to the checkpoint's own."""
        if self.resume_from is None:
            return
        status, answer = await self.endpoints.reload(str(self.resume_from))
        self._save({"event": "resumed" if status == 200 else "resume failed",
                    "layer": str(self.resume_from), "answer_status": status,
                    **({"error": answer.get("error")} if status != 200 else {})})

    async def _run(self) -> None:
        try:
            await self._resume()
        except Exception as exc:  # noqa: BLE001 - the server goes on with its own layer
            self._save({"event": "resume failed", "error": f"{type(exc).__name__}: {exc}"})
        while True:
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the server goes on; the round is dropped
                self.state = "recording"
                self._save({"event": "failed", "error": f"{type(exc).__name__}: {exc}"})
            self._prune()
            await asyncio.sleep(self.settings.poll_s)

    def _prune(self) -> None:
        """Remove what the next rounds do not need (module docstring); the serving layer and
        the layers the version history may roll back to stay."""
        versions = self.endpoints.versions
        if versions is None:
            return
        needed = {Path(layer["path"]).resolve() for layer in versions.layers[-2:]}
        keep = self.settings.keep_rounds
        candidates = sorted(_numbered(self.directory / "layers", "round-"))
        for number, path in candidates[:-keep] if keep else candidates:
            if path.resolve() not in needed:
                shutil.rmtree(path, ignore_errors=True)
        rounds = sorted(_numbered(self.directory / "rounds", ""))
        for number, path in rounds[:-keep] if keep else rounds:
            shutil.rmtree(path, ignore_errors=True)
        versions.layers[1:-2] = [layer for layer in versions.layers[1:-2]
                                 if Path(layer["path"]).exists()]

    async def _step(self) -> None:
        recorded = self.recorder.stats["tokens"]
        if recorded - self.tokens_at_round < self.settings.every_tokens:
            return
        self.round += 1
        self.tokens_at_round = recorded
        versions = self.endpoints.versions
        serving = versions.current
        round_dir = self.directory / "rounds" / str(self.round)
        snapshot = sorted(self.recorder.directory.glob("shard-*.safetensors"))
        candidate = self.directory / "layers" / f"round-{self.round}"
        try:
            data = _link_shards(snapshot, round_dir / "data")
            self.state = "training"
            self._save({"event": "training", "from": serving["path"], "shards": len(snapshot),
                        "recorded_tokens": recorded})
            await self._subprocess(["-m", "vllm_mtp_plugin.tools.cli", "train", serving["path"],
                                    "--data", str(data), "--out", str(candidate), "--work-dir",
                                    str(round_dir / "work"), "--steps", str(self.settings.steps),
                                    "--quiet"], round_dir / "train.log")
            self.state = "waiting for held-out traffic"
            heldout = await self._heldout_after(set(snapshot), round_dir / "heldout")
            self.state = "evaluating"
            result = round_dir / "evaluation.json"
            await self._subprocess(["-m", "vllm_mtp_plugin.tools.live.evaluate",
                                    serving["path"], str(candidate), str(heldout), "--out",
                                    str(result)], round_dir / "evaluate.log")
            scores = json.loads(result.read_text())
        finally:  # the round's links: the shards they keep alive are free to go now
            for links in ("data", "heldout"):
                shutil.rmtree(round_dir / links, ignore_errors=True)
        if not better_beyond_noise(scores["candidate"], scores["serving"]):
            self.state = "recording"
            self._save({"event": "kept", "why": "the candidate is not better beyond noise on "
                        "held-out traffic", **_agreements(scores)})
            return
        status, answer = await self.endpoints.reload(str(candidate))
        if status != 200:
            self.state = "recording"
            self._save({"event": "swap refused", "status": status, "error": answer.get("error")})
            return
        self._save({"event": "swapped", "version": answer["version"],
                    "reload_seconds": answer["seconds"], **_agreements(scores)})
        self.state = "watching"
        await self._watch(previous=serving)
        self.state = "recording"

    async def _heldout_after(self, seen: set[Path], into: Path) -> Path:
        """The first shards recorded after the training snapshot that hold
        ``min_heldout_tokens``, once there are: the evaluation's cost stays bounded however long
        training took (the traffic recorded meanwhile is left for the next round)."""
        while True:
            fresh = [s for s in sorted(self.recorder.directory.glob("shard-*.safetensors"))
                     if s not in seen]
            chosen, tokens = [], 0
            for shard in fresh:
                try:
                    tokens += _shard_tokens(shard)
                except OSError:  # removed by the bound since it was listed
                    continue
                chosen.append(shard)
                if tokens >= self.settings.min_heldout_tokens:
                    return _link_shards(chosen, into)
            await asyncio.sleep(self.settings.poll_s)

    async def _watch(self, previous: dict) -> None:
        """Roll back when the new layer's served acceptance falls below its predecessor's."""
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        from .endpoints import vllm_counters

        versions = self.endpoints.versions
        new = versions.current
        drafts = "vllm:spec_decode_num_draft_tokens"
        while versions.current is new:
            counts = dict(versions.by_version(vllm_counters(get_prometheus_registry())))
            if counts[new["version"]][drafts] >= self.settings.window_drafts:
                if served_worse(counts[new["version"]], counts[previous["version"]]):
                    status, answer = await self.endpoints.reload(previous["path"])
                    self._save({"event": "rolled back" if status == 200 else "rollback failed",
                                "from_version": new["version"], "to": previous["path"],
                                "answer_status": status, "reload_seconds": answer.get("seconds"),
                                "served": _served(counts, new, previous)})
                else:
                    self._save({"event": "kept after watching", "version": new["version"],
                                "served": _served(counts, new, previous)})
                return
            await asyncio.sleep(self.settings.poll_s)

    async def _subprocess(self, args: list[str], log: Path) -> None:
        """Run a round's process at a lower priority; stopped (with its children) after
        ``timeout_s``."""
        import signal

        threads = str(self.settings.threads)
        env = {**{k: v for k, v in os.environ.items() if k != RELOAD_KEY_ENV},  # not theirs
               "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
               "CUDA_VISIBLE_DEVICES": os.environ.get("VLLM_MTP_ADAPT_DEVICES", "")}
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as out:
            process = await asyncio.create_subprocess_exec(
                sys.executable, *args, stdout=out, stderr=asyncio.subprocess.STDOUT, env=env,
                preexec_fn=lambda: os.nice(10), start_new_session=True)
            try:
                code = await asyncio.wait_for(process.wait(), self.settings.timeout_s)
            except asyncio.TimeoutError:
                os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
                raise RuntimeError(f"{' '.join(args[:4])} still ran after "
                                   f"{self.settings.timeout_s:g} s (--adapt-timeout-minutes); "
                                   f"stopped (log: {log})") from None
        if code != 0:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
            raise RuntimeError(f"{' '.join(args[:4])} failed (exit {code}): {tail[0]} "
                               f"(log: {log})")


def _agreements(scores: dict) -> dict:
    return {f"{k}_agreement": scores[k]["agreement"][0] for k in ("candidate", "serving")} | {
        "positions": scores["serving"]["positions"]}


def _served(counts: dict, new: dict, old: dict) -> dict:
    def rate(c):
        n = c["vllm:spec_decode_num_draft_tokens"]
        return c["vllm:spec_decode_num_accepted_tokens"] / n if n else None
    return {"new": rate(counts[new["version"]]), "previous": rate(counts[old["version"]]),
            "new_draft_tokens": counts[new["version"]]["vllm:spec_decode_num_draft_tokens"]}
