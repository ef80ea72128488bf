"""Preloaded in the suite's fork servers (``MTP_FORK_SERVER_PRELOAD``, set by tests/conftest.py):
a compiled engine whose compile key an earlier engine of the run compiled loads that engine's
AOTAutograd/inductor output from torch's cache instead of generating it again.

torch 2.13 names every graph Dynamo hands to a backend ``__compiled_fn_<n>_<uuid4>``
(``torch/_dynamo/output_graph.py``, ``unique_id("__compiled_fn", with_uuid=True)``); the name is
part of AOTAutograd's cache key, so that cache never hits. Here the name is ``__compiled_fn_<n>``,
as torch's other generated names are: forked from one server, engines of one configuration trace
the same graphs under the same names. Dynamo still traces every engine; only the code generation
is reused, and only for a key compiled from scratch earlier in the same run. Processes vLLM
forks from such an engine (engine core, TP workers) inherit it; engines started any other way
(``vllm serve``, the tools' own subprocesses) are untouched.
"""

import torch._dynamo.output_graph as output_graph
from torch._dynamo.bytecode_transformation import unique_id

if output_graph.unique_id is not unique_id:
    raise RuntimeError("stable_graph_names: torch._dynamo.output_graph.unique_id is no longer "
                       "torch._dynamo.bytecode_transformation.unique_id; update this file")


def unique_id_without_uuid(name: str, with_uuid: bool = False) -> str:
    return unique_id(name)


output_graph.unique_id = unique_id_without_uuid
