"""A copy of everything a drafter computes with, to put back when a layer reload fails part-way.

A reload replaces tensors module by module (vLLM's layerwise reload, then the platform's
repacking), so an error in the middle (a shard that cannot be read, a kernel that rejects a
weight) would leave some modules new and others old: a layer that is neither, served under the
old version's name. ``restored_on_failure`` keeps a host copy of the drafter's own tensors, in
the format its kernels read (packed, absorbed), and the objects each module and its attention
implementation held (tensors, kernel closures); on any error it puts every object back where it
was and copies the old values into the tensors, so the drafter computes exactly what it did
before. What it holds: one copy of the drafter's own tensors (this rank's part; the target's
embedding and head, which a reload detaches first, are not among them), for the length of the
reload.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

# Where an attention layer keeps tensors of its own outside the module tree: its backend
# implementation object (e.g. vLLM's ``AMXMLAImpl._w_uk_packed``).
IMPL_ATTRIBUTE = "impl"


def _implementation(module: nn.Module):
    impl = getattr(module, IMPL_ATTRIBUTE, None)
    return None if impl is None or isinstance(impl, nn.Module) else impl


@dataclasses.dataclass
class ModuleState:
    """One module as it was: its attributes (the objects themselves: a kernel closure vLLM's CPU
    linear layers keep in ``cpu_linear`` holds its own packed weight), its parameters and
    buffers, its backend implementation's attributes, and copies of every tensor's value."""

    module: nn.Module
    attributes: dict
    parameters: dict
    buffers: dict
    non_persistent: set
    impl_attributes: dict
    values: dict  # id(tensor) -> host copy of its value, shared between a drafter's modules

    @classmethod
    def capture(cls, module: nn.Module, values: dict) -> "ModuleState":
        impl = _implementation(module)
        state = cls(module, dict(vars(module)), dict(module._parameters), dict(module._buffers),
                    set(module._non_persistent_buffers_set),
                    dict(vars(impl)) if impl is not None else {}, values)
        for tensor in state.tensors():
            if id(tensor) not in values:  # a tensor two modules hold is copied once
                values[id(tensor)] = tensor.detach().to("cpu", copy=True)
        return state

    def tensors(self):
        for group in (self.parameters, self.buffers, self.impl_attributes):
            yield from (t for t in group.values() if isinstance(t, torch.Tensor))

    def restore(self) -> None:
        module = self.module
        _put_back_attributes(module, self.attributes)
        for owned, saved in ((module._parameters, self.parameters),
                             (module._buffers, self.buffers),
                             (module._non_persistent_buffers_set, self.non_persistent)):
            owned.clear()
            owned.update(saved)
        impl = _implementation(module)
        if impl is not None:
            _put_back_attributes(impl, self.impl_attributes)
        for tensor in self.tensors():
            _put_back(tensor, self.values[id(tensor)])

    def keep_impl_storage(self) -> int:
        """After a successful reload: where the backend implementation made new tensors of the
        same shape (AMX_MLA repacks into new ones), copy them into the old ones and put those
        back, so code that captured the old objects reads the new values. Returns how many."""
        impl = _implementation(self.module)
        kept = 0
        for name, old in self.impl_attributes.items():
            new = getattr(impl, name, None)
            if isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor) and new is not old \
                    and new.shape == old.shape and new.dtype == old.dtype:
                old.copy_(new)
                setattr(impl, name, old)
                kept += 1
        return kept


def _put_back_attributes(owner, saved: dict) -> None:
    """``owner``'s attributes as they were: the same objects, none added, none lost."""
    current = vars(owner)
    for name in [n for n in current if n not in saved]:
        del current[name]
    current.update(saved)


def _put_back(tensor: torch.Tensor, value: torch.Tensor) -> None:
    if tensor.shape == value.shape and tensor.dtype == value.dtype:
        tensor.data.copy_(value)
    else:  # its data was swapped for another shape (e.g. a weight released after packing)
        tensor.data = value.to(tensor.device)


class DrafterSnapshot:
    """Every module's state of one drafter (``ModuleState``)."""

    def __init__(self, drafter: nn.Module):
        self.drafter = drafter
        self.values: dict[int, torch.Tensor] = {}
        self.states = [ModuleState.capture(m, self.values) for m in drafter.modules()]

    def restore(self) -> None:
        for state in self.states:
            state.restore()
        _forget_reload_bookkeeping(self.drafter)

    def keep_impl_storage(self) -> int:
        return sum(state.keep_impl_storage() for state in self.states)

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.values.values())


def _forget_reload_bookkeeping(drafter: nn.Module) -> None:
    """vLLM's layerwise reload keeps per-module loading state (``LAYERWISE_INFO``); a module left
    mid-load would be skipped by the next reload's ``initialize_layerwise_reload``."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    for module in drafter.modules():
        info = LAYERWISE_INFO.get(module)
        if info is not None:
            info.reset()
    if hasattr(drafter, "_original_do_torchao_reload"):
        drafter._do_torchao_reload = drafter._original_do_torchao_reload


@contextlib.contextmanager
def restored_on_failure(drafter: nn.Module):
    """Run a reload of ``drafter``; on any error put the drafter back as it was, then re-raise."""
    snapshot = DrafterSnapshot(drafter)
    try:
        yield snapshot
    except BaseException:
        snapshot.restore()
        raise
