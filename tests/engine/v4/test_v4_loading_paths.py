"""The V4 drafter on two loading/serving paths of vLLM's own V4 drafter (``nvidia/mtp.py``).

* Shard skipping: vLLM's loader does not read safetensors shards in which every tensor is one the
  model declares unused (``is_unused_checkpoint_weight``); for a drafter, the target's shards.
* Sequence parallelism (EP with TP > 1 and DP > 1 or a mega-MoE backend): each rank projects only
  its token shard, and the MoE's padding mask is sharded alike. Run here on our layer with the
  CPU V4 block (bf16) and a faked TP world of 2 (rank 1) in vLLM's ``sequence_parallel`` ops; the
  in-tree order is read from vLLM's source, since its fused input kernel needs CUDA.
"""

import importlib.util
from pathlib import Path

import pytest
import torch
from support.tp_groups import tp_rank_functions
from support.drafters import (
    build_drafter,
    checkpoint_tensors,
)

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

HC, H = 4, 256


def test_only_the_mtp_tensors_are_used(v4_drafter):
    unused = v4_drafter.is_unused_checkpoint_weight
    assert not unused("mtp.0.enorm.weight") and not unused("mtp.0.ffn.experts.7.w2.scale")
    for name in ("embed.weight", "head.weight", "norm.weight", "hc_head_fn",
                 "layers.0.attn.wq_a.weight", "layers.1.ffn.experts.3.w1.weight",
                 "mtp.1.enorm.weight"):  # the config declares one MTP layer
        assert unused(name), name


def test_vllms_loader_skips_the_targets_shards_and_the_rest_loads_completely(
        v4_config, v4_bf16_dir, tmp_path):
    from safetensors.torch import save_file
    from vllm.model_executor.model_loader.weight_utils import (
        filter_safetensors_files_by_weight_name,
        safetensors_weights_iterator,
    )

    tensors = checkpoint_tensors(v4_bf16_dir)
    target, mtp = (tmp_path / f"model-0000{i}-of-00002.safetensors" for i in (1, 2))
    save_file({n: t for n, t in tensors.items() if not n.startswith("mtp.")}, str(target))
    save_file({n: t for n, t in tensors.items() if n.startswith("mtp.")}, str(mtp))
    drafter = build_drafter(v4_config)
    kept = filter_safetensors_files_by_weight_name([str(target), str(mtp)],
                                                   drafter.is_unused_checkpoint_weight)
    assert kept == [str(mtp)]
    assert drafter.load_weights(safetensors_weights_iterator(kept, False)) == \
        {n for n, _ in drafter.named_parameters()}


def test_vllms_v4_drafter_shards_its_inputs_before_the_projections():
    """The order this drafter follows, as vLLM 0.32's V4 MTP layer writes it."""
    source = Path(importlib.util.find_spec("vllm.models.deepseek_v4.nvidia.mtp").origin).read_text()
    forward = source[source.index("class DeepSeekV4MultiTokenPredictorLayer"):
                     source.index("class DeepSeekV4MultiTokenPredictor(")]
    order = [forward.index(step) for step in (
        "forward_context.is_padding = sp_padding_mask(", "inputs_embeds = sp_shard(inputs_embeds)",
        "previous_hidden_states = sp_shard(previous_hidden_states)", "self.h_proj(")]
    assert order == sorted(order)


def test_sequence_parallel_rank_projects_only_its_token_shard(v4_drafter, v4_config, monkeypatch):
    import vllm.models.common.ops.sequence_parallel as sp
    from vllm.forward_context import get_forward_context, set_forward_context

    layer = v4_drafter.model.layer_for_step(0)
    g = torch.Generator().manual_seed(0)
    positions = torch.arange(3)
    hidden = torch.randn(3, HC * H, generator=g).to(torch.bfloat16)
    embeds = torch.randn(3, H, generator=g).to(torch.bfloat16)
    full = layer.fuse_inputs(positions, hidden, embeds)

    rows = {}

    def count_rows(name):
        def hook(module, args):
            rows[name] = args[0].shape[0]
        return hook

    hooks = [proj.register_forward_pre_hook(count_rows(n))
             for n, proj in (("e_proj", layer.e_proj), ("h_proj", layer.h_proj))]
    tp_rank_functions(monkeypatch, sp, world_size=2, rank=1)
    monkeypatch.setattr(layer.mtp_block, "use_sequence_parallel", True, raising=False)
    try:
        with set_forward_context(None, v4_config):
            shard = layer.fuse_inputs(positions, hidden, embeds)
            is_padding = get_forward_context().is_padding
    finally:
        for hook in hooks:
            hook.remove()
    # 3 tokens over 2 ranks: rank 1 holds token 2 and one padding row, and projects 2 rows only.
    assert rows == {"e_proj": 2, "h_proj": 2 * HC}
    assert torch.equal(shard, sp.sp_shard(full)) and not shard[1].any()
    assert is_padding.tolist() == [False, True]
