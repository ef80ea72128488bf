"""Facts about a vLLM source tree read with ``ast``: modules, the names they define, signatures.

Reading instead of importing lets one process look at several releases at once, including ones that
cannot be imported here (no CPU build, other torch).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path


class SourceTree:
    """The ``vllm`` package under ``root`` (``root/vllm/...``)."""

    def __init__(self, root: Path, label: str):
        self.root, self.label = Path(root), label

    def module_path(self, dotted: str) -> Path | None:
        base = self.root.joinpath(*dotted.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
        return None

    def is_package(self, dotted: str) -> bool:
        return (self.root.joinpath(*dotted.split(".")) / "__init__.py").is_file()

    @functools.cache
    def tree(self, dotted: str) -> ast.Module | None:
        path = self.module_path(dotted)
        return ast.parse(path.read_text(encoding="utf-8")) if path else None

    def defines(self, dotted: str, name: str, depth: int = 0) -> str | None:
        """How ``from dotted import name`` is satisfied (``"defined"``, ``"submodule"``, ``"lazy"``,
        ``"star"``), or ``None`` when it is not."""
        tree = self.tree(dotted)
        if tree is None:
            return None
        if name in top_level_names(tree):
            return "defined"
        for star in star_imports(tree, dotted, self.is_package(dotted)):
            if depth < 5 and self.defines(star, name, depth + 1):
                return "star"
        if self.is_package(dotted) and self.module_path(f"{dotted}.{name}"):
            return "submodule"
        # Lazy exports: a module ``__getattr__`` plus the name as a string (table or __all__).
        if "__getattr__" in top_level_names(tree) and name in string_constants(tree):
            return "lazy"
        return None

    def find_class(self, dotted: str, name: str) -> ast.ClassDef | None:
        tree = self.tree(dotted)
        return next((n for n in top_level_nodes(tree) if isinstance(n, ast.ClassDef)
                     and n.name == name), None) if tree else None

    def find_function(self, dotted: str, name: str, cls: str | None = None):
        """The last (non-overload) definition of ``name`` in the module or in class ``cls``."""
        scope = self.find_class(dotted, cls) if cls else self.tree(dotted)
        if scope is None:
            return None
        nodes = scope.body if cls else top_level_nodes(scope)
        found = [n for n in nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name == name and not any(
                     ast.unparse(d).endswith("overload") for d in n.decorator_list)]
        return found[-1] if found else None


def top_level_nodes(tree: ast.Module):
    """Statements at module level, including those under ``if``/``try`` (TYPE_CHECKING,
    fallbacks)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop(0)
        if isinstance(node, ast.If):
            stack[:0] = node.body + node.orelse
        elif isinstance(node, ast.Try):
            stack[:0] = node.body + node.orelse + node.finalbody + [
                s for h in node.handlers for s in h.body]
        else:
            yield node


def top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in top_level_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def star_imports(tree: ast.Module, dotted: str, is_package: bool) -> list[str]:
    """Modules re-exported with ``from X import *`` (relative ones resolved against ``dotted``)."""
    package = dotted if is_package else dotted.rpartition(".")[0]
    found = []
    for node in top_level_nodes(tree):
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            base = package
            for _ in range(max(node.level - 1, 0)):
                base = base.rpartition(".")[0]
            found.append(f"{base}.{node.module}" if node.level else node.module)
    return found


def string_constants(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)}


def params(func) -> list[str]:
    """Parameter names in order; ``*args``/``**kwargs`` as ``*name``/``**name``."""
    a = func.args
    names = [x.arg for x in a.posonlyargs + a.args]
    names += [f"*{a.vararg.arg}"] if a.vararg else []
    names += [x.arg for x in a.kwonlyargs]
    names += [f"**{a.kwarg.arg}"] if a.kwarg else []
    return names


def required_params(func) -> list[str]:
    """Parameters without a default (``self`` included)."""
    a = func.args
    positional = a.posonlyargs + a.args
    required = [x.arg for x in positional[: len(positional) - len(a.defaults)]]
    required += [x.arg for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
    return required


def signature(func) -> str:
    return f"{func.name}({', '.join(p for p in params(func) if p != 'self')})"


def assigned_attributes(cls: ast.ClassDef) -> set[str]:
    """``self.x = ...`` attribute names anywhere in the class."""
    return {t.attr for n in ast.walk(cls) if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Attribute)}


def dict_entry(tree: ast.Module, dict_name: str, key: str):
    """The value node of ``key`` in the module-level dict literal ``dict_name``."""
    for node in top_level_nodes(tree):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == dict_name for t in targets) and isinstance(
                node.value, ast.Dict):
            for k, v in zip(node.value.keys, node.value.values):
                if isinstance(k, ast.Constant) and k.value == key:
                    return v
    return None
