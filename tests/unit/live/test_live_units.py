"""``vllm-mtp serve --record``'s parts that need no engine: options, the finished-request tap,
the recording directory (whole, owner-only, bounded shards) and ``train --data``'s checks."""

import asyncio
import json
import os
import stat
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from vllm_mtp_plugin.tools.live import recording_dir, tap
from vllm_mtp_plugin.tools.live.options import (WORKER_EXTENSION, LiveOptionError,
                                                split_live_options)
from vllm_mtp_plugin.tools.mtp_layer.shard_format import SequenceStore, shard_summary, write_shard
from vllm_mtp_plugin.tools.mtp_layer.v3_target import TrainInputError

SPEC = ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}']


def test_options_are_taken_out_and_the_worker_extension_added(tmp_path):
    live, rest = split_live_options(["model", "--record", str(tmp_path / "rec"),
                                     "--record-fraction=0.25", "--record-max-gb", "0.5",
                                     "--port", "8001", *SPEC])
    assert rest == ["model", "--port", "8001", *SPEC, "--worker-extension-cls", WORKER_EXTENSION]
    assert live.record.fraction == 0.25 and live.record.max_bytes == 2**29
    assert live.record.max_age_s is None and live.record.window_tokens == 65536
    assert live.reload is None
    live, _ = split_live_options(["model", "--record", str(tmp_path / "rec"), *SPEC,
                                  "--record-max-age", "36", "--record-window-tokens=4096",
                                  "--record-min-free-gb", "0.5"])
    assert (live.record.max_age_s, live.record.window_tokens, live.record.min_free_bytes) == (
        36 * 3600, 4096, 2**29)
    assert stat.S_IMODE((tmp_path / "rec").stat().st_mode) == 0o700
    live, rest = split_live_options(["model", "--enable-layer-reload", str(tmp_path), *SPEC,
                                     "--reload-api-key", "k", "--reload-min-interval", "5"])
    assert live.reload.directory == tmp_path.resolve() and live.record is None
    assert (live.reload.api_key, live.reload.min_interval_s) == ("k", 5.0)
    assert rest[-1] == WORKER_EXTENSION
    live, rest = split_live_options(["model", "--port", "1"])
    assert not live.any and rest == ["model", "--port", "1"]


@pytest.mark.parametrize("argv, message", [
    (["--record-fraction", "0.5"], "--record-fraction needs --record DIR"),
    (["--record", "{d}", "--record-fraction", "0", *SPEC], "in (0, 1]"),
    (["--record", "{d}", "--record-max-gb", "-1", *SPEC], "above 0"),
    (["--record", "{d}", "--record-max-age", "0", *SPEC], "--record-max-age 0: give the age"),
    (["--record", "{d}", "--record-window-tokens", "1", *SPEC], "give 2 or more"),
    (["--record", "{d}", "--record-min-free-gb", "-2", *SPEC], "--record-min-free-gb -2"),
    (["--record-max-age", "3"], "--record-max-age needs --record DIR"),
    (["--record", "{d}"], "--record works on the MTP drafter, so the server must draft with MTP"),
    (["--record", "{d}", "-sc", '{"method": "eagle3"}'], "(given method: eagle3)"),
    (["--record", "{d}", *SPEC, "--worker-extension-cls", "my.Ext"], "given my.Ext"),
    (["--record", "{d}", *SPEC, "--api-server-count", "2"], "--api-server-count 2"),
    (["--record", "{f}", *SPEC], "exists and is not a directory"),
    (["--enable-layer-reload", "{d}", *SPEC], "not a directory (layers to load"),
    (["--enable-layer-reload", "{t}", "--reload-api-key", "k"],
     "--enable-layer-reload works on the MTP drafter"),
    (["--enable-layer-reload", "{t}", *SPEC], "give its admin routes a key of their own, "
                                              "--reload-api-key KEY"),
    (["--enable-layer-reload", "{t}", *SPEC, "--reload-api-key", "k",
      "--allow-unauthenticated-reload"], "give one of them"),
    (["--enable-layer-reload", "{t}", *SPEC, "--reload-api-key", "k",
      "--reload-min-interval", "-1"], "give 0 or more seconds"),
    (["--reload-api-key", "k", *SPEC], "--reload-api-key needs --enable-layer-reload LAYERS"),
])
def test_options_refused_with_the_reason(tmp_path, argv, message):
    (tmp_path / "file").write_text("x")
    argv = [a.replace("{d}", str(tmp_path / "rec")).replace("{f}", str(tmp_path / "file"))
            .replace("{t}", str(tmp_path)) for a in argv]
    with pytest.raises(LiveOptionError) as info:
        split_live_options(["model", *argv])
    assert message in str(info.value)


