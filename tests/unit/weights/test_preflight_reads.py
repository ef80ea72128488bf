"""The start-up check without an engine: the real DeepSeek name lists pass it, and it reads only
what it needs, the shard index and the headers of the shards holding the MTP layer (malformed
checkpoints through vLLM's start-up: ``tests/engine/weights/test_preflight.py``)."""

import json
from pathlib import Path

import pytest
from support.checkpoint_edits import read_raw, write_raw
from support.name_lists import DATA, name_list_rows

from vllm_mtp_plugin.weights.preflight import tensor_problems


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
