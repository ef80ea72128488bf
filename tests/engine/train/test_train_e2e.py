"""A new user's path: a DeepSeek-V3 checkpoint without an MTP layer -> ``vllm-mtp train`` (vLLM's
default process mode) -> serve the result; acceptance, counted by vLLM, well above the untrained
layer's. Short settings (the defaults take about ten minutes; docs/training.md has their
figures)."""

import json
import os
import subprocess
import sys
from importlib import resources

import pytest

from vllm_mtp_plugin.tools.prompt_files import load_prompts
from vllm_mtp_plugin.tools.tiny import trained
from vllm_mtp_plugin.tools.train.cli import DEFAULT_PROMPTS, default_work_dir
from vllm_mtp_plugin.tools.mtp_layer.drafter_inputs import load_training_prompts

from support.engines import engine_runner

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

HELD_OUT = load_prompts(trained.shipped_dir().parent / "trained_prompts.jsonl")
# The prompts `vllm-mtp train` collects from without --prompts (their count: test_shipped_data.py).
TRAIN_PROMPTS = load_training_prompts(str(resources.files("vllm_mtp_plugin.tools") / DEFAULT_PROMPTS))
SAMPLES_PER_PROMPT = 2


def acceptance(model, k=1):
    """Eager: the compiled twin is test_graft.py (a layer written into the trained model's
    files, served compiled with the original's tokens and counters)."""
    run = engine_runner(prompts=HELD_OUT, max_tokens=40, eager="compiled-twin",
                        llm_kwargs={"dtype": "bfloat16"})(model, k)
    spec = run["spec_decode"]
    return spec["num_accepted_tokens"] / spec["num_draft_tokens"]


def test_train_a_layer_for_a_target_without_one_and_serve_it(tmp_path):
    bare = trained.write_checkpoint(tmp_path / "bare", mtp_layers=0)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.pop("VLLM_MTP_WORK_ROOT", None)  # the default: the user's cache
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    done = subprocess.run(
        [sys.executable, "-m", "vllm_mtp_plugin.tools.cli", "train", str(bare), "--out", str(out),
         "--steps", "150", "--batch-size", "16", "--samples-per-prompt", str(SAMPLES_PER_PROMPT),
         "--max-new-tokens", "64", "--quiet"],
        env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "init scratch" in done.stdout  # auto: no MTP layer in the target -> a new one
    assert "held-out agreement with the target's greedy token, per depth:" in done.stdout
    assert (out / "training" / "loss.png").stat().st_size > 1000
    assert (out / "training" / "accuracy.png").stat().st_size > 1000
    record = json.loads((out / "training" / "training.json").read_text())
    assert record["sequences"] == len(TRAIN_PROMPTS) * SAMPLES_PER_PROMPT
    assert record["held_out"]["accuracy"][0] > 0.2
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    trained_rate = acceptance(out)
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("VLLM_MTP_WORK_ROOT", raising=False)
        patch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        work = default_work_dir(out)
    assert work.is_relative_to(tmp_path / "cache") and not list(tmp_path.glob("out.*"))
    assert not (work / "trainer-state.pt").exists() and (work / "data").is_dir()  # exported
    untrained_rate = acceptance(work / "scaffold")
    assert trained_rate > 0.25 and trained_rate > untrained_rate + 0.2, (trained_rate,
                                                                          untrained_rate)
