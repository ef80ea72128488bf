"""What a recording directory holds, in the form a client's requests can be compared with."""

from vllm_mtp_plugin.tools.mtp_layer.shard_format import SequenceStore


def recorded_requests(store: SequenceStore) -> list[tuple[list[int], int]]:
    """Each recorded sequence's token ids (without the token appended after it) and prompt
    length, sorted."""
    return sorted((t[:-1].tolist(), p) for t, p in zip(store.tokens, store.prompt_lengths))


def sent_requests(sent: list[tuple[list[int], list[int]]]) -> list[tuple[list[int], int]]:
    """The same form for ``(prompt ids, output ids)`` pairs a client sent and got back."""
    return sorted((prompt + output, len(prompt)) for prompt, output in sent)
