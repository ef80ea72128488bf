"""What ``vllm-mtp serve`` adds to ``vllm serve`` for live traffic (``serve.py``): ``--record DIR``
writes the drafter's inputs of a sample of served requests as training shards (``recorder.py``),
``--enable-layer-reload LAYERS`` lets ``vllm-mtp reload`` (``reload_client.py``) swap the MTP layer,
``--adapt DIR`` trains a new one on recorded traffic and swaps it in when better (``adapt.py``)."""
