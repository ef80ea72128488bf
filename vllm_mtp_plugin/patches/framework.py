"""What a patch is: a probe that says whether this vLLM needs it and can take it, an apply that
makes it, and the sentence a user reads when it cannot be applied."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

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


def cpu_only() -> str | None:
    """The check of every patch to vLLM's CPU code: None on a CPU platform, else the reason its
    probe gives for leaving it out."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return None
    return f"not a CPU platform ({type(current_platform).__name__})"


def missing_in(function, reads: tuple[str, ...], parameters: tuple[str, ...]) -> list[str]:
    """What of ``reads`` (texts of its source) and ``parameters`` vLLM's ``function`` no longer
    has: a patch that wraps it relies on them."""
    import inspect

    try:
        source, names = inspect.getsource(function), inspect.signature(function).parameters
    except (OSError, TypeError, ValueError):
        source, names = "", {}
    return ([text for text in reads if text not in source]
            + [f"parameter {name}" for name in parameters if name not in names])


def replace_attribute(owner, name: str, ours, keep_in: dict, keep_as: str) -> None:
    """``owner.name = ours`` in one final assignment, vLLM's own first kept in the patch module's
    globals (``keep_in[keep_as]``) for the replacement to call; nothing when ``ours`` is there."""
    current = getattr(owner, name)
    if current is ours:
        return
    keep_in[keep_as] = current
    setattr(owner, name, ours)
