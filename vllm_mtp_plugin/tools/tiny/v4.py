"""Small DeepSeek-V4 checkpoints in DeepSeek's own naming (``layers.{i}.*``, ``mtp.{j}.*``).

They have the layout of DeepSeek-V4-Flash (``model_type: deepseek_v4``): hyper-connected blocks
(``hc_mult`` residual streams), attention with ``wq_a/wq_b/wkv/wo_a/wo_b`` and ``attn_sink``, MoE
with ``w1/w2/w3`` experts, a gate with ``bias``, and the MTP layer's ``enorm/hnorm/e_proj/h_proj``,
``norm`` and ``hc_head_*``. ``quantization="fp8"`` stores what the released weights store: linears as
``float8_e4m3fn`` with UE8M0 (``float8_e8m0fnu``) 128x128 block ``.scale`` tensors and routed
experts as packed FP4 (``int8``, two values a byte) with 1x32 UE8M0 scales; ``expert_dtype="fp8"``
gives the Flash-Base variant (FP8 block experts, float32 scales everywhere). ``quantization=None``
writes bf16.

Modes (``v3.py`` has the same three for V3):

* ``random``: every tensor random; the drafter guesses.
* ``oracle``: the target's greedy next token depends only on the current one (its blocks add a small
  residual to the embedding; ``head`` rows are embeddings of a permutation) and the MTP layer passes
  the token embedding through ``e_proj``: a working drafter is accepted every time.
* ``noisy``: the oracle plus ``alpha * R`` applied by ``h_proj`` to the target's residual streams
  (which hold the previous token's embedding); ``alpha`` is solved so that the first-position
  acceptance is ``acceptance`` (``v3.calibrate_noise`` on the real embedding and head).

Every norm weight (``norm``, ``enorm``, ``hnorm``, the blocks' ``attn_norm``/``ffn_norm``/``q_norm``/
``kv_norm``) and the ``hc_head_*`` mixers are random too, so that a drafter that swaps ``enorm`` and
``hnorm``, or loads the wrong ``hc_head``, computes something else. The oracle and noisy modes
compensate in linear maps so that the drafts stay what they are built to be (``oracle_projections``);
with equal residual streams (the target's, and the drafter's input fusion) ``hc_head`` is a positive
mix of equal vectors, so its random values change only the scale the final norm removes.

Bad checkpoints for error tests: ``without_mtp=True`` (a target quantized without its ``mtp.*``
tensors) and ``dspark=True`` (a DSpark drafter stored under ``mtp.``: three blocks, ``main_proj``,
``markov_head``, no ``enorm``/``hnorm``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ..checkpoint.quantize import EXPERT, FP8_BLOCK, LINEAR, PLAIN, encode_v4 as encode
from . import CONSTRUCTED_MODES
from .tokenizer import write_tokenizer
from .v3 import calibrate_noise, first_position_acceptance, oracle_embedding_and_head

MODES = CONSTRUCTED_MODES


@dataclasses.dataclass(frozen=True)
class TinyV4Arch:
    """Shape of a tiny DeepSeek-V4 checkpoint (head_dim 512 / rope 64 as the V4 kernels expect)."""

    vocab_size: int = 2048
    hidden_size: int = 256
    num_hidden_layers: int = 2
    num_nextn_predict_layers: int = 1
    num_attention_heads: int = 4
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 128
    o_groups: int = 2
    o_lora_rank: int = 128
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    n_routed_experts: int = 64  # vLLM's CPU router takes 64+ experts, 6 or 8 per token
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 128
    sliding_window: int = 128
    index_n_heads: int = 4
    index_head_dim: int = 128
    index_topk: int = 512
    max_position_embeddings: int = 2048


def hf_config(arch: TinyV4Arch, quantization: str | None, expert_dtype: str) -> dict:
    """config.json of a DeepSeek-V4 checkpoint with this shape (fields as in V4-Flash)."""
    config = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_nextn_predict_layers": arch.num_nextn_predict_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": 1,
        "head_dim": arch.head_dim,
        "qk_rope_head_dim": arch.qk_rope_head_dim,
        "q_lora_rank": arch.q_lora_rank,
        "o_groups": arch.o_groups,
        "o_lora_rank": arch.o_lora_rank,
        "hc_mult": arch.hc_mult,
        "hc_eps": 1e-6,
        "hc_sinkhorn_iters": arch.hc_sinkhorn_iters,
        "n_routed_experts": arch.n_routed_experts,
        "n_shared_experts": arch.n_shared_experts,
        "num_experts_per_tok": arch.num_experts_per_tok,
        "moe_intermediate_size": arch.moe_intermediate_size,
        "num_hash_layers": 0,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "swiglu_limit": 10.0,
        "hidden_act": "silu",
        "sliding_window": arch.sliding_window,
        "index_n_heads": arch.index_n_heads,
        "index_head_dim": arch.index_head_dim,
        "index_topk": arch.index_topk,
        # One entry per main layer plus the MTP layer; 0 = sliding window only.
        "compress_ratios": [0] * (arch.num_hidden_layers + 1),
        "compress_rope_theta": 160000,
        "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 1.0, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": arch.max_position_embeddings},
        "max_position_embeddings": arch.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "expert_dtype": expert_dtype,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    }
    if quantization == "fp8":
        config["quantization_config"] = {
            "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": list(FP8_BLOCK),
            **({"scale_fmt": "ue8m0"} if expert_dtype == "fp4" else {}),
        }
    return config


# ---------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------


class _Init:
    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)

    def normal(self, *shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen) * std

    def positive(self, *shape: int) -> torch.Tensor:
        """Uniform in [0.5, 1.5]: norm weights and mixer scales that differ per channel."""
        return 0.5 + torch.rand(*shape, generator=self.gen)




def block_tensors(arch: TinyV4Arch, p: str, init: _Init, residual_std: float) -> dict:
    """One hyper-connected V4 decoder block: ``{name: (tensor, kind)}``.

    ``residual_std`` is the std of the projections that write into the residual streams
    (``wo_b``, ``w2``): small in oracle mode so that the streams stay close to the embedding.
    """
    h, heads, hd = arch.hidden_size, arch.num_attention_heads, arch.head_dim
    inter, hc = arch.moe_intermediate_size, arch.hc_mult
    mix = (2 + hc) * hc
    t = {
        f"{p}.attn.attn_sink": (init.normal(heads, std=1.0), PLAIN),
        f"{p}.attn.kv_norm.weight": (init.positive(hd), PLAIN),
        f"{p}.attn.q_norm.weight": (init.positive(arch.q_lora_rank), PLAIN),
        f"{p}.attn.wq_a.weight": (init.normal(arch.q_lora_rank, h), LINEAR),
        f"{p}.attn.wq_b.weight": (init.normal(heads * hd, arch.q_lora_rank), LINEAR),
        f"{p}.attn.wkv.weight": (init.normal(hd, h), LINEAR),
        f"{p}.attn.wo_a.weight": (init.normal(arch.o_groups * arch.o_lora_rank,
                                              heads * hd // arch.o_groups), LINEAR),
        f"{p}.attn.wo_b.weight": (init.normal(h, arch.o_groups * arch.o_lora_rank,
                                              std=residual_std), LINEAR),
        f"{p}.attn_norm.weight": (init.positive(h), PLAIN),
        f"{p}.ffn_norm.weight": (init.positive(h), PLAIN),
        f"{p}.ffn.gate.weight": (init.normal(arch.n_routed_experts, h), PLAIN),
        f"{p}.ffn.gate.bias": (torch.zeros(arch.n_routed_experts), PLAIN),
    }
    shared = inter * arch.n_shared_experts
    t[f"{p}.ffn.shared_experts.w1.weight"] = (init.normal(shared, h), LINEAR)
    t[f"{p}.ffn.shared_experts.w3.weight"] = (init.normal(shared, h), LINEAR)
    t[f"{p}.ffn.shared_experts.w2.weight"] = (init.normal(h, shared, std=residual_std), LINEAR)
    for e in range(arch.n_routed_experts):
        t[f"{p}.ffn.experts.{e}.w1.weight"] = (init.normal(inter, h), EXPERT)
        t[f"{p}.ffn.experts.{e}.w3.weight"] = (init.normal(inter, h), EXPERT)
        t[f"{p}.ffn.experts.{e}.w2.weight"] = (init.normal(h, inter, std=residual_std), EXPERT)
    for sub in ("attn", "ffn"):
        t[f"{p}.hc_{sub}_fn"] = (init.normal(mix, hc * h), PLAIN)
        t[f"{p}.hc_{sub}_base"] = (init.normal(mix), PLAIN)
        t[f"{p}.hc_{sub}_scale"] = (torch.ones(3), PLAIN)
    return t


def hc_head_tensors(arch: TinyV4Arch, p: str, init: _Init) -> dict:
    """The head mixer: ``sigmoid(scale * rms(x) @ fn.T + base)`` weighs the streams."""
    hc = arch.hc_mult
    return {
        f"{p}hc_head_fn": (init.normal(hc, hc * arch.hidden_size, std=0.5), PLAIN),
        f"{p}hc_head_base": (init.normal(hc, std=1.0), PLAIN),
        f"{p}hc_head_scale": (init.positive(1), PLAIN),
    }


def dspark_tensors(arch: TinyV4Arch, init: _Init) -> dict:
    """A DSpark drafter under ``mtp.``: three blocks and its own heads, no enorm/hnorm."""
    h = arch.hidden_size
    t = {}
    for stage in range(3):
        t.update(block_tensors(arch, f"mtp.{stage}", init, 0.02))
    t["mtp.0.main_proj.weight"] = (init.normal(h, 2 * h), LINEAR)
    t["mtp.0.main_norm.weight"] = (torch.ones(h), PLAIN)
    t["mtp.2.norm.weight"] = (torch.ones(h), PLAIN)
    t["mtp.2.markov_head.weight"] = (init.normal(16, h), PLAIN)
    t.update(hc_head_tensors(arch, "mtp.2.", init))
    return t


def oracle_projections(norm: torch.Tensor, enorm: torch.Tensor, hnorm: torch.Tensor,
                       mtp_norm: torch.Tensor, noise: torch.Tensor) -> tuple:
    """``e_proj`` and ``h_proj`` that undo the random norm weights.

    With the target's final norm ``g_T`` and a head stored as ``W / g_T`` (columns), the target's
    logits are ``W @ rms(y)``, as in ``v3.py``. The drafter gives the head ``g_M * rms(z)``;
    ``e_proj = diag(g_T / (g_M g_e))`` and ``h_proj = diag(g_T / g_M) @ noise @ diag(1 / g_h)`` make
    ``z = (g_T / g_M) * (rms(e) + noise @ rms(h))``, so (RMSNorm ignoring scale) the drafter's logits
    are ``W @ rms(rms(e) + noise @ rms(h))``: ``v3.first_position_acceptance``'s formula.
    """
    out_scale = norm / mtp_norm
    e_proj = torch.diag(out_scale / enorm)
    h_proj = out_scale[:, None] * noise / hnorm[None, :]
    return e_proj, h_proj


def build_tensors(arch: TinyV4Arch, mode: str, seed: int, *, acceptance: float = 0.7,
                  without_mtp: bool = False, dspark: bool = False,
                  mtp_copies: bool = False) -> tuple[dict, dict]:
    """``{name: (float tensor, kind)}`` before quantization, and metadata."""
    if mode not in MODES:
        raise ValueError(f"unknown tiny V4 checkpoint mode {mode!r}; choose one of {MODES}")
    if mode == "noisy" and not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance {acceptance} of a noisy tiny V4 checkpoint must be in 0..1")
    gen = torch.Generator().manual_seed(seed)
    init = _Init(seed + 1)
    h = arch.hidden_size
    residual_std = 0.02 if mode == "random" else 0.002
    meta: dict = {"mode": mode, "seed": seed, "without_mtp": without_mtp, "dspark": dspark}
    norm = init.positive(h)
    layers = arch.num_nextn_predict_layers
    enorms, hnorms, mtp_norms = ([init.positive(h) for _ in range(layers)] for _ in range(3))
    if mode == "random":
        embed, head = init.normal(arch.vocab_size, h), init.normal(arch.vocab_size, h)
        projections = [(init.normal(h, h), init.normal(h, h)) for _ in range(layers)]
    else:
        embed, head, succ = oracle_embedding_and_head(arch, gen)
        noise = torch.randn(h, h, generator=gen) / h**0.5
        alpha = calibrate_noise(embed, head, succ, noise, acceptance) if mode == "noisy" else 0.0
        meta.update(alpha=alpha, expected_acceptance=first_position_acceptance(
            embed, head, succ, noise, alpha))
        projections = [oracle_projections(norm, enorms[j], hnorms[j], mtp_norms[j], alpha * noise)
                       for j in range(layers)]
        head = head / norm  # the target's norm weight is undone by the head (see above)
    t = {"embed.weight": (embed, PLAIN), "head.weight": (head, PLAIN),
         "norm.weight": (norm, PLAIN), **hc_head_tensors(arch, "", init)}
    for i in range(arch.num_hidden_layers):
        t.update(block_tensors(arch, f"layers.{i}", init, residual_std))
    if dspark:
        t.update(dspark_tensors(arch, init))
    elif not without_mtp:
        for j in range(layers):
            p = f"mtp.{j}"
            t.update(block_tensors(arch, p, init, residual_std))
            t.update(hc_head_tensors(arch, f"{p}.", init))
            e_proj, h_proj = projections[j]
            t.update({
                f"{p}.enorm.weight": (enorms[j], PLAIN),
                f"{p}.hnorm.weight": (hnorms[j], PLAIN),
                f"{p}.e_proj.weight": (e_proj, LINEAR),
                f"{p}.h_proj.weight": (h_proj, LINEAR),
                f"{p}.norm.weight": (mtp_norms[j], PLAIN),
            })
            if mtp_copies:
                t[f"{p}.emb.tok_emb.weight"] = (embed.clone(), PLAIN)
                t[f"{p}.head.weight"] = (head.clone(), PLAIN)
    return t, meta


def build_checkpoint(out_dir: str | Path, mode: str = "oracle", seed: int = 0,
                     quantization: str | None = "fp8", expert_dtype: str = "fp4",
                     acceptance: float = 0.7,
                     without_mtp: bool = False, dspark: bool = False, mtp_copies: bool = False,
                     arch: TinyV4Arch | None = None, **overrides) -> Path:
    """Write config.json, tokenizer files, model.safetensors and tiny_meta.json into ``out_dir``.

    ``acceptance``: the first-position acceptance a ``noisy`` checkpoint is built for.
    ``mtp_copies`` also stores ``mtp.{j}.emb.tok_emb.weight`` / ``mtp.{j}.head.weight`` (some
    exports do; V4-Flash keeps only the top-level ``embed``/``head``).
    """
    from safetensors.torch import save_file

    arch = dataclasses.replace(arch or TinyV4Arch(), **overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Thousands of tiny tensors: one thread. With OpenMP fan-out (and after `import vllm`, whose
    # thread settings make it worse on a busy 2-core machine) the same build takes 15x longer.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tensors, meta = build_tensors(arch, mode, seed, acceptance=acceptance,
                                      without_mtp=without_mtp, dspark=dspark,
                                      mtp_copies=mtp_copies)
        stored = encode(tensors, quantization, expert_dtype)
    finally:
        torch.set_num_threads(threads)
    save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(arch, quantization, expert_dtype),
                                                indent=2))
    write_tokenizer(out, arch.vocab_size)
    meta.update(arch=dataclasses.asdict(arch), quantization=quantization,
                expert_dtype=expert_dtype, tensors=len(stored),
                parameters=sum(v.numel() for v, _ in tensors.values()))
    (out / "tiny_meta.json").write_text(json.dumps(meta, indent=2))
    return out
