"""The package boundary: the plugin part (what vLLM's processes import) never reaches into tools/;
and the text that describes the package (docs/testing.md's layout, ``vllm-mtp --help``) names what
is there."""

import ast
import re
import subprocess
import sys
from pathlib import Path

from support import paths
import vllm_mtp_plugin
from vllm_mtp_plugin import patches

PACKAGE = Path(vllm_mtp_plugin.__file__).parent
README = paths.REPO / "docs" / "patches.md"
TESTING = paths.REPO / "docs" / "testing.md"


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


def test_every_patch_is_listed_in_docs_patches_with_its_module_in_table_order():
    """docs/patches.md's table is checked against ``REGISTER_PATCHES``: one row per patch, in the
    order ``register()`` applies them, each naming the one module that holds the patch. A patch
    has one name: its module's, its ``Patch.name`` and its applying function's; its module's
    ``probe()`` is its probe."""
    readme = README.read_text()
    rows = [line.split("|")[1].strip() for line in readme.splitlines()
            if line.startswith("| `")]
    expected = []
    for patch in patches.REGISTER_PATCHES:
        module = patch.apply.__module__
        assert module.startswith("vllm_mtp_plugin.patches."), patch.name
        assert patch.probe.__module__ == module, patch.name  # the whole patch in one file
        assert module.rsplit(".", 1)[1] == patch.name == patch.apply.__name__
        assert patch.probe.__name__ == "probe", patch.name
        path = module.removeprefix("vllm_mtp_plugin.").replace(".", "/") + ".py"
        expected.append(f"`{patch.name}` (`{path}`)")
    assert rows[:len(expected)] == expected
    from vllm_mtp_plugin import platform  # the V4 import helper lives with the block lookup
    from vllm_mtp_plugin import precedence  # kept beside the rule it serves
    from vllm_mtp_plugin.tools.engine import vllm_version
    from vllm_mtp_plugin.tools.live import endpoints, tap

    assert callable(platform.import_v4_module) and callable(vllm_version.patch_cli_version_lookup)
    assert callable(precedence.keep_claimed_architectures) and callable(tap.install)
    assert callable(endpoints.install)
    assert rows[len(expected):] == ["`keep_claimed_architectures` (`precedence.py`)",
                                    "`patch_cli_version_lookup` (`tools/engine/vllm_version.py`)",
                                    "`finished_request_tap` (`tools/live/tap.py`)",
                                    "`live_endpoint_plugin` (`tools/live/endpoints.py`)",
                                    "`import_v4_module` (`platform.py`)"]


def test_one_header_reader_and_one_layer_description_for_loader_inspect_and_preflight():
    from vllm_mtp_plugin.tools.checkpoint import report, target
    from vllm_mtp_plugin.weights import headers, layers, loader, preflight, v4

    assert target.read_checkpoint is headers.read_checkpoint  # every tool reads through target
    assert report.TargetCheckpoint is target.TargetCheckpoint
    assert preflight.read_checkpoint is headers.read_checkpoint
    assert loader.tensor_file is headers.tensor_file
    assert target.layout_for is preflight.layout_for
    assert preflight.LAYER_DESCRIPTIONS is layers.LAYER_DESCRIPTIONS
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
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("vllm-mtp build-tiny "))
    assert all(mode in line for mode in BUILD_TINY_MODES) and "{" not in line


def test_cli_version_and_unknown_command(capsys):
    """``--version`` names this package's version and vLLM's; an unknown command fails with the
    usage on stderr."""
    from vllm_mtp_plugin import __version__
    from vllm_mtp_plugin.tools import cli

    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out
    assert f"vllm-mtp-plugin {__version__}, vLLM " in out
    assert cli.main(["no-such-command"]) == 2
    streams = capsys.readouterr()
    assert streams.out == "" and "unknown command 'no-such-command'" in streams.err
    assert "vllm-mtp serve ..." in streams.err and "``" not in streams.err


