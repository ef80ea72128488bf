"""Small DeepSeek-V3-layout checkpoints (HF names, MLA + MoE, MTP layers) built on the spot.

Three modes decide what the MTP layers know:

* ``random``: every tensor random; the drafter guesses (acceptance near zero).
* ``oracle``: the target's greedy next token depends only on the current token (its blocks add a
  small residual to the embedding, and ``lm_head`` rows are the embeddings of a permutation), and the
  MTP layer's ``eh_proj`` passes the token embedding through, so the drafter predicts exactly what the
  target will emit: acceptance is 100 % by construction, at every draft position.
* ``noisy``: the oracle plus ``alpha * R @ hnorm(h)`` mixed in by ``eh_proj``; ``alpha`` is solved so
  that the first-position acceptance is ``acceptance`` (measured on the real tensors, see
  ``calibrate_noise``).

Every RMSNorm weight is a random gain (not 1) and every router's ``e_score_correction_bias`` random
(not 0), so that a loader that swaps ``enorm``/``hnorm`` or drops the router bias computes something
else than the real drafter. The oracle and noisy modes stay exact: ``eh_proj`` divides the enorm and
hnorm gains out again, and the target's final norm shares its gain with every ``shared_head.norm``
(the head rows divide it out), so the argmax the construction relies on does not move.

The CPU MLA kernels need ``kv_lora_rank=512`` and ``qk_rope_head_dim=64``; every preset keeps them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from . import CONSTRUCTED_MODES
from .tokenizer import SPECIAL_TOKENS, write_tokenizer

MODES = CONSTRUCTED_MODES
RESIDUAL_SCALE = 0.02  # weight std of the projections that write into the residual stream (oracle)
# RMSNorm weights are drawn uniformly from this range: far enough from 1 that a swapped norm shows.
NORM_GAIN_RANGE = (0.5, 1.5)
# Std of the router's e_score_correction_bias: comparable to the spread of the sigmoid scores, so
# dropping it changes which experts a token picks.
ROUTER_BIAS_STD = 0.1


@dataclasses.dataclass(frozen=True)
class TinyArch:
    """Shape of a tiny DeepSeek-V3 checkpoint. Layers below ``first_k_dense_replace`` are dense."""

    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 512
    moe_intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_nextn_predict_layers: int = 1
    num_attention_heads: int = 4
    q_lora_rank: int | None = 128
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    n_routed_experts: int = 4
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    first_k_dense_replace: int = 1
    max_position_embeddings: int = 2048


PRESETS: dict[str, TinyArch] = {
    # ~5 M parameters: tests and the demo.
    "tiny": TinyArch(),
    # ~70 M: dense main layers, MoE MTP layer.
    "small": TinyArch(
        hidden_size=1024, intermediate_size=2816, moe_intermediate_size=704, num_hidden_layers=4,
        num_attention_heads=16, q_lora_rank=None, qk_nope_head_dim=64, v_head_dim=64,
        n_routed_experts=8, first_k_dense_replace=4,
    ),
    # ~400 M: where speculation pays off on a 2-core CPU (forward cost dominates scheduling).
    "bench": TinyArch(
        hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408, num_hidden_layers=8,
        num_attention_heads=16, q_lora_rank=None, qk_nope_head_dim=64, v_head_dim=64,
        n_routed_experts=8, first_k_dense_replace=8,
    ),
    # ~800 M: the bench shape with twice the layers, to show the trend with size.
    "large": TinyArch(
        hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408, num_hidden_layers=16,
        num_attention_heads=16, q_lora_rank=None, qk_nope_head_dim=64, v_head_dim=64,
        n_routed_experts=8, first_k_dense_replace=16,
    ),
}


def hf_config(arch: TinyArch, dtype: str) -> dict:
    """The config.json of a DeepSeek-V3 checkpoint with this shape."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "moe_intermediate_size": arch.moe_intermediate_size,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_nextn_predict_layers": arch.num_nextn_predict_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_attention_heads,
        "q_lora_rank": arch.q_lora_rank,
        "kv_lora_rank": arch.kv_lora_rank,
        "qk_rope_head_dim": arch.qk_rope_head_dim,
        "qk_nope_head_dim": arch.qk_nope_head_dim,
        "v_head_dim": arch.v_head_dim,
        "n_routed_experts": arch.n_routed_experts,
        "n_shared_experts": arch.n_shared_experts,
        "num_experts_per_tok": arch.num_experts_per_tok,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": arch.first_k_dense_replace,
        "moe_layer_freq": 1,
        "hidden_act": "silu",
        "max_position_embeddings": arch.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


class _Init:
    """Seeded tensor factory; ``small`` tensors write into the residual stream."""

    def __init__(self, seed: int, small_scale: float):
        self.gen = torch.Generator().manual_seed(seed)
        self.small_scale = small_scale

    def normal(self, *shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen) * std

    def small(self, *shape: int) -> torch.Tensor:
        return self.normal(*shape, std=self.small_scale)

    def gain(self, n: int) -> torch.Tensor:
        """An RMSNorm weight: uniform in ``NORM_GAIN_RANGE``."""
        lo, hi = NORM_GAIN_RANGE
        return lo + (hi - lo) * torch.rand(n, generator=self.gen)