def test_vllms_dev_mode_is_refused(tmp_path, monkeypatch):
    """VLLM_SERVER_DEV_MODE=1 makes vLLM serve POST /collective_rpc without a key: any client
    could call the worker extension's methods (reload from any path, record everything)."""
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with pytest.raises(LiveOptionError, match="Unset VLLM_SERVER_DEV_MODE"):
        split_live_options(["model", "--record", str(tmp_path / "r"), *SPEC])
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "0")
    assert split_live_options(["model", "--record", str(tmp_path / "r"), *SPEC])[0].record


def test_serve_refuses_bad_options_before_vllm_starts(tmp_path, capsys):
    from vllm_mtp_plugin.tools.cli import main

    assert main(["serve", "m", "--record", str(tmp_path)]) == 2
    assert "vllm-mtp serve: --record works on the MTP drafter" in capsys.readouterr().err


def _output(finished, pieces, kind_reasons=None):
    """A RequestOutput as AsyncLLM.generate yields it: completions with index and token ids."""
    outs = [SimpleNamespace(index=i, token_ids=ids, finish_reason=(kind_reasons or {}).get(i))
            for i, ids in pieces]
    return SimpleNamespace(finished=finished, prompt_token_ids=[1, 2, 3], outputs=outs)


@pytest.mark.parametrize("kind", ["DELTA", "CUMULATIVE", "FINAL_ONLY"])
def test_tap_hands_over_each_finished_completion(monkeypatch, kind):
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    if kind == "DELTA":
        stream = [_output(False, [(0, [7]), (1, [9])]),
                  _output(True, [(0, [8]), (1, [10, 11])], {0: "stop", 1: "length"})]
    elif kind == "CUMULATIVE":
        stream = [_output(False, [(0, [7]), (1, [9])]),
                  _output(True, [(0, [7, 8]), (1, [9, 10, 11])], {0: "stop", 1: "length"})]
    else:
        stream = [_output(True, [(0, [7, 8]), (1, [9, 10, 11])], {0: "stop", 1: "length"})]

    async def generate(self, prompt, params, request_id, **kwargs):
        for out in stream:
            yield out

    monkeypatch.setattr(AsyncLLM, "generate", generate)
    heard = []
    tap.install(lambda engine, p, o, salt: heard.append((p, o, salt)))
    try:
        params = SamplingParams(n=2, output_kind=getattr(RequestOutputKind, kind))

        async def consume(request_id, prompt="x"):
            return [o async for o in AsyncLLM.generate(None, prompt, params, request_id)]

        assert asyncio.run(consume("user-1")) == stream  # passed on unchanged
        assert heard == [([1, 2, 3], [7, 8], None), ([1, 2, 3], [9, 10, 11], None)]
        asyncio.run(consume(tap.OWN_REQUEST_PREFIX + "1"))  # the recorder's own: not offered
        assert len(heard) == 2
        # a tenant's cache salt (the OpenAI server's rendered input) reaches the recorder
        asyncio.run(consume("user-2", {"prompt_token_ids": [1, 2, 3], "cache_salt": "t-a"}))
        assert heard[2:] == [([1, 2, 3], [7, 8], "t-a"), ([1, 2, 3], [9, 10, 11], "t-a")]
    finally:
        tap.uninstall()
    assert AsyncLLM.generate is generate


