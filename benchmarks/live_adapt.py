"""Proof of ``vllm-mtp serve --adapt``: a target whose MTP layer no longer fits, served under
traffic of the text it was fine-tuned on, trains and swaps in its own layer while serving.
Writes ``benchmarks/results/live/adapt.json`` and ``docs/live-adapt.png``;
``docs/live-traffic.md`` shows them.

    python benchmarks/live_adapt.py                # the whole proof (about 30 minutes on 2 cores)
    python benchmarks/live_adapt.py plot           # the figure again from the stored results

The target is the refresh proof's (``train_proofs.py refresh``): the trained tiny DeepSeek
fine-tuned on the C++ headers of c10 (the same files, split and steps), saved with its old MTP
layer. ``vllm-mtp serve`` runs it as users run it (vLLM's default compilation, engine core
spawned), k = 1, fp32, with ``--adapt`` and every finished request recorded. Clients send greedy
completions of four-line excerpts of the *training* headers for ``--minutes``, ``--concurrency``
at a time. Measured:

- acceptance over time: vLLM's counters from ``/metrics`` every ``--scrape-s`` seconds, as
  acceptance per ``--window-s`` window, with the adapter's events (``GET /mtp/adapt``);
- failed requests (any exception a client saw);
- losslessness across every swap: each request in flight within ``--around-s`` seconds of a swap,
  and a random sample of the others, compared with transformers' fp32 greedy continuation of its
  prompt by the target alone;
- the layer serving at the end, taken out of the server and measured as the refresh proof measures
  its offline ``vllm-mtp train`` result (bf16, k = 1..3, the held-out headers' prompts), and the
  starting layer the same way at k = 1; the ratio to the offline result stored in
  ``results/training/refresh.json`` (whose fine-tuned target must be the same: its held-out
  perplexity is compared).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from train_proofs import acceptance, cpp_documents, cpp_prompt, fine_tune_target

from vllm_mtp_plugin.tools.engine import metrics
from vllm_mtp_plugin.tools.engine.interference import Meter
from vllm_mtp_plugin.tools.engine.server import Server
from vllm_mtp_plugin.tools.provenance import environment, portable
from vllm_mtp_plugin.tools.tiny import trained

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "live"
OFFLINE = ROOT / "benchmarks" / "results" / "training" / "refresh.json"
FIGURE = ROOT / "docs" / "live-adapt.png"
SPEC = {"method": "mtp", "num_speculative_tokens": 1}


def traffic_prompts(documents: list[str], every_lines: int = 20, seed: int = 0) -> list[str]:
    """Four-line excerpts every ``every_lines`` lines of each document, shuffled: thousands of
    distinct prompts from the same text the offline proof trained on."""
    prompts = []
    for text in documents:
        lines = text.splitlines()
        for start in range(0, max(0, len(lines) - 4), every_lines):
            excerpt = "\n".join(lines[start:start + 4]).strip()
            if len(excerpt) > 40:
                prompts.append(excerpt + "\n")
    random.Random(seed).shuffle(prompts)
    return prompts


def windows(scrapes: list[dict], window_s: float) -> list[dict]:
    """Acceptance (accepted / draft tokens) per window of ``window_s`` seconds, from cumulative
    counters scraped at times ``t``."""
    out, start = [], scrapes[0] if scrapes else None
    for scrape in scrapes[1:]:
        if scrape["t"] - start["t"] >= window_s:
            drafts = scrape["draft_tokens"] - start["draft_tokens"]
            accepted = scrape["accepted_tokens"] - start["accepted_tokens"]
            out.append({"start_s": start["t"], "end_s": scrape["t"], "draft_tokens": drafts,
                        "accepted_tokens": accepted,
                        "acceptance": accepted / drafts if drafts else None,
                        "version": scrape["version"]})
            start = scrape
    return out


class Traffic:
    """``concurrency`` client threads sending greedy completions until stopped."""

    def __init__(self, base_url: str, prompts: list[str], concurrency: int, max_tokens: int):
        from openai import OpenAI

        self.client = OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0, timeout=600)
        self.prompts, self.max_tokens = prompts, max_tokens
        self.done: list[dict] = []
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.next = 0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client) for _ in range(concurrency)]

    def _take(self) -> str:
        with self.lock:
            prompt = self.prompts[self.next % len(self.prompts)]
            self.next += 1
            return prompt

    def _client(self) -> None:
        while not self.stop.is_set():
            prompt, sent = self._take(), time.time()
            try:
                answer = self.client.completions.create(
                    model="t", prompt=prompt, max_tokens=self.max_tokens, temperature=0.0,
                    extra_body={"return_token_ids": True})
                choice = answer.choices[0]
                self.done.append({"sent": sent, "done": time.time(),
                                  "prompt_ids": list(choice.prompt_token_ids),
                                  "output_ids": list(choice.token_ids)})
            except Exception as exc:  # noqa: BLE001 - counted: the proof needs zero
                self.failures.append(f"{time.time():.0f}: {exc!r}")

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for thread in self.threads:
            thread.join(600)


ADMIN_KEY = secrets.token_urlsafe(16)  # the server's reload key, for this run only


def _get(port: int, route: str) -> dict:
    return json.loads(urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{port}{route}", headers={"Authorization": f"Bearer {ADMIN_KEY}"}),
        timeout=30).read())


def _scrape(port: int, started: float) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    counters = metrics.counters_from_prometheus(text)
    page = metrics.parse_prometheus(text)
    return {"t": time.time() - started, "draft_tokens": counters.num_draft_tokens,
            "accepted_tokens": counters.num_accepted_tokens, "drafts": counters.num_drafts,
            "version": page.get(("vllm_mtp:drafter_layer_version", ()))}


def serve_with_adapt(target: Path, work: Path, prompts: list[str], args) -> dict:
    adapt_dir = work / "adapt"
    serve_args = ["--speculative-config", json.dumps(SPEC), "--served-model-name", "t",
                  "--dtype", "float32", "--max-model-len", "1024",
                  "--adapt", str(adapt_dir), "--record-fraction", "1",
                  "--adapt-every-tokens", str(args.every_tokens),
                  "--adapt-steps", str(args.steps), "--adapt-threads", str(args.threads),
                  "--adapt-heldout-tokens", str(args.heldout_tokens),
                  "--adapt-window-drafts", str(args.window_drafts)]
    scrapes: list[dict] = []
    # The trainer needs memory beside the server: vLLM's CPU default gives the KV cache 92 %.
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "VLLM_MTP_RELOAD_API_KEY": ADMIN_KEY}
    with Server(target, serve_args, log_path=work / "serve.log", env=env) as server:
        started = time.time()
        meter = Meter()
        meter.watch(server.process.pid)
        with meter, Traffic(server.base_url, prompts, args.concurrency,
                            args.max_tokens) as traffic:
            while time.time() - started < args.minutes * 60:
                scrapes.append(_scrape(server.port, started))
                time.sleep(args.scrape_s)
            scrapes.append(_scrape(server.port, started))
        status = _get(server.port, "/mtp/adapt")
        layer = _get(server.port, "/mtp/layer")
        final = work / "final-layer"
        shutil.copytree(layer["path"], final, symlinks=False)
        time.sleep(2)
        scrapes.append(_scrape(server.port, started))
    return {"started": started, "scrapes": scrapes, "status": status, "final_layer": final,
            "final_version": layer["version"], "requests": traffic.done,
            "failures": traffic.failures, "interference": meter.result(),
            "settings": {"minutes": args.minutes, "concurrency": args.concurrency,
                         "max_tokens": args.max_tokens, "record_fraction": 1.0,
                         "every_tokens": args.every_tokens, "steps": args.steps,
                         "threads": args.threads, "heldout_tokens": args.heldout_tokens,
                         "window_drafts": args.window_drafts, "serve_args": serve_args}}


def lossless_check(target: Path, served: dict, around_s: float, sample: int) -> dict:
    """Requests in flight near a swap, plus ``sample`` others, against the target's greedy."""
    sys.path.insert(0, str(ROOT / "tests"))
    from support.target_greedy import mismatches

    swaps = [e["time"] for e in served["status"]["history"]
             if e["event"] in ("swapped", "rolled back")]
    requests = served["requests"]
    near = [i for i, r in enumerate(requests)
            if any(r["sent"] - around_s <= t <= r["done"] + around_s for t in swaps)]
    others = [i for i in range(len(requests)) if i not in set(near)]
    chosen = near + random.Random(0).sample(others, min(sample, len(others)))
    wrong = mismatches(target, [(requests[i]["prompt_ids"], requests[i]["output_ids"])
                                for i in chosen])
    return {"swaps": len(swaps), "checked_near_swaps": len(near),
            "checked_others": len(chosen) - len(near), "mismatches": len(wrong),
            "in_flight_during_a_swap": sum(any(r["sent"] <= t <= r["done"] for t in swaps)
                                           for r in requests)}


