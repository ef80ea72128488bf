"""The options ``vllm-mtp serve`` takes besides vLLM's, taken out of the command line before vLLM
parses the rest (``vllm serve`` would refuse them)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

WORKER_EXTENSION = "vllm_mtp_plugin.live_worker.LiveWorkerExtension"


@dataclasses.dataclass
class ReloadSettings:
    directory: Path  # layers are read from below it only


@dataclasses.dataclass
class LiveSettings:
    record: "RecordSettings | None" = None
    reload: ReloadSettings | None = None

    @property
    def any(self) -> bool:
        return self.record is not None or self.reload is not None


class LiveOptionError(ValueError):
    """A ``vllm-mtp serve`` option that cannot work; the message says which and what to do."""


@dataclasses.dataclass
class RecordSettings:
    directory: Path
    fraction: float = 0.1
    max_bytes: int = 20 * 2**30
    # One recording window re-prefills up to this many finished requests together, waiting at
    # most ``window_wait_s`` for more after the first: fewer, larger shards under load.
    window_requests: int = 32
    window_wait_s: float = 2.0
    seed: int | None = None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-mtp serve", add_help=False, allow_abbrev=False,
        usage="vllm-mtp serve MODEL [vllm serve options] [--record DIR ...]",
        description="vllm serve, plus (docs/live-traffic.md):")
    p.add_argument("--record", metavar="DIR",
                   help="write what the MTP drafter receives for a sample of finished requests "
                        "as training shards in DIR (vllm-mtp train TARGET --data DIR); the "
                        "shards hold users' traffic and are readable by their owner only")
    p.add_argument("--record-fraction", metavar="F", type=float,
                   default=RecordSettings.fraction,
                   help="share of finished requests recorded (default %(default)s)")
    p.add_argument("--record-max-gb", metavar="G", type=float,
                   default=RecordSettings.max_bytes / 2**30,
                   help="bound of DIR in GB: the oldest shards go first (default %(default)s)")
    p.add_argument("--record-seed", metavar="N", type=int, default=None,
                   help="seed of the sampling of requests (a repeatable sample)")
    p.add_argument("--enable-layer-reload", metavar="DIR",
                   help="accept POST /v1/mtp/reload (vllm-mtp reload URL OUT): replace the "
                        "drafter's MTP layer(s) with those of a checkpoint below DIR, without a "
                        "restart; behind --api-key when one is set")
    return p


def live_help() -> str:
    return _parser().format_help()


def _peek(argv: list[str], *flags: str) -> str | None:
    """The value of a vLLM flag in ``argv`` (``--flag V`` or ``--flag=V``), without consuming it."""
    for i, word in enumerate(argv):
        for flag in flags:
            if word == flag and i + 1 < len(argv):
                return argv[i + 1]
            if word.startswith(flag + "="):
                return word.split("=", 1)[1]
    return None


def _speculative_method(argv: list[str]) -> str | None:
    value = _peek(argv, "--speculative-config", "--speculative_config", "-sc")
    if value is not None:
        try:
            return str(json.loads(value).get("method"))
        except (ValueError, AttributeError):
            return None
    return _peek(argv, "--speculative-config.method", "--speculative_config.method")


def split_live_options(argv: list[str]) -> tuple[LiveSettings, list[str]]:
    """Our settings, and the arguments for ``vllm serve`` (with the worker extension added when
    any of ours is on)."""
    ours, rest = _parser().parse_known_args(argv)
    given = [a for a in argv if a.split("=", 1)[0].startswith("--record")]
    if ours.record is None and given:
        raise LiveOptionError(f"{given[0].split('=', 1)[0]} needs --record DIR.")
    settings = LiveSettings(record=_record_settings(ours) if ours.record else None,
                            reload=_reload_settings(ours) if ours.enable_layer_reload else None)
    if not settings.any:
        return settings, rest
    what = "--record" if settings.record else "--enable-layer-reload"
    method = _speculative_method(rest)
    if method not in ("mtp", "deepseek_mtp"):
        raise LiveOptionError(
            f"{what} works on the MTP drafter, so the server must draft with MTP: add "
            "--speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 1}'"
            + (f" (given method: {method})." if method else "."))
    extension = _peek(rest, "--worker-extension-cls", "--worker_extension_cls")
    if extension not in (None, WORKER_EXTENSION):
        raise LiveOptionError(f"{what} needs vLLM's --worker-extension-cls for its own "
                              f"({WORKER_EXTENSION}); this server was given {extension}.")
    servers = _peek(rest, "--api-server-count", "-asc")
    if servers not in (None, "1"):
        raise LiveOptionError(f"{what} runs in the API server process and supports one: leave "
                              f"out --api-server-count {servers}.")
    if extension is None:
        rest = [*rest, "--worker-extension-cls", WORKER_EXTENSION]
    return settings, rest


def _record_settings(ours) -> RecordSettings:
    if not 0.0 < ours.record_fraction <= 1.0:
        raise LiveOptionError(f"--record-fraction {ours.record_fraction:g}: give the share of "
                              "finished requests to record, in (0, 1].")
    if ours.record_max_gb <= 0:
        raise LiveOptionError(f"--record-max-gb {ours.record_max_gb:g}: give the bound of the "
                              "recording directory in GB, above 0.")
    directory = Path(ours.record).expanduser()
    if directory.exists() and not directory.is_dir():
        raise LiveOptionError(f"--record {directory}: exists and is not a directory.")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not os.access(directory, os.W_OK):
        raise LiveOptionError(f"--record {directory}: not writable by this user.")
    return RecordSettings(directory=directory, fraction=ours.record_fraction,
                          max_bytes=int(ours.record_max_gb * 2**30), seed=ours.record_seed)


def _reload_settings(ours) -> ReloadSettings:
    directory = Path(ours.enable_layer_reload).expanduser()
    if not directory.is_dir():
        raise LiveOptionError(f"--enable-layer-reload {directory}: not a directory (layers to "
                              "load are looked for below it).")
    return ReloadSettings(directory=directory.resolve())