def test_tap_skips_aborted_completions_and_survives_a_failing_listener(monkeypatch):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    async def generate(self, prompt, params, request_id, **kwargs):
        yield _output(True, [(0, [5])], {0: "abort"})
        yield _output(True, [(0, [6])], {0: "stop"})

    monkeypatch.setattr(AsyncLLM, "generate", generate)

    def failing(engine, p, o, salt):
        raise ValueError("listener bug")

    tap.install(failing)
    try:
        async def consume():
            return [o async for o in AsyncLLM.generate(None, "x", SamplingParams(), "r")]

        assert len(asyncio.run(consume())) == 2  # the request still completes
    finally:
        tap.uninstall()


def _shard(path, n_sequences=2, length=5, hidden=8, private=True):
    seqs = [list(range(length)) for _ in range(n_sequences)]
    write_shard(path, seqs, [0] * n_sequences, [torch.randn(length, hidden) for _ in seqs],
                [2] * n_sequences, {"source": "test"}, private=private)


def test_shards_are_owner_only_whole_and_bounded(tmp_path):
    first = recording_dir.shard_path(tmp_path, 1)
    _shard(first)
    assert stat.S_IMODE(first.stat().st_mode) == 0o600
    assert not list(tmp_path.glob("*.partial"))
    size = first.stat().st_size
    later = []
    for n in range(2, 5):
        path = recording_dir.shard_path(tmp_path, n)
        _shard(path)
        os.utime(path, (1e9 + n, 1e9 + n))
        later.append(path)
    os.utime(first, (1e9, 1e9))
    removed = recording_dir.enforce_bound(tmp_path, 2 * size)
    assert removed == [first.name, later[0].name]
    assert sorted(p.name for p in tmp_path.glob(recording_dir.SHARD_GLOB)) == sorted(
        p.name for p in later[1:])
    assert recording_dir.enforce_bound(tmp_path, 1) == [later[1].name]  # the newest always stays
    store = SequenceStore(tmp_path)
    assert len(store) == 2 and store.prompt_lengths == [2, 2]


def test_leftovers_of_a_killed_server_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    host = recording_dir._host()
    partial = tmp_path / f"shard-20260101T000000-{host}-{dead}-00001.partial"
    raw = tmp_path / f".raw-{host}-{dead}-00002"
    alive = tmp_path / f".raw-{host}-{os.getppid()}-00001"
    other_host = tmp_path / f"shard-20260101T000000-otherhost-{dead}-00001.partial"
    for path in (partial, other_host):
        path.write_bytes(b"half")
    for path in (raw, alive):
        path.mkdir()
    assert sorted(recording_dir.remove_leftovers(tmp_path)) == sorted([partial.name, raw.name])
    assert alive.exists() and other_host.exists()


