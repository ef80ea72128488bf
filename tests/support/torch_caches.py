"""A compiled engine whose graphs an earlier engine of the run compiled loads that engine's
AOTAutograd/inductor output from torch's caches instead of generating it again. Test-only; run
in every process of the suite that may compile: the fork servers run this file before they fork
(``MTP_FORK_SERVER_PRELOAD``), and the suite's ``sitecustomize`` (``tests/mrv2_harness``, on the
``PYTHONPATH`` tests/conftest.py sets) runs it in every other Python process a test starts or vLLM
spawns (servers, engine cores, workers, tensor-parallel ranks) when ``MTP_TEST_TORCH_CACHE`` is set.

* Stable graph names. torch 2.13 names every graph Dynamo hands to a backend
  ``__compiled_fn_<n>_<uuid4>`` (``torch/_dynamo/output_graph.py``,
  ``unique_id("__compiled_fn", with_uuid=True)``); the name is part of AOTAutograd's cache key,
  so that cache never hits. Here the name is ``__compiled_fn_<n>``, as torch's other generated
  names are: engines trace the same graphs under the same names.
* One FX graph and AOTAutograd cache per run (``MTP_TEST_TORCH_CACHE``). vLLM points
  ``TORCHINDUCTOR_CACHE_DIR`` into each compile key's directory (``decorators.py``: model path,
  ``max_model_len``, runner, ...), so the oracle and noisy checkpoints, k = 1 and 2, plugin and
  in-tree targets each generated the same backbone code again (~9 s an engine here). torch's own
  default is one cache per user, shared by every process; its keys hold the graph, its inputs'
  shapes and dtypes and inductor's config, not the directory. vLLM's per-key files (the AOT
  artifact, the generated modules) stay where vLLM puts them.

Each torch module is patched when it is first imported (an import hook), so a process that never
compiles never imports torch's compiler for this; one imported already is patched at once.
Running this file twice in one process changes nothing. Dynamo still traces every engine.
"""

import os
from collections.abc import Callable
from types import ModuleType

PATCHED = "_mtp_test_torch_caches"


def _stable_graph_names(output_graph: ModuleType) -> None:
    from torch._dynamo.bytecode_transformation import unique_id
    if getattr(output_graph.unique_id, PATCHED, False):
        return
    if output_graph.unique_id is not unique_id:
        raise RuntimeError("torch_caches: torch._dynamo.output_graph.unique_id is no longer "
                           "torch._dynamo.bytecode_transformation.unique_id; update this file")

    def unique_id_without_uuid(name: str, with_uuid: bool = False) -> str:
        return unique_id(name)

    setattr(unique_id_without_uuid, PATCHED, True)
    output_graph.unique_id = unique_id_without_uuid


def _one_cache_dir(class_name: str, subdir: str) -> Callable[[ModuleType], None]:
    def patch(module: ModuleType) -> None:
        shared = os.environ.get("MTP_TEST_TORCH_CACHE")
        cache = getattr(module, class_name, None)
        if not shared or getattr(cache, PATCHED, False):
            return
        if not callable(getattr(cache, "_get_tmp_dir", None)):
            raise RuntimeError(f"torch_caches: {module.__name__}.{class_name}._get_tmp_dir is gone; "
                               "update this file")
        cache._get_tmp_dir = staticmethod(lambda: os.path.join(shared, subdir))
        setattr(cache, PATCHED, True)
    return patch


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "torch._dynamo.output_graph": _stable_graph_names,
    "torch._inductor.codecache": _one_cache_dir("FxGraphCache", "fxgraph"),
    "torch._functorch._aot_autograd.autograd_cache": _one_cache_dir("AOTAutogradCache", "aotautograd"),
}


def install() -> None:
    """Each patch runs on its module now if it is imported, else right after its import (the
    plugin's own ``after_import``: one finder per module, however often this file is loaded)."""
    from vllm_mtp_plugin.patches.import_hooks import after_import

    for name, patch in PATCHES.items():
        after_import(name, patch)


install()