def module_name(path: Path, package: Path = PACKAGE) -> str:
    """``vllm_mtp_plugin.a.b`` for ``package/a/b.py`` (a package's name for its __init__)."""
    return ".".join(("vllm_mtp_plugin", *path.relative_to(package).with_suffix("").parts)
                    ).removesuffix(".__init__")


def imports_of(path: Path, package: Path = PACKAGE) -> set[str]:
    """The package modules ``path`` imports (anywhere in it, deferred imports included)."""
    module = ".".join(("vllm_mtp_plugin", *path.relative_to(package).with_suffix("").parts))
    package_name = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    package_name = package_name.removesuffix(".__init__")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package_name.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found |= {name for name in names if name.startswith("vllm_mtp_plugin")}
    return found


def module_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Package module -> the package modules it imports (a package's name means its __init__)."""
    modules = {module_name(p, package): p for p in package.rglob("*.py")}
    return {name: {m for m in imports_of(path, package) if m in modules and m != name}
            for name, path in modules.items()}


TOOLS = "vllm_mtp_plugin.tools"
DISPATCHER = f"{TOOLS}.cli"
# Commands whose package every other tool builds on: build-tiny's checkpoint builder.
SHARED_COMMAND_PACKAGES = {f"{TOOLS}.tiny"}


def command_table(package: Path = PACKAGE) -> dict[str, str]:
    """``tools/cli.py``'s ``COMMANDS``: command -> ``"module:function"``, read from the source."""
    tree = ast.parse((package / "tools" / "cli.py").read_text())
    (table,) = [node.value for node in tree.body if isinstance(node, ast.Assign)
                and [getattr(t, "id", None) for t in node.targets] == ["COMMANDS"]]
    return ast.literal_eval(table)


def command_packages(package: Path = PACKAGE) -> set[str]:
    """What each command of the table runs in: the package (or the module) right below tools/
    that holds its function, the shared ones left out."""
    found = {".".join(entry.split(":")[0].split(".")[:3]) for entry in
             command_table(package).values()}
    return found - SHARED_COMMAND_PACKAGES


def command_of(module: str, commands: set[str]) -> str | None:
    return next((c for c in commands if module == c or module.startswith(c + ".")), None)


def command_to_command_imports(package: Path = PACKAGE) -> list[str]:
    """Every import of a module of one command by a module of another."""
    commands = command_packages(package)
    return sorted(f"{m} imports {i}" for m, imported in module_graph(package).items()
                  for i in imported if command_of(m, commands)
                  and command_of(i, commands) not in (None, command_of(m, commands)))


def test_the_command_table_names_a_function_of_each_module():
    for command, entry in command_table().items():
        module, function = entry.split(":")
        path = PACKAGE.parent / (module.replace(".", "/") + ".py")
        defined = {node.name for node in ast.parse(path.read_text()).body
                   if isinstance(node, ast.FunctionDef)}
        assert function in defined, f"{command}: {entry}"


def test_no_command_imports_another_command():
    """Commands stand side by side: what two of them use lives on the shared floor below them."""
    assert {f"{TOOLS}.{name}" for name in ("bench", "tune", "doctor", "train", "live", "demo",
                                           "graft")} <= command_packages()
    assert command_to_command_imports() == []


def test_the_command_check_finds_a_command_importing_another(tmp_path):
    """The check above on a copy of the package with one command reaching into another."""
    import shutil

    copy = tmp_path / "vllm_mtp_plugin"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "data"))
    tune = copy / "tools" / "tune" / "cli.py"
    tune.write_text(tune.read_text() + "\nfrom ..bench.report import markdown_table\n")
    assert command_to_command_imports(copy) == [
        f"{TOOLS}.tune.cli imports {TOOLS}.bench.report"]


def layer_of(module: str, commands: set[str]) -> int:
    """0 the plugin part, 1 the shared tools, 2 the commands, 3 the dispatcher (``tools/cli.py``):
    a module imports only from its own layer or below."""
    if not module.startswith(TOOLS):
        return 0
    if module == DISPATCHER:
        return 3
    return 2 if command_of(module, commands) else 1


LAYERS = ("plugin part", "shared tools", "commands", "dispatcher")