def test_train_data_summary_and_refusals(tmp_path):
    with pytest.raises(TrainInputError, match="no data shards"):
        shard_summary(tmp_path)
    _shard(tmp_path / "shard-a.safetensors", n_sequences=3, length=6, hidden=16)
    summary = shard_summary(tmp_path)
    assert (summary["sequences"], summary["tokens"], summary["hidden_size"]) == (3, 18, 16)
    (tmp_path / "shard-b.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(TrainInputError, match="shard-b.safetensors: not a readable data shard"):
        shard_summary(tmp_path)


def test_a_replacement_layer_is_checked_before_any_weight_moves(checkpoints, tmp_path):
    import json as _json

    from vllm_mtp_plugin.reload import ReloadRefused, check_replacement

    from support.checkpoint_edits import drop, edited_copy

    served = checkpoints("oracle")
    config = _json.loads((served / "config.json").read_text())
    assert check_replacement(served, config)["hidden_size"] == config["hidden_size"]
    wider = edited_copy(served, tmp_path / "wider", hidden_size=config["hidden_size"] * 2)
    with pytest.raises(ReloadRefused) as info:
        check_replacement(wider, config)
    assert (f"config.json hidden_size: {config['hidden_size'] * 2} here, "
            f"{config['hidden_size']} in the served checkpoint") in str(info.value)
    assert "the old layer keeps serving" in str(info.value)
    no_norm = edited_copy(served, tmp_path / "no-norm", tensors=drop(".enorm."))
    with pytest.raises(ReloadRefused, match="enorm"):
        check_replacement(no_norm, config)
    with pytest.raises(ReloadRefused, match="no config.json"):
        check_replacement(tmp_path, config)
    fifo = edited_copy(served, tmp_path / "fifo")
    os.mkfifo(fifo / "extra.safetensors")  # would block a reader, and the reloads after it
    with pytest.raises(ReloadRefused, match="extra.safetensors not regular files"):
        check_replacement(fifo, config)
    with pytest.raises(ReloadRefused, match="cannot be read"):  # ENAMETOOLONG: 400, not 500
        check_replacement(tmp_path / ("x" * 300), config)


def test_shared_modules_are_out_of_the_drafter_during_a_reload():
    from torch import nn

    from vllm_mtp_plugin.reload import shared_modules_detached

    target = nn.ModuleDict({"embed": nn.Embedding(4, 2), "head": nn.Linear(2, 4)})
    drafter = nn.Module()
    drafter.model = nn.Module()
    drafter.model.embed_tokens = target["embed"]
    drafter.model.layer = nn.Linear(2, 2)
    drafter.model.layer.head = target["head"]
    with shared_modules_detached(drafter, target) as detached:
        assert sorted(detached) == ["model.embed_tokens", "model.layer.head"]
        assert {id(p) for p in drafter.parameters()} == {
            id(p) for p in (drafter.model.layer.weight, drafter.model.layer.bias)}
    assert drafter.model.embed_tokens is target["embed"]
    assert drafter.model.layer.head is target["head"]


def test_reload_paths_stay_below_the_directory(tmp_path):
    from vllm_mtp_plugin.tools.live.endpoints import LayerVersions, LiveEndpoints
    from vllm_mtp_plugin.tools.live.options import ReloadSettings

    (tmp_path / "layers" / "v1").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "layers" / "link").symlink_to(tmp_path / "elsewhere")
    plugin = LiveEndpoints(ReloadSettings(directory=(tmp_path / "layers").resolve()))
    assert plugin.resolve("v1") == (tmp_path / "layers" / "v1").resolve()
    assert plugin.resolve(str(tmp_path / "layers" / "v1")) == (tmp_path / "layers" / "v1").resolve()
    for outside in ("../elsewhere", str(tmp_path / "elsewhere"), "link"):
        with pytest.raises(PermissionError, match="outside"):
            plugin.resolve(outside)
    # a layer that served before may serve again (a rollback to the checkpoint served at start)
    (tmp_path / "served").mkdir()
    plugin.versions = LayerVersions(str((tmp_path / "served").resolve()))
    assert plugin.resolve(str(tmp_path / "served")) == (tmp_path / "served").resolve()
    with pytest.raises(PermissionError, match="no layer that served here"):
        plugin.resolve(str(tmp_path / "elsewhere"))
    versions = LayerVersions("served")
    counts = {"vllm:spec_decode_num_drafts": 10.0, "vllm:spec_decode_num_draft_tokens": 10.0,
              "vllm:spec_decode_num_accepted_tokens": 4.0}
    versions.swapped("v1", counts)
    now = {k: 2 * v for k, v in counts.items()}
    assert versions.by_version(now) == [(0, counts), (1, counts)]


def test_adapt_implies_record_and_reload_and_refuses_both(tmp_path):
    live, rest = split_live_options(["model", "--adapt", str(tmp_path / "a"),
                                     "--record-fraction", "0.5", "--adapt-every-tokens", "500",
                                     "--allow-unauthenticated-reload", *SPEC])
    assert live.reload.api_key is None
    assert live.record.directory == tmp_path / "a" / "shards" and live.record.fraction == 0.5
    assert live.reload.directory == (tmp_path / "a" / "layers").resolve()
    assert live.adapt.every_tokens == 500 and rest[-1] == WORKER_EXTENSION
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o700
    with pytest.raises(LiveOptionError, match="leave out --record and --enable-layer-reload"):
        split_live_options(["model", "--adapt", str(tmp_path / "b"), "--record", str(tmp_path),
                            *SPEC])
    with pytest.raises(LiveOptionError, match="--adapt-threads 0: give 1 or more"):
        split_live_options(["model", "--adapt", str(tmp_path / "c"), "--adapt-threads", "0",
                            *SPEC])


