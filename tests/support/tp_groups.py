"""Tensor-parallel worlds faked in one process, for tests of what each rank builds and loads.

Two ways vLLM code learns its rank, two fakes:

* ``fake_tp``: vLLM's TP group object (``parallel_state._TP``) reports ``world_size`` ranks with
  this process as ``rank``, for every caller; everything else (the communicator) is the real
  single-process group's, so nothing may be communicated meanwhile. Layers built under it create,
  and their weight loaders narrow to, the shards of that rank of a real TP run.
* ``tp_rank_functions``: one module's ``get_tensor_model_parallel_world_size`` and ``_rank``
  answer the given values (for code that calls those functions, imported by name).
"""

import contextlib


@contextlib.contextmanager
def fake_tp(world_size: int, rank: int):
    """vLLM's TP group, reporting ``world_size`` ranks with this process as ``rank``."""
    from vllm.distributed import parallel_state

    real = parallel_state._TP

    class Group:
        def __getattr__(self, name):
            return getattr(real, name)

    group = Group()
    group.world_size, group.rank_in_group = world_size, rank
    parallel_state._TP = group
    try:
        yield
    finally:
        parallel_state._TP = real


def tp_rank_functions(monkeypatch, module, world_size: int, rank: int) -> None:
    """``module.get_tensor_model_parallel_world_size()`` gives ``world_size`` and
    ``module.get_tensor_model_parallel_rank()`` gives ``rank`` until ``monkeypatch`` undoes it."""
    monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: world_size)
    monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: rank)
