"""One way for a test file to run offline engines: ``engine_runner(**defaults)`` gives the file's
``run(model, k, **overrides)``, an ``OfflineConfig`` with the file's settings, run in a process of
its own (``offline.run_config``, forked by the suite's fork server) and returned as its report
(token ids, spec-decode counters, runner, drafter class, ...)."""

from vllm_mtp_plugin.tools.engine.offline import OfflineConfig, run_config


def engine_runner(timeout: float = 900.0, **defaults):
    """``run(model, k=0, **overrides)``: ``OfflineConfig(model, k, **defaults | overrides)``;
    ``env`` (laid over the child's environment) and ``timeout`` go to ``run_config``."""

    def run(model, k: int = 0, env: dict | None = None, **overrides) -> dict:
        fields = {**defaults, **overrides}
        if "prompts" in fields:
            fields["prompts"] = list(fields["prompts"])
        config = OfflineConfig(model=str(model), num_speculative_tokens=k, **fields)
        return run_config(config, timeout=timeout, env=env)

    return run
