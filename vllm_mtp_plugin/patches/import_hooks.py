"""Act on a vLLM module right after vLLM imports it, without importing it ourselves.

Some fixes (``v4_cpu_tile_scheduler_keys``, ``mla_verify_as_decode``) change a module that costs
seconds to import and that most processes never load. ``register()`` runs in every vLLM process,
so instead of importing such a module it leaves a finder on ``sys.meta_path`` that runs the fix
once the module's own code has run; a process that never imports it pays nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger("vllm.vllm_mtp_plugin")


def after_import(module_name: str, action: Callable) -> None:
    """Run ``action(module)`` now if ``module_name`` is imported, else right after its import.

    One finder per module name: a second patch of the same module adds its action to it (each
    action once), and the actions run in the order they were given. An ``action`` that raises
    during the import is logged as a warning and the module stays as that action found it: the
    import itself never fails.
    """
    import importlib.abc
    import importlib.util
    import sys

    if module_name in sys.modules:
        action(sys.modules[module_name])
        return
    for finder in sys.meta_path:
        if getattr(finder, "module_name", None) == module_name:
            if action not in finder.actions:
                finder.actions.append(action)
            return

    class AfterImport(importlib.abc.MetaPathFinder):
        """Finds nothing itself; wraps the real loader of one module to act after it ran."""

        def __init__(self):
            self.module_name = module_name
            self.actions = [action]

        def find_spec(self, fullname, path, target=None):
            if fullname != module_name:
                return None
            sys.meta_path.remove(self)
            module_spec = importlib.util.find_spec(fullname)
            if module_spec is None or module_spec.loader is None:
                return module_spec
            exec_module = module_spec.loader.exec_module

            def run_then_act(module):
                exec_module(module)
                for act in self.actions:
                    try:
                        act(module)
                    except Exception as exc:  # noqa: BLE001 - vLLM's module stays as it is
                        logger.warning("vllm-mtp-plugin: patch of %s left out (%s: %s)",
                                       module_name, type(exc).__name__, exc)

            module_spec.loader.exec_module = run_then_act
            return module_spec

    sys.meta_path.insert(0, AfterImport())
