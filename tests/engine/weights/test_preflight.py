"""Checkpoints whose MTP part disagrees with config.json are refused before the engine starts.

Each malformed checkpoint is derived from a tiny valid one by rewriting safetensors bytes (dtypes
kept exactly, FP8/E8M0 included) or config.json, then handed to vLLM's own start-up path
(``EngineArgs(...).create_engine_config()``, what ``LLM(...)`` and ``vllm serve`` run first) in a
child process with the plugin installed. Valid checkpoints and the real DeepSeek name lists pass.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.checkpoint_edits import drop, edited_copy, read_raw, write_raw
from support.name_lists import DATA, name_list_rows
from support.drafters import tiny_v4_checkpoint

from vllm_mtp_plugin.weights.preflight import tensor_problems

# --------------------------------------------------------------------------- raw edits


def rename(old: str, new: str):
    return lambda t: {k.replace(old, new): v for k, v in t.items()}


def copy_layer(old: str, new: str):
    return lambda t: {**t, **{k.replace(old, new): v for k, v in t.items() if k.startswith(old)}}


def retype(name: str, dtype: str):
    return lambda t: {k: ((dtype, *v[1:]) if k == name else v) for k, v in t.items()}


def reshape_eh_proj(t):
    dtype, (rows, cols), data = t["model.layers.2.eh_proj.weight"]
    t["model.layers.2.eh_proj.weight"] = (dtype, [rows, cols // 2], data[: len(data) // 2])
    return t


def index_naming_absent_shard(model: Path) -> None:
    names = read_raw(model / "model.safetensors")
    weight_map = {name: "model.safetensors" for name in names}
    weight_map["model.layers.2.enorm.weight"] = "model-00002-of-00002.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def truncate(model: Path) -> None:
    shard = model / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def garble_header(model: Path) -> None:
    shard = model / "model.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[8:16] = b"not json"
    shard.write_bytes(bytes(raw))


# kind -> (edited_copy kwargs, substrings the refusal must contain)
V3_CASES = {
    "missing": ({"raw_tensors": drop("model.layers.2.")},
                ["model.safetensors has no tensors for MTP layer 0 (model.layers.2.*, deepseek_v3 "
                 "(Hugging Face))", "exported without its MTP"]),
    "shifted_up": ({"raw_tensors": rename("model.layers.2.", "model.layers.3.")},
                   ["config.json puts MTP layer 0 at model.layers.2.*", "are at model.layers.3.*",
                    "shifted"]),
    "shifted_down": ({"num_hidden_layers": 3},
                     ["puts MTP layer 0 at model.layers.3.* (num_hidden_layers=3",
                      "are at model.layers.2.*"]),
    "partial_own": ({"raw_tensors": drop("model.layers.2.enorm.")},
                    ["MTP layer 0 (model.layers.2.*) is incomplete: 1 tensor(s) missing: "
                     "model.layers.2.enorm.weight"]),
    "partial_block": ({"raw_tensors": drop("model.layers.2.self_attn.kv_b_proj.")},
                      ["1 tensor(s) missing: model.layers.2.self_attn.kv_b_proj.weight"]),
    "missing_expert": ({"raw_tensors": drop("model.layers.2.mlp.experts.3.")},
                       ["3 tensor(s) missing: model.layers.2.mlp.experts.3.gate_proj.weight"]),
    "surplus": ({"raw_tensors": copy_layer("model.layers.2.", "model.layers.3.")},
                ["MTP layer(s) model.layers.3.* beyond the 1 that config.json declares",
                 "set num_nextn_predict_layers to 2"]),
    "wrong_shape": ({"raw_tensors": reshape_eh_proj},
                    ["tensor 'model.layers.2.eh_proj.weight' has shape [256, 256]",
                     "needs [256, 512]"]),
    "bad_dtype": ({"raw_tensors": retype("model.layers.2.hnorm.weight", "F6_E3M2")},
                  ["tensor 'model.layers.2.hnorm.weight' is stored as F6_E3M2"]),
    "absent_shard": ({"files": index_naming_absent_shard},
                     ["names shard model-00002-of-00002.safetensors, which is not in"]),
    "truncated": ({"files": truncate}, ["model.safetensors: the header places tensor data up to",
                                        "the file is truncated"]),
    "garbled_header": ({"files": garble_header},
                       ["model.safetensors: the safetensors header is not valid"]),
}
V4_CASES = {
    "v4_missing": ({"raw_tensors": drop("mtp.")},
                   ["model.safetensors has no tensors for MTP layer 0 (mtp.0.*, deepseek_v4"]),
    "v4_dspark": ({"raw_tensors": drop("mtp.0.enorm.", "mtp.0.hnorm.")},
                  ["mtp.0.* has", "no enorm/hnorm, so it is not a DeepSeek MTP layer; it looks "
                   "like a DSpark drafter", '"method": "dspark"']),
    "v4_partial": ({"raw_tensors": drop("mtp.0.hc_head_fn", "mtp.0.e_proj.")},
                   ["MTP layer 0 (mtp.0.*) is incomplete: 2 tensor(s) missing: mtp.0.e_proj.weight, "
                    "mtp.0.hc_head_fn"]),
    "v4_surplus": ({"raw_tensors": copy_layer("mtp.0.", "mtp.1.")},
                   ["MTP layer(s) mtp.1.* beyond the 1 that config.json declares"]),
}

REFUSE = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
results = {}
for model in sys.argv[1:]:
    try:
        EngineArgs(model=model, max_model_len=256,
                   speculative_config={"method": "mtp", "num_speculative_tokens": 1}
                   ).create_engine_config()
        results[model] = None
    except Exception as exc:
        results[model] = f"{type(exc).__name__}: {exc}"
print("RESULTS" + json.dumps(results))
"""


