"""``DeepSeekMultiTokenPredictor``: one drafter for every DeepSeek MTP layer variant.

The variants (V3: ``eh_proj`` over ``cat(enorm(e), hnorm(h))``; V4: ``e_proj``/``h_proj`` and
``hc_head``) differ only inside one layer, so a subclass names its ``layer_cls`` and its checkpoint
``weight_map`` and inherits the rest: layers keyed by absolute index, step -> layer, the
target-shared embedding and head, and ``load_weights`` with its completeness checks.

Memory: the draft allocates no vocab-sized matrix; the host attaches the target's embedding and
head after loading, and the in-tree class instead allocates, loads and then drops its own copies.
Hosts attach the head in three ways, all served (``has_own_lm_head = False`` says "share mine"):

* vLLM's V1 proposer (``v1/spec_decode/llm_base_proposer.py: _maybe_share_lm_head``) sets
  ``self.lm_head`` and replaces every layer's ``shared_head.head``;
* vLLM's Model Runner V2 (``v1/worker/gpu/spec_decode/eagle/utils.py: load_eagle_model``) does the
  same through ``_should_share``;
* vllm-ascend's proposer (``vllm_ascend/spec_decode/llm_base_proposer.py: _maybe_share_lm_head``,
  MTP branch) assigns ``layer.shared_head.head`` only and never sets ``self.lm_head``.

``compute_logits`` uses whatever was attached: the step's ``shared_head.head``, else ``lm_head``.
The embedding is attached as ``self.model.embed_tokens`` by all three, except with pipeline
parallelism (vLLM) or for V4 (vllm-ascend); the first is refused at construction.
"""


from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.models.utils import maybe_prefix
from vllm.sequence import IntermediateTensors

from .. import recording
from ..weights.loader import load_mtp_weights
from ..weights.rules import WeightMap

logger = init_logger("vllm.vllm_mtp_plugin")


def draft_hf_config(vllm_config: VllmConfig):
    """The drafter's hf_config: vLLM hands every drafter the *target's* VllmConfig."""
    spec = vllm_config.speculative_config
    if spec is None or spec.draft_model_config is None:
        raise ValueError(
            "DeepSeek MTP drafters are built by vLLM's speculative decoding: pass "
            "--speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 1}'."
        )
    return spec.draft_model_config.hf_config


class UnattachedHead(nn.Module):
    """The empty ``shared_head.head`` slot: no weights until a host attaches the target's head.

    On a platform whose proposer compares a copy before attaching (vllm-ascend), the layer holds a
    loaded copy instead (``SharedHeadNorm``); any other host that asks the empty slot for its
    ``weight`` gets an AttributeError saying why.
    """

    def __getattr__(self, name: str):
        if name == "weight":
            raise AttributeError(
                "vllm-mtp-plugin's MTP drafter keeps no copy of the output head "
                "(shared_head.head is empty until the host attaches the target's lm_head; it says "
                "so with has_own_lm_head = False). This host compares the copy before sharing: "
                "set MTP_PLUGIN=off to draft with the platform's own MTP class."
            )
        return super().__getattr__(name)


def refuse_pipeline_parallelism(vllm_config: VllmConfig) -> None:
    """Stop at start-up under pipeline parallelism, not at the first request.

    vLLM's proposers share the target's embedding and head only when the pipeline has one stage
    (``get_pp_group().world_size == 1``; the draft then runs on the last stage, away from the
    target's embedding), and expect a drafter that loads its own copies there. This one keeps none.
    """
    stages = getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1)
    if stages > 1:
        raise NotImplementedError(
            f"vllm-mtp-plugin's DeepSeek MTP drafter does not run with pipeline parallelism "
            f"(pipeline_parallel_size={stages}): vLLM shares the target's embedding and head with "
            "a drafter only on a single pipeline stage, and this drafter keeps no copy of its own. "
            "Serve with --pipeline-parallel-size 1 (tensor parallelism works), or set "
            "MTP_PLUGIN=off to draft with vLLM's own class, which loads its own copies."
        )


class SharedHeadNorm(nn.Module):
    """``shared_head`` of the checkpoint: its ``norm``, and a ``head`` slot for the target's head.

    ``head`` stays an ``UnattachedHead`` (no parameters) until a host assigns the target's
    ``lm_head`` to it; the checkpoint's copy of the head is not loaded. Only where the host
    compares a copy with the target's head before attaching it (``platform.
    host_compares_head_copies``) does the layer pass ``head_copy``, loaded from the checkpoint and
    replaced (so freed) by the host, as vLLM's own class does everywhere.
    """

    def __init__(self, hidden_size: int, eps: float, head_copy: nn.Module | None = None):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps=eps)
        self.head: nn.Module = head_copy if head_copy is not None else UnattachedHead()

    def attached_head(self) -> nn.Module | None:
        head = getattr(self, "head", None)
        return None if head is None or isinstance(head, UnattachedHead) else head

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden_states)


