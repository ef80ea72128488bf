"""Helpers shared by the test modules (``from support.hardware import needs_cpu``)."""
