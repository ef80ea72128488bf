"""Checkpoint tensors -> drafter parameters: the generic rule machinery (``rules``), one table per
checkpoint format (``v3``, ``v4``) and the safetensors header reader (``headers``)."""
