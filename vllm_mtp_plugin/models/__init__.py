"""Model classes vLLM builds for ``method: "mtp"`` (imported lazily through the model registry)."""
