"""Checkpoint tensors -> drafter parameters.

``layers`` (what an MTP layer holds, one description per variant), ``rules`` (the rule machinery),
``v3`` and ``v4`` (one table per checkpoint format), ``loader`` (the load, its completeness check and
every bad-checkpoint message), ``headers`` (the safetensors header and shard-index reader),
``preflight`` (the check before the engine starts), ``experts`` (the expert slots this rank fills),
``quantized`` (the extra tensors quantized exports add)."""
