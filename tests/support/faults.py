"""Serving faults a test injects into vLLM's processes, to show that ``vllm-mtp doctor`` tells a
serving fault from a layer that does not fit. Test code only; never in the package.

``MTP_TEST_FAULT=drafter-head-some``: for one draft in every ``SOME_EVERY`` (counted over the
drafter's rows in order) the plugin's drafter computes its logits with the target's head rows
shifted by one token (``logits.roll(1)``), as a drafter holding a wrong or mis-sharded head would
for part of the vocabulary: the layer's output is right, those draft tokens are wrong. It costs
about 0.05 of first-position acceptance, the drop ``vllm-mtp doctor`` is sized to tell
(``tools/doctor/paired.py``).
``MTP_TEST_FAULT=drafter-norms``: after loading, each MTP layer's ``enorm`` and ``hnorm`` weights
are swapped, as a loader that mixes them up would: the layer computes something else than its
files say.
``MTP_TEST_FAULT=round-1-head``: a layer reloaded from a directory named ``round-1`` (``--adapt``'s
first candidate) drafts through the shifted head, any other layer normally: a candidate that is
better on held-out data (evaluated outside vLLM) yet serves worse, which ``--adapt`` must roll
back.
``MTP_TEST_FAULT=reload-fails-on-rank-1``: a reload of a directory whose name starts with
``fail-on-rank-1`` fails on tensor-parallel rank 1 after two of the layer's tensors were loaded (a
read error mid-load), and loads normally on every other rank: the server must put the version that
served back on every rank.
``MTP_TEST_FAULT=k0-no-catch-up``: the MTP layer skips its first pass at k = 0 steps
(``patches/deferred_first_pass_at_k0.py``) but the skipped rows are dropped instead of caught up,
as a drafter that skips without keeping its inputs would: its KV cache has holes where the k = 0
steps were (TensorRT-LLM's stale state). Installed by the suite's
``sitecustomize`` (``tests/mrv2_harness``) in every process a test starts or vLLM spawns, when
the module is imported (an import hook: nothing is imported early).
"""

import os
from pathlib import Path

from vllm_mtp_plugin.patches.import_hooks import after_import

FAULTS = ("drafter-head-some", "drafter-norms", "round-1-head", "reload-fails-on-rank-1",
          "k0-no-catch-up")
SOME_EVERY = 14
HARNESS = str(Path(__file__).resolve().parents[1] / "mrv2_harness")  # the suite's sitecustomize


def fault_env(name: str) -> dict[str, str]:
    """The environment under which every process a test starts (and those vLLM spawns from it)
    installs fault ``name``: its name, and the suite's ``sitecustomize`` first on PYTHONPATH."""
    if name not in FAULTS:
        raise ValueError(f"{name!r}: not one of {FAULTS}")
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != HARNESS]
    return {"MTP_TEST_FAULT": name, "PYTHONPATH": os.pathsep.join([HARNESS, *rest])}


def _shift_drafter_head_sometimes(module) -> None:
    predictor = module.DeepSeekMultiTokenPredictor
    original = predictor.compute_logits
    rows_seen = [0]

    def compute_logits(self, hidden_states, spec_step_idx: int = 0):
        logits = original(self, hidden_states, spec_step_idx)
        if logits is None:
            return None
        rows = logits.shape[0]
        hit = [i for i in range(rows) if (rows_seen[0] + i) % SOME_EVERY == SOME_EVERY - 1]
        rows_seen[0] += rows
        if hit:
            logits = logits.clone()
            logits[hit] = logits[hit].roll(1, dims=-1)
        return logits

    predictor.compute_logits = compute_logits


def _swap_drafter_norms(module) -> None:
    import torch

    predictor = module.DeepSeekMultiTokenPredictor
    original = predictor.load_weights

    def load_weights(self, weights):
        loaded = original(self, weights)
        with torch.no_grad():
            for layer in self.model.layers.values():
                enorm = layer.enorm.weight.detach().clone()
                layer.enorm.weight.copy_(layer.hnorm.weight)
                layer.hnorm.weight.copy_(enorm)
        return loaded

    predictor.load_weights = load_weights


def _shift_head_of_round_1(module) -> None:
    from pathlib import Path

    extension = module.LiveWorkerExtension
    reload = extension.reload_mtp_layer

    def reload_mtp_layer(self, path: str, served_config: dict) -> dict:
        answer = reload(self, path, served_config)
        drafter = getattr(getattr(self.model_runner, "drafter", None), "model", None)
        if drafter is not None and "error" not in answer:
            drafter.test_fault_shift_head = Path(path).name == "round-1"
        return answer

    extension.reload_mtp_layer = reload_mtp_layer


def _fail_reload_on_rank_1(module) -> None:
    from pathlib import Path

    extension = module.LiveWorkerExtension
    reload = extension.reload_mtp_layer

    def reload_mtp_layer(self, path: str, served_config: dict) -> dict:
        import vllm_mtp_plugin.reload as reload_module
        from vllm.distributed import get_tensor_model_parallel_rank

        if not (Path(path).name.startswith("fail-on-rank-1")
                and get_tensor_model_parallel_rank() == 1):
            return reload(self, path, served_config)
        real = reload_module.mtp_weights

        def weights(checkpoint, first):
            for i, item in enumerate(real(checkpoint, first)):
                if i == 2:
                    raise OSError("injected read error on rank 1 after 2 of the layer's tensors")
                yield item

        reload_module.mtp_weights = weights
        try:
            return reload(self, path, served_config)
        finally:
            reload_module.mtp_weights = real

    extension.reload_mtp_layer = reload_mtp_layer


def _shift_head_when_flagged(module) -> None:
    predictor = module.DeepSeekMultiTokenPredictor
    original = predictor.compute_logits

    def compute_logits(self, hidden_states, spec_step_idx: int = 0):
        logits = original(self, hidden_states, spec_step_idx)
        if logits is None or not getattr(self, "test_fault_shift_head", False):
            return logits
        return logits.roll(1, dims=-1)

    predictor.compute_logits = compute_logits


def _drop_k0_rows(module) -> None:
    backlog = module.FirstPassBacklog
    take = backlog.take

    def take_nothing(self, *args, **kwargs):
        take(self, *args, **kwargs)  # the rows leave the backlog, unused
        return None

    backlog.take = take_nothing


def install(name: str) -> None:
    if name == "k0-no-catch-up":
        after_import("vllm_mtp_plugin.adaptive_k.first_pass_backlog", _drop_k0_rows)
        return
    if name == "reload-fails-on-rank-1":
        after_import("vllm_mtp_plugin.live_worker", _fail_reload_on_rank_1)
        return
    if name == "round-1-head":
        after_import("vllm_mtp_plugin.live_worker", _shift_head_of_round_1)
        after_import("vllm_mtp_plugin.models.predictor", _shift_head_when_flagged)
        return
    faults = {"drafter-head-some": _shift_drafter_head_sometimes, "drafter-norms": _swap_drafter_norms}
    if name not in faults:
        raise ValueError(f"MTP_TEST_FAULT={name!r}: not one of {FAULTS}")
    after_import("vllm_mtp_plugin.models.predictor", faults[name])
