"""One prompt-file reader for bench, tune and train: plain lines, JSON Lines, JSON arrays
(ShareGPT); a file it cannot read is refused naming the file, the line and the formats."""

import json

import pytest

from vllm_mtp_plugin.tools.prompt_files import load_prompt_groups, load_prompts
from vllm_mtp_plugin.tools.prompt_files import PromptFileError, prompt_of, read_records
from vllm_mtp_plugin.tools.mtp_layer.v3_target import TrainInputError
from vllm_mtp_plugin.tools.mtp_layer.drafter_inputs import load_training_prompts


def test_plain_lines_are_prompts_for_every_tool(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("def parse(path):\n\nThe weather today is\n{not json at all\n")
    lines = ["def parse(path):", "The weather today is", "{not json at all"]
    assert [r.value for r in read_records(path)] == lines
    assert [r.where for r in read_records(path)] == [f"{path}:1", f"{path}:3", f"{path}:4"]
    assert load_prompts(path) == lines  # bench and tune (a JSONDecodeError before)
    assert load_prompt_groups(path) == {"all": lines}
    assert load_training_prompts(path) == lines


def test_jsonl_and_sharegpt_read_alike_by_bench_and_train(tmp_path):
    records = [{"prompt": "complete me"}, {"prompt": "hi there", "kind": "chat"},
               {"messages": [{"role": "user", "content": "a chat"}]},
               {"conversations": [{"from": "human", "value": "shared"}]}]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    array = tmp_path / "p.json"
    array.write_text(json.dumps(records, indent=1))
    for path in (jsonl, array):
        assert load_prompts(path) == ["complete me", "hi there", "a chat", "shared"]
        assert load_training_prompts(path) == [
            "complete me", [{"role": "user", "content": "hi there"}],
            [{"role": "user", "content": "a chat"}], [{"role": "user", "content": "shared"}]]



def test_one_reading_of_a_record_for_every_tool(tmp_path):
    """``prompt_of`` is the one interpreter: bench groups and sends what it returns, train trains
    on it; they differ only where documented (ShareGPT's human turn: a completion for bench, as
    ``vllm bench serve`` sends it; a chat for train)."""
    sharegpt = {"conversations": [{"from": "gpt", "value": "hello"},
                                  {"from": "human", "value": "shared"}]}
    assert prompt_of(sharegpt, "x") == "shared"
    assert prompt_of(sharegpt, "x", sharegpt_as_chat=True) == [{"role": "user", "content": "shared"}]
    assert prompt_of({"conversations": [{"from": "gpt", "value": "no human"}]}, "x") is None
    system_first = {"messages": [{"role": "system", "content": "be brief"},
                                 {"role": "user", "content": "why?"}]}
    assert prompt_of(system_first, "x") == system_first["messages"]
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(system_first) + "\n")
    assert load_prompts(path) == ["why?"]  # tune's completion prompts: the human turn
    assert load_prompt_groups(path) == {"chat": [system_first["messages"]]}
    assert load_training_prompts(path) == [system_first["messages"]]

@pytest.mark.parametrize("text, where, what", [
    ('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c", oops}\n', ":3:", "not JSON"),
    ('{"prompt": "a"}\n[1, 2]\n', ":2:", "record 1 is a list"),
    ('[{"prompt": "a"},\n {"prompt": "b"\n', ":3:", "starts with '[' but is not valid JSON"),
    ('[{"prompt": "a"}, 7]', ": record 1", "is a int"),
    ('{"text": "no prompt field"}\n', ":1: record 0", "needs a 'prompt', 'messages' or"),
])
def test_a_file_it_cannot_read_names_file_line_and_formats(tmp_path, text, where, what):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(PromptFileError) as caught:
        load_prompts(path)
    assert f"{path}{where}" in str(caught.value) and what in str(caught.value)
    with pytest.raises(TrainInputError) as caught:
        load_training_prompts(path)
    assert f"{path}{where}" in str(caught.value)


def test_missing_or_binary_files_are_refused(tmp_path):
    with pytest.raises(PromptFileError, match="no such prompt file"):
        read_records(tmp_path / "nothing.txt")
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(PromptFileError, match="not UTF-8 text"):
        read_records(binary)


def test_tune_and_bench_stop_with_the_message_not_a_traceback(tmp_path, capsys):
    from vllm_mtp_plugin.tools.bench.cli import main as bench_main
    from vllm_mtp_plugin.tools.tune.cli import main as tune_main

    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(SystemExit, match=f"vllm-mtp tune: --prompts {path}:2: not JSON"):
        tune_main([str(tmp_path), "--prompts", str(path)])
    with pytest.raises(SystemExit, match=f"vllm-mtp bench: --prompts {path}:2: not JSON"):
        bench_main(["offline", "--prompts", str(path), "--out", str(tmp_path / "out")])