def test_adapt_on_a_cpu_needs_a_sized_kv_cache(tmp_path, monkeypatch):
    """vLLM's CPU worker would take 92 % of memory for the KV cache and leave the trainer none
    (the OOM killer then takes the server); ``--record`` alone is warned (training may run
    elsewhere)."""
    from vllm_mtp_plugin.platform import platform_family

    assert platform_family() == "cpu"
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setenv("VLLM_MTP_RELOAD_API_KEY", "k")  # the reload key, from the environment
    with pytest.raises(LiveOptionError, match="VLLM_CPU_KVCACHE_SPACE=GiB"):
        split_live_options(["model", "--adapt", str(tmp_path / "a"), *SPEC])
    for sized in (["--kv-cache-memory-bytes", "4G"], ["--gpu-memory-utilization=0.3"]):
        live, rest = split_live_options(["model", "--adapt", str(tmp_path / "a"), *SPEC, *sized])
        assert live.adapt is not None and sized[0] in rest
    live, _ = split_live_options(["model", "--record", str(tmp_path / "r"), *SPEC])
    assert live.record is not None  # recording alone starts no trainer: a warning
    assert len(live.warnings) == 1 and "train --data on this machine" in live.warnings[0]
    assert "VLLM_CPU_KVCACHE_SPACE=GiB" in live.warnings[0]
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    assert split_live_options(["model", "--adapt", str(tmp_path / "a"), *SPEC])[0].adapt
    assert split_live_options(["model", "--record", str(tmp_path / "r"), *SPEC])[0].warnings == []


def test_adapt_decides_by_intervals_not_by_point_estimates():
    from vllm_mtp_plugin.tools.live.adapt import better_beyond_noise, served_worse

    assert better_beyond_noise({"agreement_interval": [0.71, 0.80]},
                               {"agreement_interval": [0.50, 0.70]})
    assert not better_beyond_noise({"agreement_interval": [0.69, 0.80]},
                                   {"agreement_interval": [0.50, 0.70]})
    accepted, drafts = "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_draft_tokens"
    assert served_worse({accepted: 300, drafts: 1000}, {accepted: 700, drafts: 1000})
    assert not served_worse({accepted: 680, drafts: 1000}, {accepted: 700, drafts: 1000})
    assert not served_worse({accepted: 3, drafts: 10}, {accepted: 7, drafts: 10})  # too few


def test_recording_figures_reach_prometheus(tmp_path):
    """The collector reads the recorder's counters at scrape time, ``_total`` counters and
    gauges under ``vllm_mtp:record_``, in a registry of its own here."""
    from collections import Counter

    from prometheus_client import CollectorRegistry, generate_latest

    from vllm_mtp_plugin.tools.engine.metrics import parse_prometheus
    from vllm_mtp_plugin.tools.live.record_metrics import RecordCollector

    recorder = SimpleNamespace(stats=Counter(finished=7, sampled=2, recorded=1, tokens=90,
                                             window_seconds=0.25),
                               directory_bytes=4096, paused_until=0.0)
    registry = CollectorRegistry()
    registry.register(RecordCollector(recorder))
    page = parse_prometheus(generate_latest(registry).decode())
    assert page[("vllm_mtp:record_finished_requests_total", ())] == 7
    assert page[("vllm_mtp:record_recorded_tokens_total", ())] == 90
    assert page[("vllm_mtp:record_window_seconds_total", ())] == 0.25
    assert page[("vllm_mtp:record_skipped_requests_total", ())] == 0
    assert page[("vllm_mtp:record_directory_bytes", ())] == 4096
    assert page[("vllm_mtp:record_active", ())] == 1
    recorder.stats["finished"] += 1
    recorder.paused_until = time.monotonic() + 60  # a window failed: recording pauses
    page = parse_prometheus(generate_latest(registry).decode())
    assert page[("vllm_mtp:record_finished_requests_total", ())] == 8
    assert page[("vllm_mtp:record_active", ())] == 0