def offline_reference() -> dict:
    data = json.loads(OFFLINE.read_text())
    return {"file": str(OFFLINE.relative_to(ROOT)), "commit": data["run"].get("commit"),
            "date": data["run"].get("date"),
            "fine_tuned_perplexity": data["fine_tune"]["held_out_cpp_perplexity"]["fine_tuned"],
            "train_seconds": data["train"]["seconds"], "train_tokens": data["train"]["tokens"],
            "refreshed": data["fine_tuned_refreshed_on_cpp"],
            "old_layer": data["fine_tuned_old_layer_on_cpp"]}


def prove(work: Path, args) -> dict:
    documents = cpp_documents()
    held = [text for i, (_, text) in enumerate(documents) if i % 10 == 9]
    train_docs = [text for i, (_, text) in enumerate(documents) if i % 10 != 9]
    held_prompts = [cpp_prompt(t) for t in held][:12]
    if args.target:
        target = Path(args.target)
        tuning = json.loads((target / "fine_tune.json").read_text())
    else:
        full = trained.write_checkpoint(work / "full", 1)
        target = work / "tuned"
        target.mkdir()
        tuning = fine_tune_target(full, target, train_docs, held)
        (target / "fine_tune.json").write_text(json.dumps(tuning))
    prompts = traffic_prompts(train_docs)
    served = serve_with_adapt(target, work, prompts, args)
    lossless = lossless_check(target, served, args.around_s, args.sample)
    # keyed as in the results files (JSON keys are strings)
    final = {str(k): v for k, v in acceptance(served["final_layer"], prompts=held_prompts).items()}
    start = {str(k): v for k, v in acceptance(target, ks=(1,), prompts=held_prompts).items()}
    offline = offline_reference()
    requests = served["requests"]
    return {
        "target": {"fine_tune": tuning, "traffic_prompts": len(prompts),
                   "corpus": f"torch include/c10/**/*.h ({len(train_docs)} train / "
                             f"{len(held)} held-out files)"},
        "settings": served["settings"],
        "windows": windows(served["scrapes"], args.window_s),
        "scrapes": served["scrapes"],
        "events": [{**e, "t": e["time"] - served["started"]}
                   for e in served["status"]["history"]],
        "requests": {"finished": len(requests),
                     "output_tokens": sum(len(r["output_ids"]) for r in requests),
                     "failed": len(served["failures"]), "failures": served["failures"][:20]},
        "recorded_tokens": served["status"]["recorded_tokens"],
        "final_version": served["final_version"],
        "lossless": lossless,
        "interference": served["interference"],
        "held_out": {"start_layer": start, "final_layer": final},
        "offline": offline,
        "ratio_to_offline_k1": (final["1"]["per_position"][0]
                                / offline["refreshed"]["1"]["per_position"][0]),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [w for w in result["windows"] if w["acceptance"] is not None]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot([(w["start_s"] + w["end_s"]) / 120 for w in rows], [w["acceptance"] for w in rows],
            marker="o", ms=3, label="served acceptance per window (traffic, fp32, /metrics)")
    offline = result["offline"]["refreshed"]["1"]["per_position"][0]
    ax.axhline(offline, ls="--", c="k", lw=1,
               label=f"offline vllm-mtp train on the same text (held-out, bf16): {offline:.2f}")
    ax.axhline(0.9 * offline, ls=":", c="k", lw=1, label="0.9 x offline")
    for i, event in enumerate(e for e in result["events"]
                              if e["event"] in ("swapped", "rolled back")):
        ax.axvline(event["t"] / 60, c="tab:green" if event["event"] == "swapped" else "tab:red",
                   lw=1, label="layer swapped in (no restart)" if i == 0 else None)
    final = result["held_out"]["final_layer"]["1"]["per_position"][0]
    ax.set(xlabel="minutes of serving", ylabel="acceptance (k = 1)", ylim=(0, 1),
           title=f"vllm-mtp serve --adapt: fine-tuned tiny DeepSeek, old layer -> "
                 f"{final:.2f} held-out ({result['ratio_to_offline_k1']:.2f}x offline)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="live_adapt.py", description=__doc__.split("\n\n")[0])
    p.add_argument("part", nargs="?", choices=("prove", "plot"), default="prove")
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    # --adapt's own defaults, but a round every 50 000 recorded tokens (not 200 000): a tiny
    # server on 2 cores records a few hundred tokens a second
    p.add_argument("--every-tokens", type=int, default=50_000)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--heldout-tokens", type=int, default=2000)
    p.add_argument("--window-drafts", type=int, default=2000)
    p.add_argument("--scrape-s", type=float, default=10.0)
    p.add_argument("--window-s", type=float, default=60.0)
    p.add_argument("--around-s", type=float, default=5.0)
    p.add_argument("--sample", type=int, default=60)
    p.add_argument("--target", help="a fine-tuned target written by an earlier run (its "
                                    "fine_tune.json beside it), instead of fine-tuning again")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    path = args.out / "adapt.json"
    if args.part == "plot":
        plot(json.loads(path.read_text()), FIGURE)
        return 0
    run = environment()
    work = Path(tempfile.mkdtemp(prefix="live-adapt-"))
    try:
        result = prove(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(portable({"environment": run, **result}), indent=1))
    plot(result, FIGURE)
    print(json.dumps(portable({k: result[k] for k in ("requests", "lossless", "final_version",
                                                      "ratio_to_offline_k1")}), indent=1))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
