"""The MTP layer outside vLLM, in PyTorch: what ``train`` trains, ``doctor`` and ``live`` evaluate,
and the tiny model's pretraining shares.

``v3_target`` (the target it reads, refused in its own words with ``TrainInputError``),
``transformers_layer`` (transformers' MtpLayer in DeepSeek's names), ``trainable`` (the layers, how
they start, the per-depth objective), ``optim`` (optimiser settings, schedule, expert balancing),
``drafter_inputs`` (prompts in; recorded drafter calls matched to sequences), ``shard_format`` (the
data shard: sequences and hidden states, written and read), ``shard_writer`` (a safetensors file
written piece by piece), ``evaluation`` (the layer evaluated on recorded drafter inputs).
"""