def test_the_admin_surface_takes_its_key_bounds_its_history_and_names_no_path(tmp_path):
    from vllm_mtp_plugin.tools.live.endpoints import LayerVersions, LiveEndpoints
    from vllm_mtp_plugin.tools.live.options import ReloadSettings

    plugin = LiveEndpoints(ReloadSettings(tmp_path, api_key="admin"))
    assert plugin.authorized({"Authorization": "Bearer admin"})
    for headers in ({}, {"Authorization": "Bearer inference"}, {"Authorization": "admin"},
                    {"Authorization": "Basic admin"}):
        assert not plugin.authorized(headers)
    assert LiveEndpoints(ReloadSettings(tmp_path)).authorized({})  # --allow-unauthenticated-reload
    versions = LayerVersions("/srv/model", keep=4)
    for i in range(10):
        versions.swapped(str(tmp_path / f"round-{i}"), {})
    # The first (a rollback's target) and the newest three: bounded, /metrics series with them.
    assert [layer["version"] for layer in versions.layers] == [0, 8, 9, 10]
    plugin.versions = versions
    assert plugin.layer_name(str(tmp_path / "round-9")) == "round-9"
    assert plugin.layer_name("/srv/model") == "started with"
    assert plugin.public(f"{tmp_path}/x/config.json and /srv/model") == \
        "LAYERS/x/config.json and the served checkpoint"
    with pytest.raises(PermissionError) as refused:
        plugin.resolve("../elsewhere")
    assert str(tmp_path) not in str(refused.value)
    for bad in ("a\0b", "a\udcffb"):
        with pytest.raises(ValueError, match="not a usable path"):
            plugin.resolve(bad)



def test_the_reload_route_takes_json_only(tmp_path):
    """A web page can POST plain text to any port without asking (no CORS preflight): the
    reload route answers 415 to anything but application/json, before reading the body, so a
    server run with --allow-unauthenticated-reload cannot be driven from a browser tab; a
    deeply nested body is a 400, not a 500."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from vllm_mtp_plugin.tools.live.endpoints import LiveEndpoints
    from vllm_mtp_plugin.tools.live.options import ReloadSettings

    app = FastAPI()
    LiveEndpoints(ReloadSettings(tmp_path)).attach_router(app)  # no key, no engine yet
    client = TestClient(app)
    body = '{"path": "x"}'
    assert client.post("/mtp/reload", content=body,
                       headers={"Content-Type": "text/plain"}).status_code == 415
    assert client.post("/mtp/reload", content=body).status_code == 415
    ok = client.post("/mtp/reload", content=body,
                     headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 503  # past the check: the server is starting
    nested = client.post("/mtp/reload", content="[" * 100000 + "]" * 100000,
                         headers={"Content-Type": "application/json"})
    assert nested.status_code == 400


def test_a_shard_is_never_written_through_a_planted_link(tmp_path):
    """The recording directory may be shared: a link put where a shard is being written is
    replaced, and the file it points to is left as it was."""
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    shard = tmp_path / "shard-1.safetensors"
    shard.with_suffix(".partial").symlink_to(victim)
    write_shard(shard, [[1, 2, 3]], [4], [torch.zeros(3, 8)], [2], {}, private=True)
    assert victim.read_text() == "keep me"
    assert stat.S_IMODE(shard.stat().st_mode) == 0o600 and not shard.is_symlink()
    assert SequenceStore(tmp_path).tokens[0].tolist() == [1, 2, 3, 4]


def test_the_bound_holds_when_another_server_removes_shards_meanwhile(tmp_path, monkeypatch):
    for i in range(3):
        write_shard(tmp_path / f"shard-{i}.safetensors", [[1, 2, 3]], [4], [torch.zeros(3, 64)],
                    [2], {}, private=True)
        os.utime(tmp_path / f"shard-{i}.safetensors", (i, i))
    real_stat = type(tmp_path).stat

    def stat_of(path, *args, **kwargs):
        if path.name == "shard-0.safetensors":  # gone between the listing and its stat
            raise FileNotFoundError(path)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(type(tmp_path), "stat", stat_of)
    one = real_stat(tmp_path / "shard-1.safetensors").st_size
    assert recording_dir.enforce_bound(tmp_path, one) == ["shard-1.safetensors"]
    assert recording_dir.directory_bytes(tmp_path) == one


def test_directories_others_can_write_or_own_are_refused(tmp_path):
    """--record, --enable-layer-reload and --adapt directories: another user who may write
    there (or owns it) could plant shards or a layer the server loads. Nothing is chmod-ed."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(LiveOptionError, match="writable by other users \\(mode 777\\)"):
        split_live_options(["model", "--record", str(shared), *SPEC])
    shared.chmod(0o775)
    with pytest.raises(LiveOptionError, match="--enable-layer-reload .*mode 775"):
        split_live_options(["model", "--enable-layer-reload", str(shared), *SPEC,
                            "--reload-api-key", "k"])
    with pytest.raises(LiveOptionError, match="--adapt .*mode 775"):
        split_live_options(["model", "--adapt", str(shared), *SPEC, "--reload-api-key", "k",
                            "--kv-cache-memory-bytes", "1G"])
    assert stat.S_IMODE(shared.stat().st_mode) == 0o775
    if os.getuid() == 0:  # as root: a directory handed to another user
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(LiveOptionError, match="owned by another user \\(uid 65534\\)"):
            split_live_options(["model", "--record", str(theirs), *SPEC])


