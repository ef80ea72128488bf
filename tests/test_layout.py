"""The package boundary: the plugin part (what vLLM's processes import) never reaches into tools/;
and the text that describes the package (docs/testing.md's layout, ``vllm-mtp --help``) names what
is there."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import vllm_mtp_plugin
from vllm_mtp_plugin import patches

PACKAGE = Path(vllm_mtp_plugin.__file__).parent
README = Path(__file__).resolve().parents[1] / "docs" / "patches.md"
TESTING = Path(__file__).resolve().parents[1] / "docs" / "testing.md"


def plugin_modules() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if "tools" not in p.relative_to(PACKAGE).parts]


def test_plugin_part_never_imports_tools():
    offenders = []
    for path in plugin_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
                names += [f"{names[0]}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            if any(re.search(r"(^|\.)tools(\.|$)", name) for name in names):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert plugin_modules() and offenders == []


def test_vllm_side_imports_load_no_tooling_module():
    """What a vLLM process imports (register, both drafters, the weight tables) pulls in no tool."""
    code = """
import sys
import vllm_mtp_plugin
vllm_mtp_plugin.register()
import vllm_mtp_plugin.models.v3, vllm_mtp_plugin.models.v4, vllm_mtp_plugin.weights.v3
import vllm_mtp_plugin.weights.v4, vllm_mtp_plugin.ops, vllm_mtp_plugin.patches
loaded = sorted(m for m in sys.modules if m.startswith("vllm_mtp_plugin"))
print(len(loaded), *loaded)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    _, *loaded = out.stdout.split()
    asked = {"vllm_mtp_plugin.models.v3", "vllm_mtp_plugin.models.v4", "vllm_mtp_plugin.weights.v3",
             "vllm_mtp_plugin.weights.v4", "vllm_mtp_plugin.ops", "vllm_mtp_plugin.patches"}
    assert asked <= set(loaded)
    plugin_part = {".".join(("vllm_mtp_plugin", *p.relative_to(PACKAGE).with_suffix("").parts))
                   .removesuffix(".__init__") for p in plugin_modules()}
    assert sorted(set(loaded) - plugin_part) == []  # tools/ is not in the plugin part


def test_every_patch_is_listed_in_docs_patches():
    readme = README.read_text()
    names = [patch.name for patch in patches.REGISTER_PATCHES]
    assert names and all(patch.apply is getattr(patches, patch.name)
                         for patch in patches.REGISTER_PATCHES)
    names += ["patch_cli_version_lookup"]
    assert [name for name in names if f"| `{name}` |" not in readme] == []
    from vllm_mtp_plugin import platform  # the V4 import helper lives with the block lookup

    assert callable(platform.import_v4_module)
    assert "| `import_v4_module` (`platform.py`) |" in readme
    from vllm_mtp_plugin import precedence  # the one change to vLLM kept outside patches.py

    assert callable(precedence.keep_claimed_architectures)
    assert "| `keep_claimed_architectures` (`precedence.py`) |" in readme


def test_one_header_reader_and_one_layer_description_for_loader_inspect_and_preflight():
    from vllm_mtp_plugin.tools import inspect as inspect_tool
    from vllm_mtp_plugin.weights import headers, layers, loader, preflight, v4

    assert inspect_tool.read_checkpoint is headers.read_checkpoint
    assert preflight.read_checkpoint is headers.read_checkpoint
    assert loader.tensor_file is headers.tensor_file
    assert inspect_tool.layout_for is preflight.layout_for
    assert preflight.LAYER_SPECS is layers.LAYER_SPECS
    assert preflight.DSPARK_MARKERS is layers.DSPARK_MARKERS is v4.DSPARK_MARKERS
    assert preflight.no_mtp_tensors is loader.no_mtp_tensors
    assert preflight.dspark_drafter is loader.dspark_drafter is v4.dspark_drafter


def documented_layout() -> list[str]:
    """The paths below ``vllm_mtp_plugin/`` in docs/testing.md's layout block, one per line."""
    text = TESTING.read_text().split("### Layout", 1)[1]
    block = text.split("```\nvllm_mtp_plugin/\n", 1)[1].split("```", 1)[0]
    paths, parents = [], []
    for line in block.splitlines():
        if not line.startswith("  "):
            break  # the line of other top-level folders
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0]
        parents[depth - 1:] = [name.rstrip("/")]
        paths.append("/".join(parents) + ("/" if name.endswith("/") else ""))
    return paths


def test_docs_testing_layout_names_every_module_once():
    documented = documented_layout()
    modules = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))
    listed = sorted(p for p in documented if p.endswith(".py"))
    assert listed == sorted(set(listed)), "a module is listed twice"
    assert sorted(set(modules) - set(listed)) == []  # in the tree, not in docs/testing.md
    assert sorted(set(listed) - set(modules)) == []  # in docs/testing.md, not in the tree
    assert [p for p in documented if p.endswith("/") and not (PACKAGE / p).is_dir()] == []


def test_cli_help_names_every_build_tiny_mode(capsys):
    from vllm_mtp_plugin.tools import cli
    from vllm_mtp_plugin.tools.tiny import BUILD_TINY_MODES

    assert cli.main(["--help"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "build-tiny``" in ln)
    assert all(mode in line for mode in BUILD_TINY_MODES) and "{" not in line
