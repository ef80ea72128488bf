"""Prompt loaders (bundled, user JSONL, ShareGPT) and checkpoint specs of the benchmark."""

import json

import pytest

from vllm_mtp_plugin.tools.tiny import presets
from vllm_mtp_plugin.tools.prompt_files import load_prompts, write_sharegpt
from vllm_mtp_plugin.tools.tiny.tokenizer import bundled_prompt_texts


def test_bundled_prompts():
    prompts = load_prompts()  # how many: test_shipped_data.py
    assert prompts == bundled_prompt_texts()
    assert load_prompts(limit=3) == prompts[:3]
    n = len(prompts)  # cycles when more requests than prompts
    assert load_prompts(limit=n + 2) == prompts + prompts[:2]


def test_user_jsonl(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "first"}\n\n{"prompt": "second", "output_tokens": 5}\n')
    assert load_prompts(path) == ["first", "second"]


def test_sharegpt_json_and_jsonl(tmp_path):
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "x"}]},
        {"id": "b", "conversations": [{"from": "system", "value": "be brief"},
                                      {"from": "human", "value": "q2"}]},
        {"id": "c", "conversations": [{"from": "gpt", "value": "no question here"}]},
        {"id": "d", "messages": [{"role": "user", "content": "q3"}]},
    ]
    as_json = tmp_path / "sg.json"
    as_json.write_text(json.dumps(data))
    as_jsonl = tmp_path / "sg.jsonl"
    as_jsonl.write_text("\n".join(json.dumps(d) for d in data))
    assert load_prompts(as_json) == ["q1", "q2", "q3"]
    assert load_prompts(as_jsonl) == ["q1", "q2", "q3"]


def test_bad_records(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match="record 0"):
        load_prompts(path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        load_prompts(empty)


def test_sharegpt_file_reads_back_in_order_in_vllm_too(tmp_path):
    prompts = ["Explain tides.", "Write a haiku about rust.", "Name three rivers."]
    path = write_sharegpt(prompts, tmp_path / "p.json")
    assert load_prompts(path) == prompts
    from vllm.benchmarks.datasets.datasets import ShareGPTDataset

    dataset = ShareGPTDataset(dataset_path=str(path), disable_shuffle=True)
    assert [d["conversations"][0]["value"] for d in dataset.data] == prompts


def test_checkpoint_specs(tmp_path):
    assert presets.parse_preset("bench:noisy:0.7") == ("bench", "noisy", 0.7)
    assert presets.parse_preset("small:oracle") == ("small", "oracle", 0.7)
    assert presets.parse_preset("tiny") == ("tiny", "noisy", 0.7)
    for bad in ("huge", "tiny:perfect", "tiny:noisy:1.5"):
        with pytest.raises(ValueError):
            presets.parse_preset(bad)


def test_trained_preset_is_written_once_from_the_shipped_files(tmp_path):
    logs = []
    ckpt = presets.resolve("trained", tmp_path, log=logs.append)
    again = presets.resolve("trained", tmp_path, log=logs.append)
    assert len(logs) == 1 and again.path == ckpt.path == tmp_path / "trained"
    assert (ckpt.label, ckpt.variant, ckpt.meta["mode"]) == ("trained", "v3", "trained")
    assert ckpt.parameters > 8_000_000
    assert json.loads((ckpt.path / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_preset_is_built_once_and_a_directory_is_taken_as_is(tmp_path):
    logs = []
    first = presets.resolve("tiny:oracle", tmp_path, log=logs.append)
    stamp = (first.path / "model.safetensors").stat().st_mtime_ns
    again = presets.resolve("tiny:oracle", tmp_path, log=logs.append)
    assert len(logs) == 1 and again.path == first.path == tmp_path / "tiny-oracle-seed0"
    assert (again.path / "model.safetensors").stat().st_mtime_ns == stamp
    assert first.label == "tiny-oracle" and first.meta["mode"] == "oracle"
    assert first.parameters == first.meta["parameters"] > 0
    direct = presets.resolve(str(first.path))
    assert direct.path == first.path and direct.meta == first.meta


def test_prompt_kinds_and_chats(tmp_path):
    from vllm_mtp_plugin.tools.prompt_files import load_prompt_groups
    from vllm_mtp_plugin.tools.bench.sweep import Sweep

    path = tmp_path / "kinds.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"kind": "code", "prompt": "def f():"}, {"kind": "prose", "prompt": "Once"},
        {"kind": "chat", "prompt": "Hi?"}, {"kind": "code", "prompt": "class A:"},
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Why?"}]},
    ]))
    groups = load_prompt_groups(path, limit=3)
    assert groups == {"code": ["def f():", "class A:", "def f():"], "prose": ["Once"] * 3,
                      "chat": [[{"role": "user", "content": "Hi?"}],
                               [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Why?"}],
                               [{"role": "user", "content": "Hi?"}]]}
    assert load_prompt_groups(path, by_kind=False) == {
        "all": ["def f():", "Once", "Hi?", "class A:", "Why?"]}
    passes = Sweep(temperatures=[0.0, 1.0], seed=7).passes(groups)
    assert [(p["label"]["prompts"], p["label"]["temperature"], p["chat"]) for p in passes] == [
        ("code", 0.0, False), ("code", 1.0, False), ("prose", 0.0, False),
        ("prose", 1.0, False), ("chat", 0.0, True), ("chat", 1.0, True)]
    assert passes[0]["sampling"] == {"temperature": 0.0}
    assert passes[1]["sampling"] == {"temperature": 1.0, "seed": 7}
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"kind": "x", "prompt": "a"}\n'
                     '{"kind": "x", "messages": [{"role": "user", "content": "b"}]}\n')
    with pytest.raises(ValueError, match="kind 'x' mixes chats"):
        load_prompt_groups(mixed)
