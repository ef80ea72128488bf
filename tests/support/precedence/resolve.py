"""Child process: put the rival plugin before or after site-packages, let vLLM load the general
plugins, and print (as JSON) which class the registry holds for each MTP architecture.

``python resolve.py first|last [switch ...] [engine=<checkpoint>]``; a switch is ``mode=on``,
``mode=off`` (sets ``MTP_PLUGIN`` and runs ``register()`` again) or ``overrides`` (vLLM's own
``model_class_overrides`` handling, pointing ``DeepSeekMTPModel`` at vLLM's class). With
``engine=`` a real engine drafts with that checkpoint after the switches.
"""

import json
import logging
import os
import sys
from pathlib import Path
from types import SimpleNamespace

RIVAL = str(Path(__file__).parent / "rival")
sys.path.insert(0, str(Path(__file__).parents[2]))  # tests/: the shared test support
from support.logs import PLUGIN_LOGGER, MessageHandler  # noqa: E402
ARCHS = ("DeepSeekMTPModel", "DeepseekV32MTPModel", "DeepSeekV4MTPModel")


def registered(registry) -> dict[str, str]:
    from vllm_mtp_plugin.precedence import registered_qualname

    return {arch: registered_qualname(registry, arch) for arch in ARCHS}


def main(order: str, *switches: str) -> None:
    sys.path.insert(0, RIVAL) if order == "first" else sys.path.append(RIVAL)
    keep = MessageHandler(logging.WARNING)
    logging.getLogger(PLUGIN_LOGGER).addHandler(keep)
    from importlib.metadata import entry_points

    from vllm import ModelRegistry
    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    import vllm_mtp_plugin

    report = {
        "discovered": [ep.name for ep in entry_points(group="vllm.general_plugins")
                       if ep.name in ("rival_mtp", "vllm_mtp_plugin")],
        "platform": type(current_platform).__name__,
        "loaded": registered(ModelRegistry),
    }
    for switch in switches:
        if switch.startswith("mode="):
            os.environ["MTP_PLUGIN"] = switch.removeprefix("mode=")
            vllm_mtp_plugin.register()
        elif switch == "overrides":
            from vllm.config.model import ModelConfig

            # vLLM's own code path for --model-class-overrides (run for the target's config).
            ModelConfig._maybe_register_model_class_overrides(SimpleNamespace(
                model_class_overrides={
                    "DeepSeekMTPModel": "vllm.model_executor.models.deepseek_mtp:DeepSeekMTP"}))
        elif switch.startswith("engine="):
            report["engine"] = run_engine(switch.removeprefix("engine="))
            # vLLM configured its logging meanwhile (dictConfig drops the handlers of loggers
            # below the ones it names): listen again.
            plugin_logger = logging.getLogger(PLUGIN_LOGGER)
            plugin_logger.disabled = False
            if keep not in plugin_logger.handlers:
                plugin_logger.addHandler(keep)
            continue
        report[switch] = registered(ModelRegistry)
    report["warnings"] = [w for w in keep.messages if "vllm-mtp-plugin" in w]
    print("REPORT " + json.dumps(report))


def run_engine(checkpoint: str) -> dict:
    from vllm import LLM, SamplingParams

    from vllm_mtp_plugin.tools.engine.eager_reasons import eager_for

    llm = LLM(checkpoint, enforce_eager=eager_for("load-time"), distributed_executor_backend="uni",
              max_model_len=256, dtype="float32",
              speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    out = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    drafter = llm.collective_rpc(lambda w: type(w.model_runner.drafter.model))[0]
    from vllm_mtp_rival import models

    return {"drafter": f"{drafter.__module__}:{drafter.__name__}",
            "rival_constructed": models.constructed, "tokens": len(out[0].outputs[0].token_ids)}


if __name__ == "__main__":
    main(*sys.argv[1:])