def block_tensors(arch: TinyArch, prefix: str, moe: bool, init: _Init) -> dict[str, torch.Tensor]:
    """One DeepSeek decoder block (MLA attention + dense MLP or MoE) under HF names."""
    h, heads = arch.hidden_size, arch.num_attention_heads
    qk_head = arch.qk_nope_head_dim + arch.qk_rope_head_dim
    t = {
        f"{prefix}.input_layernorm.weight": init.gain(h),
        f"{prefix}.post_attention_layernorm.weight": init.gain(h),
        f"{prefix}.self_attn.kv_a_proj_with_mqa.weight": init.normal(
            arch.kv_lora_rank + arch.qk_rope_head_dim, h
        ),
        f"{prefix}.self_attn.kv_a_layernorm.weight": init.gain(arch.kv_lora_rank),
        f"{prefix}.self_attn.kv_b_proj.weight": init.normal(
            heads * (arch.qk_nope_head_dim + arch.v_head_dim), arch.kv_lora_rank
        ),
        f"{prefix}.self_attn.o_proj.weight": init.small(h, heads * arch.v_head_dim),
    }
    if arch.q_lora_rank:
        t[f"{prefix}.self_attn.q_a_proj.weight"] = init.normal(arch.q_lora_rank, h)
        t[f"{prefix}.self_attn.q_a_layernorm.weight"] = init.gain(arch.q_lora_rank)
        t[f"{prefix}.self_attn.q_b_proj.weight"] = init.normal(heads * qk_head, arch.q_lora_rank)
    else:
        t[f"{prefix}.self_attn.q_proj.weight"] = init.normal(heads * qk_head, h)

    def mlp(p: str, inter: int) -> None:
        t[f"{p}.gate_proj.weight"] = init.normal(inter, h)
        t[f"{p}.up_proj.weight"] = init.normal(inter, h)
        t[f"{p}.down_proj.weight"] = init.small(h, inter)

    if not moe:
        mlp(f"{prefix}.mlp", arch.intermediate_size)
        return t
    t[f"{prefix}.mlp.gate.weight"] = init.normal(arch.n_routed_experts, h)
    t[f"{prefix}.mlp.gate.e_score_correction_bias"] = init.normal(arch.n_routed_experts,
                                                                  std=ROUTER_BIAS_STD)
    for e in range(arch.n_routed_experts):
        mlp(f"{prefix}.mlp.experts.{e}", arch.moe_intermediate_size)
    if arch.n_shared_experts:
        mlp(f"{prefix}.mlp.shared_experts", arch.moe_intermediate_size * arch.n_shared_experts)
    return t


def successor_permutation(arch: TinyArch, gen: torch.Generator) -> torch.Tensor:
    """``succ[t]``: the token an oracle target emits after ``t``. Never a special token."""
    n_special = len(SPECIAL_TOKENS)
    regular = torch.arange(n_special, arch.vocab_size)
    succ = torch.empty(arch.vocab_size, dtype=torch.long)
    succ[regular] = regular[torch.randperm(len(regular), generator=gen)]
    succ[:n_special] = succ[regular[:n_special]]
    return succ


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def oracle_embedding_and_head(arch: TinyArch, gen: torch.Generator,
                              final_gain: torch.Tensor | None = None):
    """Embedding ``E`` and head ``W`` with ``argmax(W @ (g * rms(E[t]))) == succ[t]`` by a wide margin.

    ``g`` is ``final_gain`` (the final RMSNorm's weight; all ones if None): the head rows divide it
    out, so the logit of the right token is ``rms(E[t]) . rms(E[t]) / sqrt(H)`` whatever the gain.
    """
    n_special = len(SPECIAL_TOKENS)
    succ = successor_permutation(arch, gen)
    embed = torch.randn(arch.vocab_size, arch.hidden_size, generator=gen)
    embed[:n_special] = embed[n_special : 2 * n_special]  # specials behave like regular tokens
    head = torch.randn(arch.vocab_size, arch.hidden_size, generator=gen) * 0.01
    regular = torch.arange(n_special, arch.vocab_size)
    rows = _rms(embed[regular]) / arch.hidden_size**0.5
    head[succ[regular]] = rows if final_gain is None else rows / final_gain
    return embed, head, succ


def first_position_acceptance(embed, head, succ, mix: torch.Tensor, alpha: float,
                              final_gain: torch.Tensor | None = None) -> float:
    """Fraction of tokens whose draft ``argmax(W (g * rms(x)))`` is right, where
    ``x = rms(E[t']) + alpha * mix rms(h)`` and ``h = g * rms(E[t])`` is the target's final hidden
    state (``g``: ``final_gain``, the target's final norm and every ``shared_head.norm``).

    Pairs are (t, t' = succ[t]): the target has just emitted t' after t, the drafter predicts
    what comes after t'. ``eh_proj`` divides the enorm/hnorm gains out; block residuals are small
    and ignored here.
    """
    gain = torch.ones(embed.shape[1]) if final_gain is None else final_gain
    tokens = torch.arange(len(SPECIAL_TOKENS), embed.shape[0])
    nxt = succ[tokens]
    x = _rms(embed[nxt]) + alpha * _rms(gain * _rms(embed[tokens])) @ mix.T
    draft = ((gain * _rms(x)) @ head.T).argmax(-1)
    return (draft == succ[nxt]).float().mean().item()