@pytest.fixture(scope="module")
def start_up(checkpoints, tmp_path_factory):
    """Every case through vLLM's start-up in one child process: model dir -> error or None."""
    root = tmp_path_factory.mktemp("preflight")
    bases = {"v3": checkpoints("oracle"), "v4": tiny_v4_checkpoint("random")}
    dirs = {kind: edited_copy(bases["v4" if kind.startswith("v4") else "v3"], root / kind,
                             **kwargs)
            for kind, (kwargs, _) in {**V3_CASES, **V4_CASES}.items()}
    dirs["valid_v3"], dirs["valid_v4"] = bases["v3"], bases["v4"]
    out = subprocess.run([sys.executable, "-c", REFUSE, *map(str, dirs.values())],
                         capture_output=True, text=True, timeout=900)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULTS")), None)
    assert line, out.stdout[-2000:] + out.stderr[-4000:]
    results = json.loads(line.removeprefix("RESULTS"))
    return {kind: (path, results[str(path)]) for kind, path in dirs.items()}


@pytest.mark.engine
@pytest.mark.parametrize("kind", [*V3_CASES, *V4_CASES])
def test_malformed_checkpoint_is_refused_with_the_fix(start_up, kind):
    model, error = start_up[kind]
    expected = {**V3_CASES, **V4_CASES}[kind][1]
    assert error is not None, f"{kind} was accepted"
    assert error.startswith("CheckpointError: vllm-mtp-plugin checked") or \
        "vllm-mtp-plugin checked" in error, error
    assert str(model) in error
    for fragment in expected:
        assert fragment in error, f"{kind}: {fragment!r} not in:\n{error}"


@pytest.mark.engine
def test_valid_checkpoints_start(start_up):
    assert start_up["valid_v3"][1] is None
    assert start_up["valid_v4"][1] is None


TORCH_TO_SAFETENSORS = {"bf16": "BF16", "float32": "F32", "float8_e4m3fn": "F8_E4M3",
                        "float8_e8m0fnu": "F8_E8M0", "int8": "I8"}


def real_tensors(name_list: str) -> dict[str, dict]:
    """The list's tensors as the start-up check reads them from safetensors headers."""
    return {name: {"shape": list(shape), "dtype": TORCH_TO_SAFETENSORS[dtype], "file": "shard"}
            for name, shape, dtype in name_list_rows(name_list)}


def test_the_real_deepseek_name_lists_pass():
    v3_config = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "num_nextn_predict_layers": 1,
                 "hidden_size": 7168, "n_routed_experts": 256, "q_lora_rank": 1536}
    v3 = real_tensors("deepseek_v3_mtp_layer61_names.txt")
    assert len(v3) == 1564
    assert tensor_problems(v3, v3_config, Path("DeepSeek-V3")) == []
    v4_config = json.loads((DATA / "deepseek_v4_config.json").read_text())
    v4 = real_tensors("deepseek_v4_mtp_names.txt")
    assert len(v4) == 1581
    assert tensor_problems(v4, v4_config, Path("DeepSeek-V4-Flash")) == []
    # And the same lists with a tensor taken out are refused.
    del v4["mtp.0.ffn.experts.17.w2.weight"]
    assert tensor_problems(v4, v4_config, Path("DeepSeek-V4-Flash")) == [
        "DeepSeek-V4-Flash: MTP layer 0 (mtp.0.*) is incomplete: 1 tensor(s) missing: "
        "mtp.0.ffn.experts.17.w2.weight. Re-export the checkpoint with every tensor of its MTP "
        "layers, or serve without --speculative-config."]


