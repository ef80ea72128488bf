"""Which requests finished, with their tokens: a patch of ``AsyncLLM.generate`` in the API server.

What it does: every request the OpenAI server (or any caller) runs through
``vllm/v1/engine/async_llm.py: AsyncLLM.generate`` passes its outputs on unchanged; when the
request finishes with ``stop`` or ``length``, each completion's prompt and output token ids go to
a listener (the recorder). Streamed requests (``RequestOutputKind.DELTA``) carry new tokens only,
so they are accumulated. Why a patch: vLLM offers no hook on finished requests in the server
process, and the token ids exist there already (no detokenization, no extra copy). Applied by
``vllm-mtp serve --record`` only, in its own process (never by the plugin inside vLLM's), and
removable: ``uninstall()``. When it can go: if vLLM's frontend gains an output callback.
"""

from __future__ import annotations

from collections.abc import Callable

# Requests the recorder itself sends (re-prefills) are not offered back to it.
OWN_REQUEST_PREFIX = "vllm-mtp-record-"

# listener(engine, prompt_ids, output_ids, cache_salt): cache_salt is the request's vLLM cache
# salt (None without one), which the recorder's re-prefill must carry: without it the prompt
# would enter the prefix cache every unsalted request shares.
Listener = Callable[[object, list[int], list[int], "str | None"], None]
_installed: dict = {}


class _Completions:
    """The token ids of each completion (``n`` may be > 1) of one request, as outputs arrive."""

    def __init__(self, delta: bool):
        self.delta = delta
        self.tokens: dict[int, list[int]] = {}
        self.reasons: dict[int, str | None] = {}

    def see(self, output) -> None:
        for completion in output.outputs:
            ids = list(completion.token_ids)
            if self.delta:
                self.tokens.setdefault(completion.index, []).extend(ids)
            else:
                self.tokens[completion.index] = ids
            self.reasons[completion.index] = completion.finish_reason


def install(listener: Listener) -> None:
    """Patch ``AsyncLLM.generate`` so that ``listener(engine, prompt_ids, output_ids,
    cache_salt)`` hears of every completion that finished (``stop`` or ``length``)."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    if _installed:
        _installed["listener"] = listener
        return
    original = AsyncLLM.generate

    async def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
        watch = (isinstance(sampling_params, SamplingParams)
                 and not str(request_id).startswith(OWN_REQUEST_PREFIX))
        completions = _Completions(sampling_params.output_kind == RequestOutputKind.DELTA
                                   if watch else False)
        async for output in original(self, prompt, sampling_params, request_id, *args, **kwargs):
            if watch:
                completions.see(output)
                if output.finished and output.prompt_token_ids:
                    for index, ids in sorted(completions.tokens.items()):
                        if completions.reasons.get(index) in ("stop", "length"):
                            _tell(self, list(output.prompt_token_ids), ids,
                                  cache_salt_of(prompt))
            yield output

    generate.__wrapped__ = original
    _installed.update(original=original, listener=listener)
    AsyncLLM.generate = generate


def cache_salt_of(prompt) -> str | None:
    """The request's vLLM cache salt: a rendered input's ``cache_salt`` (what the OpenAI server
    passes), or an ``EngineCoreRequest``'s."""
    salt = (prompt.get("cache_salt") if isinstance(prompt, dict)
            else getattr(prompt, "cache_salt", None))
    return salt if isinstance(salt, str) and salt else None


def _tell(engine, prompt_ids: list[int], output_ids: list[int], cache_salt: str | None) -> None:
    """The listener never fails a user's request: its errors are logged."""
    try:
        _installed["listener"](engine, prompt_ids, output_ids, cache_salt)
    except Exception:  # noqa: BLE001 - serving goes on whatever recording does
        from vllm.logger import init_logger

        init_logger("vllm.vllm_mtp_plugin.record").exception("recording a finished request")


def unpatched_generate():
    """``AsyncLLM.generate`` as vLLM defines it (the recorder's own requests go through it)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    return _installed.get("original", AsyncLLM.generate)


def uninstall() -> None:
    from vllm.v1.engine.async_llm import AsyncLLM

    if _installed:
        AsyncLLM.generate = _installed.pop("original")
        _installed.clear()
