"""Pictures are optional: vLLM's requirements (CUDA and CPU wheels alike) do not bring matplotlib,
so a command that ends with a plot must finish its work, write its results and say how to get
the picture, instead of dying at the last step."""

from __future__ import annotations

import sys
from pathlib import Path


def pyplot(picture: str | Path):
    """matplotlib's pyplot (file output only, no display), or None after one line on stderr
    naming the picture left out and what to install."""
    try:
        import matplotlib
    except ImportError:
        print(f"picture {picture} not drawn: matplotlib is not installed (pip install matplotlib "
              "draws it next time); the results are complete without it.", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
