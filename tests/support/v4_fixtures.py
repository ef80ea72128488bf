"""The V4 drafter's fixtures, shared by the files that build it in this process
(``tests/engine/v4/conftest.py`` makes them theirs): the tiny bf16 and FP8 checkpoints, their
tensors, a vLLM config made current in a world of one, and the bf16 drafter as vLLM's loader
leaves it."""

import pytest

from support.drafters import (
    build_drafter,
    checkpoint_tensors,
    engine_config,
    process_loaded_drafter,
    single_process_vllm,
    tiny_v4_checkpoint,
)


@pytest.fixture(scope="module")
def v4_bf16_dir():
    return tiny_v4_checkpoint("random", quantization=None)


@pytest.fixture(scope="module")
def v4_fp8_dir():
    return tiny_v4_checkpoint("random")


@pytest.fixture(scope="module")
def v4_tensors(v4_bf16_dir):
    return checkpoint_tensors(v4_bf16_dir)


@pytest.fixture(scope="module")
def v4_config(v4_bf16_dir):
    """The bf16 checkpoint's vLLM config, current for the module (world size 1)."""
    with single_process_vllm(engine_config(v4_bf16_dir)) as config:
        yield config


@pytest.fixture(scope="module")
def v4_fp8_config(v4_fp8_dir):
    with single_process_vllm(engine_config(v4_fp8_dir)) as config:
        yield config


@pytest.fixture(scope="module")
def v4_drafter(v4_config, v4_tensors):
    """Our bf16 V4 drafter, every parameter loaded and processed for CPU kernels, as vLLM's
    loader leaves it."""
    model = build_drafter(v4_config)
    assert model.load_weights(v4_tensors.items()) == {n for n, _ in model.named_parameters()}
    process_loaded_drafter(model, v4_config)
    return model