class MTPLayerStack(nn.Module):
    """The MTP layers, keyed by absolute layer index (``num_hidden_layers + j``) as in checkpoints.

    ``embed_tokens`` is the target's embedding, attached by vLLM's proposer after loading.
    """

    embed_tokens: nn.Module

    def __init__(self, vllm_config: VllmConfig, layer_cls: type[nn.Module], prefix: str):
        super().__init__()
        config = draft_hf_config(vllm_config)
        self.mtp_start_layer_idx = config.num_hidden_layers
        self.num_mtp_layers = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
        if self.num_mtp_layers < 1:
            raise ValueError(
                f"{getattr(config, 'name_or_path', 'the checkpoint')}: config.json declares no MTP "
                "layer (num_nextn_predict_layers is 0 or missing), so it has no drafter to serve. "
                "Use a checkpoint with MTP layers, or serve without --speculative-config."
            )
        self.layers = nn.ModuleDict({
            str(idx): layer_cls(vllm_config=vllm_config, prefix=f"{prefix}.layers.{idx}")
            for idx in self.layer_indices()
        })

    def layer_indices(self) -> range:
        return range(self.mtp_start_layer_idx, self.mtp_start_layer_idx + self.num_mtp_layers)

    def layer_for_step(self, spec_step_idx: int) -> nn.Module:
        """Draft step ``s`` runs MTP layer ``s % num_mtp_layers`` (one layer reused when fewer)."""
        return self.layers[str(self.mtp_start_layer_idx + spec_step_idx % self.num_mtp_layers)]

    def shared_embedding(self) -> nn.Module:
        embed = getattr(self, "embed_tokens", None)
        if embed is None:
            raise RuntimeError(
                "the MTP drafter has no embedding: the host attaches the target's embedding after "
                "loading, and this one did not (vllm-ascend does not for DeepSeek-V4). Set "
                "MTP_PLUGIN=off to draft with the platform's own MTP class."
            )
        return embed


def warn_if_block_verification_ignored(vllm_config: VllmConfig) -> bool:
    """Say at start-up what vLLM 0.32's V1 runner does silently with block verification.

    Its rejection sampler has no block mode (``v1/sample/rejection_sampler.py``), so
    ``rejection_sample_method: "block"`` verifies as "standard"; and its proposer keeps draft
    probabilities only for "standard" (``v1/spec_decode/llm_base_proposer.py``,
    ``_enable_probabilistic_draft_probs``), so "probabilistic" drafts become argmax drafts too:
    acceptance at temperature > 0 falls to greedy drafting's. Model Runner V2 (vLLM's GPU
    default) has both. Returns whether it warned."""
    spec = vllm_config.speculative_config
    if spec is None or getattr(spec, "rejection_sample_method", "standard") != "block":
        return False
    if vllm_config.use_v2_model_runner:
        return False
    drafts = getattr(spec, "draft_sample_method", "greedy")
    logger.warning(
        "vllm-mtp-plugin: rejection_sample_method \"block\" is ignored by vLLM's V1 model runner "
        "(it has no block verification): drafts are verified the standard way%s. Drop "
        "rejection_sample_method%s, or serve on Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1, "
        "GPUs), which verifies blocks.",
        " and drafted greedily although draft_sample_method is \"probabilistic\""
        if drafts == "probabilistic" else "",
        " to keep probabilistic drafts" if drafts == "probabilistic" else "")
    return True


