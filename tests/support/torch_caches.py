"""Preloaded in the suite's fork servers (``MTP_FORK_SERVER_PRELOAD``, set by tests/conftest.py):
a compiled engine whose graphs an earlier engine of the run compiled loads that engine's
AOTAutograd/inductor output from torch's caches instead of generating it again.

* Stable graph names. torch 2.13 names every graph Dynamo hands to a backend
  ``__compiled_fn_<n>_<uuid4>`` (``torch/_dynamo/output_graph.py``,
  ``unique_id("__compiled_fn", with_uuid=True)``); the name is part of AOTAutograd's cache key,
  so that cache never hits. Here the name is ``__compiled_fn_<n>``, as torch's other generated
  names are: forked from one server, engines trace the same graphs under the same names.
* One FX graph and AOTAutograd cache per run (``MTP_TEST_TORCH_CACHE``). vLLM points
  ``TORCHINDUCTOR_CACHE_DIR`` into each compile key's directory (``decorators.py``: model path,
  ``max_model_len``, runner, ...), so the oracle and noisy checkpoints, k = 1 and 2, plugin and
  in-tree targets each generated the same backbone code again (~9 s an engine here). torch's own
  default is one cache per user, shared by every process; its keys hold the graph, its inputs'
  shapes and dtypes and inductor's config, not the directory. vLLM's per-key files (the AOT
  artifact, the generated modules) stay where vLLM puts them.

Dynamo still traces every engine. Processes vLLM forks from such an engine inherit both; engines
started any other way (``vllm serve``, spawned engine cores and workers, the tools' own
subprocesses) are untouched.
"""

import os

import torch._dynamo.output_graph as output_graph
from torch._dynamo.bytecode_transformation import unique_id
from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
from torch._inductor.codecache import FxGraphCache

if output_graph.unique_id is not unique_id:
    raise RuntimeError("torch_caches: torch._dynamo.output_graph.unique_id is no longer "
                       "torch._dynamo.bytecode_transformation.unique_id; update this file")


def unique_id_without_uuid(name: str, with_uuid: bool = False) -> str:
    return unique_id(name)


output_graph.unique_id = unique_id_without_uuid

SHARED = os.environ.get("MTP_TEST_TORCH_CACHE")
if SHARED:
    for cache, name in ((FxGraphCache, "fxgraph"), (AOTAutogradCache, "aotautograd")):
        if not callable(getattr(cache, "_get_tmp_dir", None)):
            raise RuntimeError(f"torch_caches: {cache.__name__}._get_tmp_dir is gone; update this file")
        cache._get_tmp_dir = staticmethod(lambda name=name: os.path.join(SHARED, name))
