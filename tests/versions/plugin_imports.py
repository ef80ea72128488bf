"""Every ``from vllm... import X`` / ``import vllm...`` in the package, resolved in a source
tree."""

from __future__ import annotations

import ast

from contracts import PLUGIN, Result
from source_facts import SourceTree


def vllm_imports(part: str) -> list[tuple[str, str | None, str]]:
    """``(module, name or None, "file:line")`` for the plugin part or for ``tools/``."""
    found = []
    for path in sorted(PLUGIN.rglob("*.py")):
        in_tools = "tools" in path.relative_to(PLUGIN).parts
        if in_tools != (part == "tools"):
            continue
        where = str(path.relative_to(PLUGIN.parent))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and is_vllm(node.module):
                found += [(node.module, a.name, f"{where}:{node.lineno}") for a in node.names]
            elif isinstance(node, ast.Import):
                found += [(a.name, None, f"{where}:{node.lineno}") for a in node.names
                          if is_vllm(a.name)]
    return found


def is_vllm(module: str | None) -> bool:
    return module is not None and (module == "vllm" or module.startswith("vllm."))


def check_imports(src: SourceTree, part: str) -> Result:
    imports = vllm_imports(part)
    missing = []
    for module, name, where in imports:
        if src.module_path(module) is None:
            missing.append(f"{module} ({where})")
        elif name is not None and src.defines(module, name) is None:
            missing.append(f"{module}:{name} ({where})")
    modules = {m for m, _, _ in imports}
    if missing:
        return Result("fail", "missing " + ", ".join(sorted(set(missing))))
    return Result("ok", f"{len({(m, n) for m, n, _ in imports})} names from {len(modules)} modules")