def test_adapt_stays_bounded_resumes_and_stops_a_stuck_round(tmp_path):
    """Weeks of --adapt: old candidates and rounds go (the serving layer and its rollback
    target stay), a restart numbers rounds on and loads the layer that served, a second server
    on the DIR is refused, a failed write of adapt.json stops nothing, a round process that
    hangs is stopped."""
    from vllm_mtp_plugin.tools.live import adapt
    from vllm_mtp_plugin.tools.live.endpoints import LayerVersions
    from vllm_mtp_plugin.tools.live.options import AdaptSettings

    root = tmp_path / "adapt"
    layers = root / "layers"
    for n in range(1, 7):
        (layers / f"round-{n}").mkdir(parents=True)
        (layers / f"round-{n}" / "config.json").write_text("{}")
        (root / "rounds" / str(n) / "work").mkdir(parents=True)
        (root / "rounds" / str(n) / "data").mkdir()
        (root / "rounds" / str(n) / "train.log").write_text("log")
    versions = LayerVersions("/srv/model")
    for n in (1, 2):  # round-2 serves, round-1 is its rollback target
        versions.swapped(str((layers / f"round-{n}").resolve()), {})
    recorder = SimpleNamespace(stats={"tokens": 0}, directory=root / "shards")
    endpoints = SimpleNamespace(versions=versions)
    adapter = adapt.Adapter(AdaptSettings(root, keep_rounds=2, timeout_s=0.5), recorder, endpoints)
    assert adapter.round == 6
    adapter._save({"event": "kept"})
    adapter._prune()
    assert sorted(p.name for p in layers.iterdir()) == ["round-1", "round-2", "round-5", "round-6"]
    assert sorted(p.name for p in (root / "rounds").iterdir()) == ["5", "6"]
    with pytest.raises(adapt.LiveOptionError, match="another server adapts in this directory"):
        adapt.Adapter(AdaptSettings(root), recorder, endpoints)
    adapter.lock.close()  # the first server stopped
    again = adapt.Adapter(AdaptSettings(root), recorder, endpoints)
    assert again.round == 6 and again.resume_from == (layers / "round-2").resolve()
    assert again.history[-1]["event"] == "kept"
    (root / "adapt.json.partial").mkdir()  # adapt.json cannot be written (as on a full disk)
    again._save({"event": "kept after watching"})
    assert again.history[-1]["event"] == "kept after watching"
    assert json.loads((root / "adapt.json").read_text())["history"][-1]["event"] == "kept"
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="still ran after 0.5 s"):
        asyncio.run(adapter._subprocess(["-c", "import time; time.sleep(60)"],
                                        tmp_path / "stuck.log"))
    assert time.monotonic() - started < 10


