"""``after_import``: patches act on a vLLM module right after its import, several patches on the
same module each once and in order, one that raises leaves the import and the others alone."""

import sys
import textwrap

import pytest

from vllm_mtp_plugin.patches import import_hooks


@pytest.fixture
def module_name(tmp_path, monkeypatch):
    name = "mtp_hook_target"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        VALUE = 1
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    yield name
    sys.modules.pop(name, None)
    sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "module_name", None) != name]


def test_every_patch_of_one_module_acts_once_in_order(module_name, monkeypatch):
    seen, warnings = [], []
    monkeypatch.setattr(import_hooks.logger, "warning",
                        lambda *args: warnings.append(args[0] % args[1:]))

    def first(module):
        seen.append(("first", module.VALUE))
        module.VALUE = 2

    def broken(module):
        raise RuntimeError("shape changed")

    def second(module):
        seen.append(("second", module.VALUE))

    for action in (first, broken, second, first):
        import_hooks.after_import(module_name, action)
    assert seen == []  # nothing imported yet
    module = __import__(module_name)
    assert seen == [("first", 1), ("second", 2)] and module.VALUE == 2
    assert len(warnings) == 1 and "shape changed" in warnings[0]
    import_hooks.after_import(module_name, second)  # already imported: acts at once
    assert seen[-1] == ("second", 2) and len(seen) == 3