def test_imports_go_down_the_layers_and_no_tool_imports_a_command_line():
    graph, commands = module_graph(), command_packages()
    upward = [f"{m} ({LAYERS[layer_of(m, commands)]}) imports {i} "
              f"({LAYERS[layer_of(i, commands)]})"
              for m, imported in graph.items() for i in imported
              if layer_of(i, commands) > layer_of(m, commands)]
    assert upward == []
    # A command's command line (``*.cli``) is imported by no other package, and the engine wing
    # imports nothing else of the tools but the machine's CPU facts it sets engine arguments by.
    clis = [f"{m} imports {i}" for m, imported in graph.items() for i in imported
            if i.endswith(".cli") and not m.startswith(i.rsplit(".", 1)[0])]
    assert clis == []
    engine = [f"{m} imports {i}" for m, imported in graph.items() if ".tools.engine" in m
              for i in imported if ".tools." in i and ".tools.engine" not in i
              and i != f"{TOOLS}.cpu_features"]
    assert engine == []


def test_the_package_has_no_import_circles():
    graph = module_graph()
    cycles, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    # a package imports its own modules (its __init__ re-exports): not a circle between rooms
    cycles = [c for c in cycles if not all(m.startswith(c[0]) or c[0].startswith(m) for m in c)]
    assert cycles == []


def test_no_run_of_six_lines_is_written_twice_in_the_package():
    """Six consecutive code lines (white space folded; blank, comment and import lines and
    docstring-only lines passed over) stand in one place only."""
    runs: dict[tuple, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        kept = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            text = " ".join(line.split())
            if not text or text.startswith(("#", "import ", "from ", '"""', "'''")) \
                    or text in (")", "]", "}", "):", "else:", "try:", "return", "pass"):
                continue
            kept.append((number, text))
        for i in range(len(kept) - 5):
            window = tuple(text for _, text in kept[i:i + 6])
            runs.setdefault(window, []).append(f"{path.relative_to(PACKAGE)}:{kept[i][0]}")
    repeated = {" | ".join(w)[:160]: places for w, places in runs.items()
                if len({p.split(":")[0] for p in places}) > 1 or len(places) > 1}
    assert repeated == {}


def test_the_wheel_holds_the_package_and_no_test_code(tmp_path):
    """Built as pip builds it: every module of the package and its data, nothing from tests/ or
    benchmarks/, no test-only module (harness, fork server, CPU-flag hiding, load-test mix)."""
    import zipfile

    import importlib.util
    import shutil

    # A copy of what the build reads, beside test code it must leave out: setuptools writes build/
    # and *.egg-info into the tree it builds.
    root = tmp_path / "source"
    checkout = paths.REPO
    junk = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for part in ("vllm_mtp_plugin", "tests"):
        shutil.copytree(checkout / part, root / part, ignore=junk)
    for name in ("setup.py", "README.md"):
        shutil.copy(checkout / name, root / name)
    tmp_path = tmp_path / "wheel"
    # This environment's setuptools where it can build wheels itself (no download), else pip's
    # isolated build environment.
    local = importlib.util.find_spec("setuptools") is not None and (
        importlib.util.find_spec("wheel") is not None
        or importlib.util.find_spec("setuptools.command.bdist_wheel") is not None)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path),
                    *(["--no-build-isolation"] if local else []), str(root)],
                   check=True, capture_output=True)
    (wheel,) = tmp_path.glob("vllm_mtp_plugin-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    modules = sorted(n for n in names if n.endswith(".py"))
    assert modules == sorted(str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py"))
    assert any(n.startswith("vllm_mtp_plugin/tools/data/trained/") for n in names)
    test_only = ("sitecustomize", "fork_server", "loadtest", "hide_avx512", "mrv2_harness")
    assert [n for n in names if any(word in n for word in test_only)] == []
    sources = "".join(zipfile.ZipFile(wheel).read(n).decode() for n in modules)
    assert "def hide_avx512" not in sources and "MTP_OFFLINE_FORK_SERVER" not in sources