def test_the_training_work_dir_never_defaults_beside_its_output(tmp_path, monkeypatch):
    """``train --out LAYERS/new`` in a server's reload directory: the trainer state (read back
    on resume) goes to the user's cache or ``$VLLM_MTP_WORK_ROOT``, never below LAYERS; a re-run
    finds the same directory."""
    from vllm_mtp_plugin.tools.train.cli import default_work_dir

    layers = tmp_path / "layers"
    monkeypatch.delenv("VLLM_MTP_WORK_ROOT", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    work = default_work_dir(layers / "new")
    assert work.parent == tmp_path / "cache" / "vllm-mtp" / "train"
    assert work.name.startswith("new-") and work == default_work_dir(layers / "x" / ".." / "new")
    assert default_work_dir(tmp_path / "elsewhere" / "new") != work
    monkeypatch.setenv("VLLM_MTP_WORK_ROOT", str(tmp_path / "root"))
    assert default_work_dir(layers / "new").parent == tmp_path / "root"
    assert not default_work_dir(layers / "new").is_relative_to(layers)


def test_the_reload_client_follows_no_redirect_with_the_key(tmp_path):
    """A server answering 307 elsewhere: the client reports it and the key goes nowhere else."""
    import http.server
    import threading

    from vllm_mtp_plugin.tools.live.reload_client import request_reload

    seen = []

    class Elsewhere(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    elsewhere = http.server.HTTPServer(("127.0.0.1", 0), Elsewhere)

    class Redirecting(Elsewhere):
        def do_POST(self):
            self.send_response(307)
            self.send_header("Location", f"http://127.0.0.1:{elsewhere.server_port}/x")
            self.end_headers()

    redirecting = http.server.HTTPServer(("127.0.0.1", 0), Redirecting)
    for server in (elsewhere, redirecting):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        status, _ = request_reload(f"http://127.0.0.1:{redirecting.server_port}",
                                   str(tmp_path), "secret-key", timeout=30)
    finally:
        for server in (elsewhere, redirecting):
            server.shutdown()
    assert status == 307 and seen == []


def test_a_short_reload_key_is_warned(tmp_path):
    live, _ = split_live_options(["model", "--enable-layer-reload", str(tmp_path), *SPEC,
                                  "--reload-api-key", "k"])
    assert any("the reload key has 1 characters" in w for w in live.warnings)
    live, _ = split_live_options(["model", "--enable-layer-reload", str(tmp_path), *SPEC,
                                  "--reload-api-key", "0123456789abcdef"])
    assert not any("reload key" in w for w in live.warnings)


def test_a_rounds_shards_stay_readable_when_the_bound_removes_them(tmp_path):
    """--adapt's round links the shards it trains on; the recording bound may remove a shard
    meanwhile: the hard link keeps it readable for the round (a symbolic link would dangle), and
    a shard removed before it was linked is left out."""
    from vllm_mtp_plugin.tools.live.adapt import _link_shards

    shards = tmp_path / "shards"
    shards.mkdir()
    kept, gone = shards / "shard-1.safetensors", shards / "shard-2.safetensors"
    kept.write_bytes(b"data")
    into = _link_shards([kept, gone], tmp_path / "round" / "data")
    kept.unlink()  # the bound at work
    assert [p.name for p in into.iterdir()] == ["shard-1.safetensors"]
    assert (into / "shard-1.safetensors").read_bytes() == b"data"


def test_a_rounds_heldout_set_is_the_first_shards_after_its_snapshot(tmp_path):
    """--adapt evaluates on the first shards recorded after the training snapshot that hold
    --adapt-heldout-tokens, not on all traffic recorded while it trained (its cost bounded)."""
    from vllm_mtp_plugin.tools.live import adapt
    from vllm_mtp_plugin.tools.live.options import AdaptSettings

    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(6):
        write_shard(shards / f"shard-{i}.safetensors", [[1, 2, 3, 4, 5]], [6],
                    [torch.zeros(5, 4)], [2], {})
    recorder = SimpleNamespace(stats={"tokens": 0}, directory=shards)
    (tmp_path / "adapt").mkdir()
    adapter = adapt.Adapter(AdaptSettings(tmp_path / "adapt", min_heldout_tokens=8), recorder,
                            SimpleNamespace(versions=None))
    seen = {shards / "shard-0.safetensors"}
    into = asyncio.run(adapter._heldout_after(seen, tmp_path / "heldout"))
    assert sorted(p.name for p in into.iterdir()) == ["shard-1.safetensors", "shard-2.safetensors"]
    adapter.lock.close()
