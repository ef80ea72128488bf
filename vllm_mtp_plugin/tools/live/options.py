"""The options ``vllm-mtp serve`` takes besides vLLM's, taken out of the command line before vLLM
parses the rest (``vllm serve`` would refuse them)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

from ..cli_help import HelpFormatter, examples

WORKER_EXTENSION = "vllm_mtp_plugin.live_worker.LiveWorkerExtension"


RELOAD_KEY_ENV = "VLLM_MTP_RELOAD_API_KEY"


@dataclasses.dataclass
class ReloadSettings:
    directory: Path  # layers are read from below it only
    # The key of the admin routes (``/mtp/*``), apart from vLLM's --api-key: inference clients
    # cannot change the server. None only with --allow-unauthenticated-reload.
    api_key: str | None = None
    # A reload reads the whole layer and pauses every rank: at most one per this many seconds
    # from HTTP (429 with Retry-After); --adapt's own swaps and rollbacks are not held back.
    min_interval_s: float = 30.0
    max_versions: int = 32  # versions kept for /mtp/layer, /metrics and rollback


@dataclasses.dataclass
class AdaptSettings:
    """``--adapt``: what ``adapt.Adapter`` runs on."""
    directory: Path
    every_tokens: int = 200_000
    threads: int = 1
    steps: int = 200
    window_drafts: int = 2000
    min_heldout_tokens: int = 2000
    poll_s: float = 2.0
    # A training or evaluation process still running after this long is stopped and its round
    # dropped (the server goes on).
    timeout_s: float = 6 * 3600.0
    # Candidate layers kept besides the serving one and the rollback target, and rounds whose
    # work directories (trainer state with optimizer moments) are kept: older ones are removed.
    keep_rounds: int = 3


@dataclasses.dataclass
class LiveSettings:
    record: "RecordSettings | None" = None
    reload: ReloadSettings | None = None
    adapt: AdaptSettings | None = None
    # What the operator should know before vLLM starts (printed by ``vllm-mtp serve``).
    warnings: list[str] = dataclasses.field(default_factory=list)

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
    # Tokens one window re-prefills at most (its raw rows and its shard: for DeepSeek-V3,
    # 14 KB per token in bf16, so about 0.9 GB); never more than a shard within max_bytes.
    window_tokens: int = 65536
    max_age_s: float | None = None  # shards older than this are removed
    # A window starts only when the disk keeps this much free besides the window's own bytes.
    min_free_bytes: int = 2**30
    seed: int | None = None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-mtp serve", add_help=False, allow_abbrev=False, formatter_class=HelpFormatter,
        usage="vllm-mtp serve MODEL [vllm serve options] [--record DIR ...]",
        description="vllm serve (every argument passed through; vllm serve's own options follow "
                    "below), plus these (docs/live-traffic.md):",
        epilog=examples(
            "vllm-mtp serve /models/DeepSeek-R1 --tensor-parallel-size 8 \\",
            "    --speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 1}'",
            "vllm-mtp serve MODEL --speculative-config ... --record /srv/shards "
            "--record-fraction 0.05",
            f"{RELOAD_KEY_ENV}=KEY vllm-mtp serve MODEL --speculative-config ... "
            "--enable-layer-reload /srv/layers",
            "vllm-mtp serve MODEL --speculative-config ... --adapt /srv/adapt --reload-api-key KEY"))
    p.add_argument("--record", metavar="DIR",
                   help="write what the MTP drafter receives for a sample of finished requests "
                        "as training shards in DIR (vllm-mtp train TARGET --data DIR); the "
                        "shards hold users' traffic and are readable by their owner only")
    p.add_argument("--record-fraction", metavar="F", type=float,
                   default=RecordSettings.fraction,
                   help="share of finished requests recorded")
    p.add_argument("--record-max-gb", metavar="G", type=float,
                   default=RecordSettings.max_bytes / 2**30,
                   help="bound of DIR in GB: the oldest shards go first")
    p.add_argument("--record-max-age", metavar="HOURS", type=float, default=None,
                   help="remove shards older than HOURS (default: kept until --record-max-gb "
                        "needs their room)")
    p.add_argument("--record-window-tokens", metavar="N", type=int,
                   default=RecordSettings.window_tokens,
                   help="tokens re-prefilled and written per recording window at most (a "
                        "longer request is cut there)")
    p.add_argument("--record-min-free-gb", metavar="G", type=float,
                   default=RecordSettings.min_free_bytes / 2**30,
                   help="recording pauses while the disk would keep less free than G GB")
    p.add_argument("--record-seed", metavar="N", type=int, default=None,
                   help="seed of the sampling of requests, for a repeatable sample (default: "
                        "a new sample each start)")
    p.add_argument("--adapt", metavar="DIR",
                   help="record (DIR/shards), train a new layer every --adapt-every-tokens "
                        "recorded tokens, swap it in when it beats the serving one on held-out "
                        "traffic, roll back if served acceptance drops (DIR/layers)")
    p.add_argument("--adapt-every-tokens", metavar="N", type=int, default=200_000,
                   help="recorded tokens between training rounds")
    p.add_argument("--adapt-steps", metavar="S", type=int, default=200,
                   help="optimizer steps per round")
    p.add_argument("--adapt-threads", metavar="T", type=int, default=1,
                   help="CPU threads of the training and evaluation processes, which also run "
                        "at a lower priority than serving")
    p.add_argument("--adapt-window-drafts", metavar="W", type=int, default=2000,
                   help="draft tokens a new layer serves before its acceptance is compared "
                        "with its predecessor's (roll back if lower)")
    p.add_argument("--adapt-heldout-tokens", metavar="N", type=int, default=2000,
                   help="tokens recorded after a round's data before its candidate is evaluated "
                        "on them")
    p.add_argument("--adapt-timeout-minutes", metavar="M", type=float,
                   default=AdaptSettings.timeout_s / 60,
                   help="stop a round's training or evaluation process after M minutes and drop "
                        "the round")
    p.add_argument("--adapt-keep-rounds", metavar="N", type=int, default=AdaptSettings.keep_rounds,
                   help="candidate layers and round work directories kept besides the serving "
                        "layer and its rollback target; older ones are removed")
    p.add_argument("--enable-layer-reload", metavar="LAYERS",
                   help="accept POST /mtp/reload (vllm-mtp reload URL CHECKPOINT): replace the "
                        "drafter's MTP layer(s) with those of a checkpoint below the directory "
                        "LAYERS, without a restart; needs --reload-api-key")
    p.add_argument("--reload-api-key", metavar="KEY", default=None,
                   help="the key of the admin routes /mtp/reload, /mtp/layer and /mtp/adapt "
                        "(sent as Authorization: Bearer KEY), apart from vLLM's --api-key, so "
                        f"inference clients cannot change the server (default: ${RELOAD_KEY_ENV})")
    p.add_argument("--allow-unauthenticated-reload", action="store_true",
                   help="serve the admin routes without a key: anyone who reaches the port can "
                        "replace the drafter (warned at every start)")
    p.add_argument("--reload-min-interval", metavar="S", type=float,
                   default=ReloadSettings.min_interval_s,
                   help="seconds between two reloads asked over HTTP; sooner ones get 429 with "
                        "Retry-After")
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
    if ours.adapt is not None:
        _adapt_implies(ours)
    given = [a for a in argv if a.split("=", 1)[0].startswith("--record")]
    if ours.record is None and given:
        raise LiveOptionError(f"{given[0].split('=', 1)[0]} needs --record DIR.")
    given = [a for a in argv if a.split("=", 1)[0] in (
        "--reload-api-key", "--allow-unauthenticated-reload", "--reload-min-interval")]
    if ours.enable_layer_reload is None and given:
        raise LiveOptionError(f"{given[0].split('=', 1)[0]} needs --enable-layer-reload LAYERS "
                              "or --adapt DIR.")
    settings = LiveSettings(record=_record_settings(ours) if ours.record else None,
                            reload=_reload_settings(ours) if ours.enable_layer_reload else None,
                            adapt=_adapt_settings(ours) if ours.adapt else None)
    if not settings.any:
        return settings, rest
    what = ("--adapt" if settings.adapt else "--record" if settings.record
            else "--enable-layer-reload")
    if os.environ.get("VLLM_SERVER_DEV_MODE", "0").strip() not in ("", "0"):
        raise LiveOptionError(
            f"{what} with VLLM_SERVER_DEV_MODE set: vLLM then serves POST /collective_rpc "
            "without any key, through which a client could call the worker methods these options "
            "add (load a layer from any path, record every request). Unset VLLM_SERVER_DEV_MODE.")
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
    key = settings.reload.api_key if settings.reload else None
    if key is not None and len(key) < 16:
        settings.warnings.append(f"the reload key has {len(key)} characters: whoever guesses it "
                                 "replaces the drafter; use 16 or more random ones (e.g. "
                                 "openssl rand -hex 16), best through the environment "
                                 f"({RELOAD_KEY_ENV}: not visible in the process list).")
    if _unsized_cpu_kv_cache(rest):
        if settings.adapt:
            raise LiveOptionError(
                "--adapt on a CPU: vLLM would give the KV cache 92 % of this machine's memory, "
                f"and the training process would run out of it. {SIZE_THE_KV_CACHE}")
        settings.warnings.append(
            "--record on a CPU: vLLM gives the KV cache 92 % of this machine's memory, so "
            "vllm-mtp train --data on this machine while the server runs would run out of it "
            f"(train elsewhere, or stop the server first). {SIZE_THE_KV_CACHE}")
    if extension is None:
        rest = [*rest, "--worker-extension-cls", WORKER_EXTENSION]
    return settings, rest


KV_CACHE_FLAGS = ("--kv-cache-memory-bytes", "--kv_cache_memory_bytes", "--gpu-memory-utilization",
                  "--gpu_memory_utilization")


SIZE_THE_KV_CACHE = ("Size the KV cache: VLLM_CPU_KVCACHE_SPACE=GiB (e.g. 4) in the environment, "
                     "or --kv-cache-memory-bytes, or a lower --gpu-memory-utilization.")


def _unsized_cpu_kv_cache(rest: list[str]) -> bool:
    """On a CPU, vLLM gives the KV cache ``gpu_memory_utilization`` (0.92) of the machine's
    memory and touches all of it at start-up (``v1/worker/cpu_worker.py``): a training process
    beside the server is then killed for memory, or thrashes (seen on a 24 GiB machine:
    ``--adapt``'s rounds killed, ``train --data`` at 16-41 s per step). True when nothing sizes
    it."""
    from ...platform import platform_family

    return not (platform_family() != "cpu" or "VLLM_CPU_KVCACHE_SPACE" in os.environ or any(
        _peek(rest, flag) is not None for flag in KV_CACHE_FLAGS))


def _record_settings(ours) -> RecordSettings:
    if not 0.0 < ours.record_fraction <= 1.0:
        raise LiveOptionError(f"--record-fraction {ours.record_fraction:g}: give the share of "
                              "finished requests to record, in (0, 1].")
    if ours.record_max_gb <= 0:
        raise LiveOptionError(f"--record-max-gb {ours.record_max_gb:g}: give the bound of the "
                              "recording directory in GB, above 0.")
    if ours.record_max_age is not None and ours.record_max_age <= 0:
        raise LiveOptionError(f"--record-max-age {ours.record_max_age:g}: give the age in hours "
                              "after which shards are removed, above 0.")
    if ours.record_window_tokens < 2:
        raise LiveOptionError(f"--record-window-tokens {ours.record_window_tokens}: give 2 or "
                              "more (a request needs two tokens to train on).")
    if ours.record_min_free_gb < 0:
        raise LiveOptionError(f"--record-min-free-gb {ours.record_min_free_gb:g}: give 0 or "
                              "more.")
    directory = Path(ours.record).expanduser()
    if directory.exists() and not directory.is_dir():
        raise LiveOptionError(f"--record {directory}: exists and is not a directory.")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not os.access(directory, os.W_OK):
        raise LiveOptionError(f"--record {directory}: not writable by this user.")
    _only_ours(directory, "--record", "replace or add shards of served traffic")
    return RecordSettings(
        directory=directory, fraction=ours.record_fraction,
        max_bytes=int(ours.record_max_gb * 2**30), seed=ours.record_seed,
        window_tokens=ours.record_window_tokens, min_free_bytes=int(ours.record_min_free_gb * 2**30),
        max_age_s=None if ours.record_max_age is None else ours.record_max_age * 3600)


def _only_ours(directory: Path, what: str, harm: str) -> None:
    """Refuse a directory another user owns or may write to: they could ``harm``."""
    info = directory.stat()
    mode = info.st_mode & 0o777
    if info.st_uid != os.getuid():
        raise LiveOptionError(f"{what} {directory}: owned by another user (uid {info.st_uid}), "
                              f"who could {harm}; give a directory of this user's.")
    if mode & 0o022:
        raise LiveOptionError(f"{what} {directory}: writable by other users (mode {mode:o}), "
                              f"who could {harm}; chmod go-w it or give a new directory.")


def _adapt_implies(ours) -> None:
    """``--adapt DIR`` is ``--record DIR/shards`` + ``--enable-layer-reload DIR/layers``."""
    if ours.record or ours.enable_layer_reload:
        raise LiveOptionError("--adapt DIR records into DIR/shards and reloads from DIR/layers; "
                              "leave out --record and --enable-layer-reload.")
    for name in ("adapt_every_tokens", "adapt_steps", "adapt_threads", "adapt_window_drafts",
                 "adapt_heldout_tokens", "adapt_timeout_minutes", "adapt_keep_rounds"):
        if getattr(ours, name) < 1:
            raise LiveOptionError(f"--{name.replace('_', '-')} {getattr(ours, name)}: give 1 or "
                                  "more.")
    root = Path(ours.adapt).expanduser()
    if root.exists() and not root.is_dir():
        raise LiveOptionError(f"--adapt {root}: exists and is not a directory.")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    _only_ours(root, "--adapt", "replace the layers it serves or the shards it trains on")
    (root / "layers").mkdir(mode=0o700, exist_ok=True)
    ours.record = str(root / "shards")
    ours.enable_layer_reload = str(root / "layers")


def _adapt_settings(ours) -> AdaptSettings:
    return AdaptSettings(directory=Path(ours.adapt).expanduser(),
                         every_tokens=ours.adapt_every_tokens, threads=ours.adapt_threads,
                         steps=ours.adapt_steps, window_drafts=ours.adapt_window_drafts,
                         min_heldout_tokens=ours.adapt_heldout_tokens,
                         timeout_s=ours.adapt_timeout_minutes * 60,
                         keep_rounds=ours.adapt_keep_rounds)


def _reload_settings(ours) -> ReloadSettings:
    what = "--adapt" if ours.adapt else "--enable-layer-reload"
    directory = Path(ours.enable_layer_reload).expanduser()
    if not directory.is_dir():
        raise LiveOptionError(f"{what} {directory}: not a directory (layers to load are looked "
                              "for below it).")
    _only_ours(directory, what, "put a layer there that this server would load")
    key = ours.reload_api_key or os.environ.get(RELOAD_KEY_ENV) or None
    if key is None and not ours.allow_unauthenticated_reload:
        raise LiveOptionError(
            f"{what} lets a client replace the drafter: give its admin routes a key of their own, "
            f"--reload-api-key KEY (or {RELOAD_KEY_ENV} in the environment; vLLM's --api-key "
            "stays the inference clients' key), or say --allow-unauthenticated-reload (anyone "
            "who reaches the port can then do it).")
    if key is not None and ours.allow_unauthenticated_reload:
        raise LiveOptionError("--allow-unauthenticated-reload and a reload key: give one of them.")
    if ours.reload_min_interval < 0:
        raise LiveOptionError(f"--reload-min-interval {ours.reload_min_interval:g}: give 0 or "
                              "more seconds.")
    return ReloadSettings(directory=directory.resolve(), api_key=key,
                          min_interval_s=ours.reload_min_interval)
