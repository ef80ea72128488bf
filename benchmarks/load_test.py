"""Load test: many streaming clients against ``vllm-mtp serve`` with MTP; nothing may be lost.

    python benchmarks/load_test.py                                   # tiny oracle + noisy, 64 clients
    python benchmarks/load_test.py -m tiny:noisy:0.7 --clients 24 --max-tokens 8 24
    python benchmarks/load_test.py --base-url http://127.0.0.1:8000/v1 \\
        --reference-url http://127.0.0.1:8001/v1 -k 3                # servers already running

Per checkpoint it starts a speculative server and a non-speculative one on 127.0.0.1 (side by
side; vLLM's default process mode), sends the mix of ``benchmarks/loadtest.py`` with a
quarter of the streams closed early to the first and without aborts to the second, and prints
what came back, the spec-decode counter deltas and every problem found. Exit status 1 if any.
Everything has a deadline: per request, per run, for server start-up and for the whole script.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--checkpoint", action="append", dest="checkpoints",
                   help="checkpoint directory or PRESET[:MODE[:ACCEPTANCE]] of tools/tiny/v3.py "
                        "(repeatable; default tiny:oracle and tiny:noisy:0.7)")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=3, dest="k")
    p.add_argument("--clients", type=int, default=64, help="concurrent streaming clients")
    p.add_argument("--requests", type=int, help="requests per run (default: 2 x clients)")
    p.add_argument("--abort-fraction", type=float, default=0.25,
                   help="share of requests whose client closes the stream after 1-3 chunks")
    p.add_argument("--max-tokens", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    p.add_argument("--max-model-len", type=int, default=512,
                   help="for the servers started here (a --base-url server says its own)")
    p.add_argument("--context-margin", type=int,
                   help="keep prompt + max_tokens this far below max-model-len (default 2k; "
                        "0 fills the context, see loadtest.context_margin)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--base-url", help="a running speculative server (skips starting servers)")
    p.add_argument("--reference-url", help="with --base-url: a running server without speculation")
    p.add_argument("--model", help="with --base-url: the served model name (default: the first)")
    p.add_argument("--oracle", action="store_true",
                   help="with --base-url: its drafter is always right (expect 100 %% accepted)")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds per run of the mix")
    p.add_argument("--server-timeout", type=float, default=600.0, help="seconds to start servers")
    p.add_argument("--deadline", type=float, default=3600.0, help="seconds for the whole script")
    p.add_argument("--log-dir", type=Path, help="server logs (default: a temporary directory)")
    p.add_argument("--json", type=Path, help="write every figure and problem here")
    return p.parse_args(argv)


def _deadline(seconds: float) -> None:
    def expired(*_):
        raise TimeoutError(f"the load test ran past its deadline of {seconds:.0f} s")

    signal.signal(signal.SIGALRM, expired)
    signal.alarm(max(1, int(seconds)))


def _test(label: str, base_url: str, model: str, args, oracle: bool,
          reference_url: str | None) -> dict:
    import loadtest  # benchmarks/loadtest.py, beside this script

    margin = loadtest.context_margin(args.k) if args.context_margin is None else args.context_margin
    count = args.requests or 2 * args.clients
    mix = loadtest.make_mix(base_url, model, count, args.max_model_len, seed=args.seed,
                            max_tokens=tuple(args.max_tokens), abort_fraction=args.abort_fraction,
                            margin=margin)
    outcome = loadtest.evaluate(base_url, model, mix, args.clients, args.k,
                                reference_url=reference_url, oracle=oracle, margin=margin,
                                request_timeout=args.request_timeout,
                                overall_timeout=args.run_timeout)
    print(loadtest.format_summary(f"{label}: speculative (k = {args.k}), {args.clients} clients",
                                  outcome.figures, outcome.problems), flush=True)
    if outcome.reference:
        print(loadtest.format_summary(f"{label}: reference without speculation",
                                      outcome.reference, []), flush=True)
    return {"checkpoint": label, "k": args.k, "clients": args.clients, "margin": margin,
            **dataclasses.asdict(outcome)}


def _serve_and_test(checkpoint_arg: str, args, log_dir: Path) -> dict:
    from vllm_mtp_plugin.tools.tiny.presets import resolve
    from vllm_mtp_plugin.tools.engine.eager_reasons import eager_serve_args
    from vllm_mtp_plugin.tools.engine.server import Server, start_all

    checkpoint = resolve(checkpoint_arg)
    oracle = checkpoint.meta.get("mode") == "oracle"
    common = ["--served-model-name", "tiny", *eager_serve_args("outside-the-graph"), "--max-model-len",
              str(args.max_model_len), "--dtype", args.dtype]
    speculative = ["--speculative-config", json.dumps({"method": "mtp",
                                                       "num_speculative_tokens": args.k})]
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    servers = [Server(checkpoint.path, common + speculative, env=env,
                      log_path=log_dir / f"{checkpoint.label}-k{args.k}.log"),
               Server(checkpoint.path, common, env=env,
                      log_path=log_dir / f"{checkpoint.label}-k0.log")]
    t0 = time.perf_counter()
    print(f"[load] {checkpoint.label}: starting both servers (logs in {log_dir})", flush=True)
    try:
        start_all(servers, args.server_timeout)
        print(f"[load] servers ready after {time.perf_counter() - t0:.0f} s", flush=True)
        return _test(checkpoint.label, servers[0].base_url, "tiny", args, oracle,
                     servers[1].base_url)
    finally:
        for server in servers:
            server.stop()


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    _deadline(args.deadline)
    t0 = time.perf_counter()
    reports = []
    if args.base_url:
        from vllm_mtp_plugin.tools.engine.loadgen import served_model

        from loadtest import Tokens

        model = args.model or served_model(args.base_url)
        args.max_model_len = Tokens(args.base_url, model).max_model_len()
        reports.append(_test(args.base_url, args.base_url, model, args, args.oracle,
                             args.reference_url))
    else:
        log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="vllm-mtp-load-"))
        for checkpoint_arg in args.checkpoints or ["tiny:oracle", "tiny:noisy:0.7"]:
            reports.append(_serve_and_test(checkpoint_arg, args, log_dir))
    signal.alarm(0)
    problems = sum(len(r["problems"]) for r in reports)
    print(f"[load] done in {time.perf_counter() - t0:.0f} s; problems: {problems}")
    if args.json:
        args.json.write_text(json.dumps(reports, indent=2))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main(sys.argv[1:]))
