"""Compiled engines draft step s with MTP layer L + s (Model Runner V2, vLLM's default compilation).

vLLM traces a compiled forward once and drops its guards; a drafter compiled as one module keeps
the layer its first draft step chose. The plugin compiles each MTP layer on its own
(``models/v3.py``). Shown by acceptance, not instrumentation: layer L is an oracle and layer L + 1
has a random ``eh_proj``, so a right second step is rejected (0.0) and a baked one accepted (1.0).
"""

import json

import pytest
import torch
from support.checkpoint_edits import edited_copy
from support.engines import engine_runner


pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)


@pytest.fixture(scope="module")
def first_layer_only_oracle(checkpoints, tmp_path_factory):
    source = checkpoints("oracle", num_nextn_predict_layers=2)
    last = json.loads((source / "config.json").read_text())["num_hidden_layers"] + 1
    name = f"model.layers.{last}.eh_proj.weight"

    def randomize_second_layer(tensors):
        random = torch.randn(tensors[name].shape, generator=torch.Generator().manual_seed(1))
        tensors[name] = random.to(tensors[name].dtype)

    return edited_copy(source, tmp_path_factory.mktemp("two-layers") / "ckpt",
                       tensors=randomize_second_layer)


def per_position(model, impl: str, prompts) -> list[float]:
    result = engine_runner(timeout=1200, runner="v2", max_tokens=12, llm_kwargs={"dtype": "float32"})(
        model, 2, impl=impl, prompts=prompts[:2])
    assert result["runner"] == "v2" and result["compilation"] == "DYNAMO_TRACE_ONCE"
    return result["spec_decode"]["per_position_acceptance"]


def test_compiled_v2_runs_layer_l_plus_1_at_step_1(first_layer_only_oracle, prompts):
    assert per_position(first_layer_only_oracle, "plugin", prompts) == [1.0, 0.0]


def test_vllms_own_class_keeps_layer_l_when_compiled(first_layer_only_oracle, prompts):
    """vLLM 0.32's DeepSeekMTP compiled as one module: step 1 runs layer L again (its oracle)."""
    assert per_position(first_layer_only_oracle, "in-tree", prompts) == [1.0, 1.0]
