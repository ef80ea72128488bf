"""Checkpoints whose MTP part disagrees with config.json are refused before the engine starts.

Each malformed checkpoint is derived from a tiny valid one by rewriting safetensors bytes (dtypes
kept exactly, FP8/E8M0 included) or config.json, then handed to vLLM's own start-up path
(``EngineArgs(...).create_engine_config()``, what ``LLM(...)`` and ``vllm serve`` run first) in a
child process with the plugin installed. Valid checkpoints pass (the real DeepSeek name lists and
what the check reads: ``tests/unit/weights/test_preflight_reads.py``).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.checkpoint_edits import drop, edited_copy, read_raw
from support.drafters import tiny_v4_checkpoint

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

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


def test_valid_checkpoints_start(start_up):
    assert start_up["valid_v3"][1] is None
    assert start_up["valid_v4"][1] is None