class DeepSeekMultiTokenPredictor(nn.Module):
    """The drafter vLLM builds for ``method: "mtp"``; subclasses pick the layer variant.

    A layer implements ``forward(positions, previous_hidden_states, inputs_embeds)`` and
    ``logits_input(hidden_states)`` (what goes into the shared head), and may expose
    ``moe_block()`` for vLLM's expert-parallel bookkeeping.
    """

    layer_cls: type[nn.Module]
    variant: str
    # "Share the target's head": vLLM V1 and V2 read it and also replace each layer's
    # shared_head.head. vllm-ascend's MTP path does not read it: it compares a loaded copy first
    # (see platform.host_compares_head_copies). No has_own_embed_tokens on purpose: V1 then
    # treats the drafter as MTP and attaches the embedding without comparing.
    has_own_lm_head = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        refuse_pipeline_parallelism(vllm_config)
        warn_if_block_verification_ignored(vllm_config)
        self.config = draft_hf_config(vllm_config)
        self.vllm_config = vllm_config
        self.model = MTPLayerStack(vllm_config, self.layer_cls, prefix=maybe_prefix(prefix, "model"))
        self.logits_processor = LogitsProcessor(self.config.vocab_size)

    def weight_map(self) -> WeightMap:
        raise NotImplementedError

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.shared_embedding()(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        spec_step_idx: int = 0,
    ) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        hidden_states = self.prepare_hidden_states(hidden_states)
        layer = self.model.layer_for_step(spec_step_idx)
        output = layer(positions, hidden_states, inputs_embeds)
        if spec_step_idx == 0 and recording.active():  # data for ``vllm-mtp train``
            recording.record(input_ids, positions, hidden_states,
                             output[-1] if isinstance(output, tuple) else output)
        return output

    def prepare_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """What a variant does to the target's hidden state before any layer sees it (V3's
        checkpoint rotation, ``rot``); nothing here."""
        return hidden_states

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0):
        layer = self.model.layer_for_step(spec_step_idx)
        return self.logits_processor(self.shared_lm_head(layer), layer.logits_input(hidden_states))

    def shared_lm_head(self, layer: nn.Module) -> nn.Module:
        """The head a host attached: ``layer.shared_head.head`` (vllm-ascend sets only that),
        else ``self.lm_head``."""
        head = layer.shared_head.attached_head() or getattr(self, "lm_head", None)
        if head is None:
            raise RuntimeError(
                "the MTP drafter has no output head: the host attaches the target's lm_head (as "
                "lm_head or shared_head.head) after loading, and this one did not. Set "
                "MTP_PLUGIN=off to draft with the platform's own MTP class."
            )
        return head

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        draft = self.vllm_config.speculative_config.draft_model_config
        loaded = load_mtp_weights(
            self.weight_map(),
            weights,
            dict(self.named_parameters()),
            mtp_layers=list(self.model.layer_indices()),
            num_experts=int(getattr(self.config, "n_routed_experts", 0) or 0),
            model_dir=getattr(self, "loading_from", None) or getattr(draft, "model", None),
            checkpoint_hint=self.checkpoint_hint,
        )
        if not getattr(self, "_announced", False):
            self._announced = True
            logger.info("%s", self.announcement(len(loaded)))
        return loaded

    def announcement(self, num_loaded: int) -> str:
        """The line the engine log shows where vLLM built this drafter (``register()`` runs before
        vLLM configures logging, so only a line from here reaches a real server log)."""
        from vllm.distributed import get_tensor_model_parallel_world_size

        from ..identity import ARCHITECTURES, VERSION

        arch = next((a for a, target in ARCHITECTURES.items()
                     if target == f"{type(self).__module__}:{type(self).__name__}"), "?")
        layers = list(self.model.layer_indices())
        dtype = self.vllm_config.model_config.dtype
        rows = -(-self.config.vocab_size // get_tensor_model_parallel_world_size())
        matrix = rows * self.config.hidden_size * torch.empty((), dtype=dtype).element_size()
        copies = sum(layer.shared_head.attached_head() is not None
                     for layer in self.model.layers.values())
        saved = matrix * (1 + len(layers) - copies)
        kept = (f"; {copies} shared_head.head copy(ies) loaded for the host to compare and replace"
                if copies else "")
        return (
            f"vllm-mtp-plugin {VERSION}: {type(self).__name__} ({self.variant} MTP layer) serves "
            f"{arch}; MTP layer(s) {', '.join(map(str, layers))} loaded ({num_loaded} parameters); "
            f"the target's embedding and head are shared: {saved / 2**20:.1f} MiB not allocated "
            f"(embed_tokens + {len(layers) - copies} shared_head.head, {rows} x {self.config.hidden_size} "
            f"{str(dtype).removeprefix('torch.')} each, this rank){kept}"
        )

    def is_unused_checkpoint_weight(self, name: str) -> bool:
        """vLLM's loader does not read safetensors shards in which every tensor is unused
        (``weight_utils.filter_safetensors_files_by_weight_name``): the drafter reads only the
        shards that hold its MTP layers instead of the whole checkpoint again (vLLM's own V4
        drafter does the same; its V3 drafter reads every shard)."""
        if getattr(self, "_unused_filter", None) is None:
            self._unused_filter = (self.weight_map(), tuple(self.model.layer_indices()))
        weight_map, layers = self._unused_filter
        return weight_map.is_unused(name, layers)

    def checkpoint_hint(self, layer: int, report) -> str | None:
        """A variant may recognise a checkpoint that stores another drafter format."""
        return None
