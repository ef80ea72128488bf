"""Checkpoint names -> parameter names, as data (the loading itself is ``loader.py``).

A checkpoint format is a ``WeightMap``: ordered regex rules (``regex`` package) that rename a tensor,
mark it stacked into a fused parameter (shard id) or into a fused-MoE expert slot, or skip it because
the draft shares it with the target. The tables (``v3.py``, ``v4.py``) take the tensors an MTP layer
has from ``layers.py``; nothing here touches a tensor, so the rules are tested on name lists alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import regex as re


@dataclasses.dataclass(frozen=True)
class Rule:
    """``pattern`` -> ``replacement`` (``regex`` syntax, ``\\g<name>`` groups allowed).

    ``shard``: the shard id for a stacked parameter (``0``/``1``) or an expert's ``"w1"/"w2"/"w3"``.
    ``expert``: name of the group holding the expert index (the target is a fused-MoE parameter).
    ``optional``: apply only when the renamed parameter exists (e.g. a fusion that is off).
    ``transform``: ``f(tensor, param) -> tensor`` applied before loading (e.g. a dtype view).
    ``fused_shared``: the tensor holds the layer's shared experts and the target is a fused-MoE
    parameter: it goes to the expert slots after the routed ones (ROCm AITER, ``weights.experts``).
    """

    pattern: str
    replacement: str = ""
    shard: int | str | None = None
    expert: str | None = None
    optional: bool = False
    transform: Callable | None = None
    fused_shared: bool = False

    def __post_init__(self):
        object.__setattr__(self, "_regex", re.compile(self.pattern))

    def search(self, name: str):
        return self._regex.search(name)


@dataclasses.dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes."""

    param: str
    shard: int | str | None = None
    expert_id: int | None = None
    transform: Callable | None = None
    fused_shared: bool = False


@dataclasses.dataclass(frozen=True)
class WeightMap:
    """A checkpoint format: how to find MTP layers and how to rename their tensors.

    ``layer_index``: regex with a group ``idx`` (the layer number as the checkpoint writes it).
    ``layer_offset``: added to ``idx`` to get the absolute layer index (V4 numbers ``mtp.{j}`` from 0).
    ``shared``: tensors the draft takes from the target (embedding, head copies): not loaded.
    ``prefix_rules``: the first match rewrites the layer prefix (own tensors vs decoder block);
    ``{layer}`` in a replacement is the absolute layer index.
    ``renames``: applied after the prefix, every one that matches, in order (suffixes, module
    names that differ from vLLM's); their ``transform``s apply too.
    ``rules``: tried in order after the renames; the first that matches decides (stack/expert).
    ``fallbacks``: rules for a tensor whose parameter (by ``rules``) this drafter does not have,
    tried like ``rules`` but only into parameters that exist (e.g. a module vLLM fused elsewhere).
    ``to_checkpoint``: (pattern, replacement) pairs turning a parameter name back into the
    checkpoint name a user would look for, for error messages.
    """

    name: str
    layer_index: str
    layer_offset: int
    prefix_rules: Sequence[Rule]
    rules: Sequence[Rule]
    renames: Sequence[Rule] = ()
    fallbacks: Sequence[Rule] = ()
    shared: Sequence[str] = ()
    drop: Sequence[str] = ()
    to_checkpoint: Sequence[tuple[str, str]] = ()

    def mtp_layer(self, ckpt_name: str) -> int | None:
        m = re.match(self.layer_index, ckpt_name)
        return None if m is None else int(m.group("idx")) + self.layer_offset

    def resolve(self, ckpt_name: str, has_param: Callable[[str], bool]) -> Target | None:
        """The target of an MTP-layer tensor, or ``None`` when it is skipped."""
        if any(re.search(pattern, ckpt_name) for pattern in (*self.drop, *self.shared)):
            return None
        name, transform = self._renamed(ckpt_name)
        return self._first_match(self.rules, name, transform, has_param) or Target(
            name, transform=transform)

    def fallback(self, ckpt_name: str, has_param: Callable[[str], bool]) -> Target | None:
        """Where a tensor goes whose ``resolve`` target the drafter lacks (``fallbacks``), if
        anywhere."""
        name, transform = self._renamed(ckpt_name)
        return self._first_match(self.fallbacks, name, transform, has_param, exists=True)

    def _renamed(self, ckpt_name: str) -> tuple[str, Callable | None]:
        name = ckpt_name
        for rule in self.prefix_rules:
            if rule.search(name):
                name = rule._regex.sub(self._expand_layer(rule.replacement, name), name, count=1)
                break
        transform = None
        for rule in self.renames:
            if rule.search(name):
                name = rule._regex.sub(rule.replacement, name)
                transform = rule.transform or transform
        return name, transform

    @staticmethod
    def _first_match(rules, name, transform, has_param, exists=False) -> Target | None:
        for rule in rules:
            m = rule.search(name)
            if m is None:
                continue
            mapped = rule._regex.sub(rule.replacement, name, count=1)
            if (rule.optional or exists) and not has_param(mapped):
                continue
            expert_id = int(m.group(rule.expert)) if rule.expert else None
            return Target(mapped, rule.shard, expert_id, rule.transform or transform,
                          rule.fused_shared)
        return None

    def is_unused(self, ckpt_name: str, mtp_layers: Sequence[int]) -> bool:
        """A checkpoint tensor outside the drafter's MTP layers (the target's, or a layer this
        config does not use). vLLM's loader skips shards holding only such tensors when a model
        answers ``is_unused_checkpoint_weight``."""
        return self.mtp_layer(ckpt_name) not in mtp_layers

    def _expand_layer(self, replacement: str, name: str) -> str:
        layer = self.mtp_layer(name)
        return replacement.replace("{layer}", str(layer))

    def checkpoint_name(self, param_name: str) -> str:
        for pattern, replacement in self.to_checkpoint:
            param_name = re.sub(pattern, replacement, param_name)
        return param_name


def expert_rules(gate: str, up: str, down: str, params: dict[str, str]) -> tuple[Rule, ...]:
    """Routed experts ``experts.{e}.{gate|up|down}.`` -> vLLM's fused-MoE tensors.

    ``params`` maps ``gate_proj``/``up_proj``/``down_proj`` to vLLM's parameter prefixes
    (``platform.fused_moe_expert_params``): w13 holds gate (shard w1) and up (w3), w2 holds down.
    """
    return tuple(
        Rule(rf"\.experts\.(?P<e>\d+)\.{re.escape(ckpt)}\.", f".{params[hf]}", shard, "e")
        for ckpt, hf, shard in ((gate, "gate_proj", "w1"), (up, "up_proj", "w3"),
                                (down, "down_proj", "w2"))
    )