def calibrate_noise(embed, head, succ, mix, target: float,
                    final_gain: torch.Tensor | None = None) -> float:
    """Bisect ``alpha`` so that the first-position acceptance is ``target``."""
    def acceptance(alpha: float) -> float:
        return first_position_acceptance(embed, head, succ, mix, alpha, final_gain)

    lo, hi = 0.0, 1.0
    while acceptance(hi) > target and hi < 1e3:
        hi *= 2
    for _ in range(40):
        mid = (lo + hi) / 2
        if acceptance(mid) > target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def build_tensors(arch: TinyArch, mode: str, seed: int, acceptance: float):
    """All checkpoint tensors plus a metadata dict (mode, noise alpha, expected acceptance)."""
    if mode not in MODES:
        raise ValueError(f"unknown tiny checkpoint mode {mode!r}; choose one of {MODES}")
    gen = torch.Generator().manual_seed(seed)
    h = arch.hidden_size
    init = _Init(seed + 1, RESIDUAL_SCALE if mode != "random" else 0.02)
    gains = _Init(seed + 2, 0.0)  # the final norm and the MTP layers' own norms
    meta: dict = {"mode": mode, "seed": seed}
    final_gain = gains.gain(h)
    mtp_gains = [(gains.gain(h), gains.gain(h)) for _ in range(arch.num_nextn_predict_layers)]
    if mode == "random":
        embed, head = init.normal(arch.vocab_size, h), init.normal(arch.vocab_size, h)
        eh_proj = init.normal(h, 2 * h)
        eh_projs = [eh_proj.clone() for _ in mtp_gains]
        head_gains = [gains.gain(h) for _ in mtp_gains]
    else:
        embed, head, succ = oracle_embedding_and_head(arch, gen, final_gain)
        mix = torch.randn(h, h, generator=gen) / h**0.5
        alpha = 0.0
        if mode == "noisy":
            alpha = calibrate_noise(embed, head, succ, mix, acceptance, final_gain)
        meta.update(alpha=alpha, expected_acceptance=first_position_acceptance(
            embed, head, succ, mix, alpha, final_gain))
        # eh_proj(cat(g_e * rms(e), g_h * rms(h))) = rms(e) + alpha * mix @ rms(h): gains divided out.
        eh_projs = [torch.cat([torch.diag(1 / g_e), alpha * mix / g_h], dim=1)
                    for g_e, g_h in mtp_gains]
        head_gains = [final_gain for _ in mtp_gains]  # what the target's head was built for

    tensors = {"model.embed_tokens.weight": embed, "model.norm.weight": final_gain,
               "lm_head.weight": head}
    for i in range(arch.num_hidden_layers):
        moe = i >= arch.first_k_dense_replace
        tensors.update(block_tensors(arch, f"model.layers.{i}", moe, init))
    for j in range(arch.num_nextn_predict_layers):
        p = f"model.layers.{arch.num_hidden_layers + j}"
        tensors.update(block_tensors(arch, p, True, init))
        tensors.update({
            f"{p}.enorm.weight": mtp_gains[j][0].clone(),
            f"{p}.hnorm.weight": mtp_gains[j][1].clone(),
            f"{p}.eh_proj.weight": eh_projs[j],
            f"{p}.shared_head.norm.weight": head_gains[j].clone(),
            f"{p}.shared_head.head.weight": head.clone(),
            f"{p}.embed_tokens.weight": embed.clone(),
        })
    return tensors, meta


def build_checkpoint(out_dir: str | Path, preset: str | TinyArch = "tiny", mode: str = "oracle",
                     seed: int = 0, acceptance: float = 0.7, dtype: str = "float32",
                     **overrides) -> Path:
    """Write config.json, tokenizer files, model.safetensors and tiny_meta.json into ``out_dir``.

    ``overrides`` replace fields of the preset (e.g. ``num_nextn_predict_layers=2``).
    """
    from safetensors.torch import save_file

    arch = PRESETS[preset] if isinstance(preset, str) else preset
    arch = dataclasses.replace(arch, **overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors, meta = build_tensors(arch, mode, seed, acceptance)
    torch_dtype = getattr(torch, dtype)
    # Router bias stays fp32, as in DeepSeek's releases (vLLM allocates it in fp32).
    tensors = {k: v.contiguous() if k.endswith("e_score_correction_bias")
               else v.to(torch_dtype).contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(arch, dtype), indent=2))
    write_tokenizer(out, arch.vocab_size)
    meta.update(arch=dataclasses.asdict(arch), dtype=dtype,
                parameters=sum(v.numel() for v in tensors.values()))
    (out / "tiny_meta.json").write_text(json.dumps(meta, indent=2))
    return out
