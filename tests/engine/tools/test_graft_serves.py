"""``vllm-mtp graft`` served: the trained tiny DeepSeek without its MTP layer, given it back from
the full checkpoint, serves exactly like the original (the command's refusals and FP8 copies:
``tests/unit/tools/test_graft.py``)."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from support.engines import engine_runner

from vllm_mtp_plugin.tools.graft import main
from vllm_mtp_plugin.tools.tiny import trained

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

PROMPTS = ["from django.db import models\n\n\nclass Article(models.Model):\n",
           "Django's template language is designed to"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The trained tiny DeepSeek's files with and without its MTP layer."""
    root = tmp_path_factory.mktemp("graft")
    return (trained.write_checkpoint(root / "full", mtp_layers=1),
            trained.write_checkpoint(root / "bare", mtp_layers=0))


_serve = engine_runner(prompts=PROMPTS, max_tokens=24, llm_kwargs={"dtype": "float32"})


def serve(model, k=2):
    return _serve(model, k)


def test_grafted_checkpoint_serves_like_the_original(pair, tmp_path, capsys):
    full, bare = pair
    out = tmp_path / "out"
    assert main([str(full), str(bare), "--out", str(out)]) == 0
    assert "1 MTP layer(s)" in capsys.readouterr().out
    assert (out / "model.safetensors").is_symlink()  # the target's file, untouched
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    assert config == {**json.loads((bare / "config.json").read_text()),
                      "num_nextn_predict_layers": 1}
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    grafted = {n for n, f in index.items() if f == "mtp-00001-of-00001.safetensors"}
    original = load_file(str(full / "model.safetensors"))
    assert grafted == {n for n in original if n.startswith("model.layers.4.")}
    with safe_open(str(out / "mtp-00001-of-00001.safetensors"), "pt") as f:
        for name in grafted:
            assert torch.equal(f.get_tensor(name), original[name]), name
    ours, reference = serve(out), serve(full)
    assert ours["token_ids"] == reference["token_ids"]
    assert ours["spec_decode"] == reference["spec_decode"]
    assert reference["spec_decode"]["num_accepted_tokens"] > 0
