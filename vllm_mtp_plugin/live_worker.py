"""What ``vllm-mtp serve --record/--enable-layer-reload`` adds to each vLLM worker
(``--worker-extension-cls``): recording the drafter's inputs (``recording.py``) and replacing
its layer in place (``reload.py``)."""

from __future__ import annotations

from .platform import runner_drafter
from .recording import RecordingWorkerExtension


class LiveWorkerExtension(RecordingWorkerExtension):
    """Methods vLLM adds to its worker class, called through ``collective_rpc``."""

    def reload_mtp_layer(self, path: str, served_config: dict) -> dict:
        """Load ``path``'s MTP layer(s) into this worker's drafter (its tensor-parallel part);
        ``served_config`` is the served checkpoint's config.json. A refusal or failure comes back
        as ``{"error": ...}`` rather than killing the engine."""
        from .reload import ReloadRefused, reload_drafter

        runner = self.model_runner
        drafter = runner_drafter(runner)
        if drafter is None:
            return {"error": "this engine has no MTP drafter to reload (serve with "
                             "--speculative-config '{\"method\": \"mtp\", ...}'), or its model "
                             f"runner ({type(runner).__name__}) keeps it elsewhere: layer reload "
                             "supports vLLM's V1 model runner and Model Runner V2."}
        spec = self.vllm_config.speculative_config
        try:
            return reload_drafter(drafter, runner.model, path, spec.draft_model_config,
                                  served_config)
        except ReloadRefused as exc:
            return {"error": str(exc), "refused": True}
        except Exception as exc:  # noqa: BLE001 - reported to the caller, engine kept alive
            return {"error": f"{type(exc).__name__}: {exc}", "refused": False}