# ------------------------------------------- start-up in each worker: the shard index, not headers


def drafter_config(model_dir: Path):
    from types import SimpleNamespace

    return SimpleNamespace(quant_config=None, speculative_config=SimpleNamespace(
        draft_model_config=SimpleNamespace(model=str(model_dir))))


@pytest.mark.parametrize("with_rot", [False, True])
def test_rotation_lookup_reads_the_index_and_opens_no_shard(checkpoints, tmp_path, monkeypatch,
                                                           with_rot):
    """``uses_rotation`` runs in every worker (163 shards x 8 ranks for DeepSeek-V3): a sharded
    checkpoint is answered by its index alone; its shards here are dangling links, which any
    header read would fail on. A single-file checkpoint has its one header read."""
    from vllm_mtp_plugin.models import v3
    from vllm_mtp_plugin.weights import headers

    names = read_raw(checkpoints("oracle") / "model.safetensors")
    single = tmp_path / "single"
    single.mkdir()
    write_raw(single / "model.safetensors", {**names, **({"rot.weight": names[
        "model.layers.2.enorm.weight"]} if with_rot else {})})
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    weight_map = {name: f"model-0000{1 + i % 3}-of-00003.safetensors"
                  for i, name in enumerate([*names, *(["rot.weight"] if with_rot else [])])}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for shard in set(weight_map.values()):
        (sharded / shard).symlink_to(tmp_path / "absent" / shard)
    reads = []
    real_read_header = headers.read_header
    monkeypatch.setattr(headers, "read_header", lambda path: reads.append(Path(path).name)
                        or real_read_header(path))
    assert v3.uses_rotation(drafter_config(sharded)) is with_rot
    assert reads == []
    assert v3.uses_rotation(drafter_config(single)) is with_rot
    assert reads == ["model.safetensors"]
    # The loader's messages name a tensor's file the same way: from the index.
    assert headers.tensor_file(str(sharded), "model.layers.2.enorm.weight") == str(
        sharded / weight_map["model.layers.2.enorm.weight"])
    assert reads == ["model.safetensors"]


def test_start_up_check_opens_only_the_shards_holding_the_mtp_layer(checkpoints, tmp_path,
                                                                    monkeypatch):
    """The front-end's start-up check reads the shard index, then the headers of the shards that
    hold MTP-layer tensors only: the target's shards here are dangling links, which a header read
    would report as unreadable; the MTP layer's own problems are still found."""
    from vllm_mtp_plugin.weights import headers, preflight

    model = checkpoints("oracle")
    config = json.loads((model / "config.json").read_text())
    mtp_prefix = f"model.layers.{config['num_hidden_layers']}."
    names = read_raw(model / "model.safetensors")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    weight_map = {name: ("model-00003-of-00003.safetensors" if name.startswith(mtp_prefix)
                         else f"model-0000{1 + i % 2}-of-00003.safetensors")
                  for i, name in enumerate(names)}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (sharded / "config.json").write_text(json.dumps(config))
    for shard in ("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"):
        (sharded / shard).symlink_to(tmp_path / "absent" / shard)
    mtp = {name: entry for name, entry in names.items() if name.startswith(mtp_prefix)}
    write_raw(sharded / "model-00003-of-00003.safetensors", mtp)
    reads = []
    real_read_header = headers.read_header
    monkeypatch.setattr(headers, "read_header", lambda path: reads.append(Path(path).name)
                        or real_read_header(path))
    assert preflight.mtp_problems(sharded, config) == []
    assert reads == ["model-00003-of-00003.safetensors"]
    # The same layer with a tensor dropped is still refused, by name.
    dropped = sorted(mtp)[0]
    write_raw(sharded / "model-00003-of-00003.safetensors",
              {name: entry for name, entry in mtp.items() if name != dropped})
    problems = preflight.mtp_problems(sharded, config)
    assert len(problems) == 1 and dropped in problems[0], problems
    # Without the index's help every shard is opened: the dangling ones are reported by name.
    problems = headers.read_checkpoint(sharded)[1]
    assert [p.split(":")[0] for p in problems] == [
        str(sharded / "model-00001-of-00003.safetensors"),
        str(sharded / "model-00002-of-00003.safetensors")]
