"""The V4 drafter's shared fixtures (``tests/support/v4_fixtures.py``)."""

from support.v4_fixtures import (  # noqa: F401  (fixtures, found by name)
    v4_bf16_dir,
    v4_config,
    v4_drafter,
    v4_fp8_config,
    v4_fp8_dir,
    v4_tensors,
)
