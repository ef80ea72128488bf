"""``vllm-mtp reload URL CHECKPOINT``: make a running ``vllm-mtp serve --enable-layer-reload
LAYERS`` draft with CHECKPOINT's MTP layer(s), without a restart.

The server reads CHECKPOINT from its own disk (below LAYERS): give a path both machines see
(shared storage), or one relative to LAYERS. Pass the server's reload key (its ``--reload-api-key``, not the
inference clients' ``--api-key``): ``--reload-api-key``, or ``VLLM_MTP_RELOAD_API_KEY`` in the
environment.
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
from pathlib import Path

from ..cli_help import HelpFormatter, examples
from .endpoints import RELOAD_ROUTE
from .options import RELOAD_KEY_ENV


def reload_url(url: str) -> str:
    base = url.rstrip("/")
    base = base[:-3] if base.endswith("/v1") else base
    return base + RELOAD_ROUTE


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is answered as it is, not followed: urllib would send the reload key on to
    wherever it points."""

    def redirect_request(self, *args, **kwargs):
        return None


_opener = urllib.request.build_opener(_NoRedirect)


def request_reload(url: str, checkpoint: str, api_key: str | None = None,
                   timeout: float = 600.0) -> tuple[int, dict]:
    """POST the reload; returns the HTTP status and the server's JSON answer (a redirect is
    not followed: its status comes back)."""
    path = Path(checkpoint).expanduser()
    sent = str(path.resolve()) if path.exists() else checkpoint
    request = urllib.request.Request(
        reload_url(url), data=json.dumps({"path": sent}).encode(), method="POST",
        headers={"Content-Type": "application/json",
                 **({"Authorization": f"Bearer {api_key}"} if api_key else {})})
    try:
        with _opener.open(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        body = exc.read()
        try:
            return exc.code, json.loads(body)
        except ValueError:
            return exc.code, {"error": body.decode(errors="replace") or exc.reason}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="vllm-mtp reload", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter,
        epilog=examples(
            f"{RELOAD_KEY_ENV}=KEY vllm-mtp reload http://127.0.0.1:8000 /srv/layers/retrained",
            "vllm-mtp reload http://127.0.0.1:8000 retrained --reload-api-key KEY  # below LAYERS"))
    p.add_argument("url", help="the server, e.g. http://127.0.0.1:8000 (or its /v1 base URL)")
    p.add_argument("checkpoint", help="checkpoint directory with the new MTP layer(s), e.g. "
                                      "what vllm-mtp train --out wrote")
    p.add_argument("--reload-api-key", dest="api_key", metavar="KEY",
                   default=os.environ.get(RELOAD_KEY_ENV),
                   help="the server's reload key (vllm-mtp serve --reload-api-key; default: "
                        f"${RELOAD_KEY_ENV}; none: the server must allow unauthenticated reloads)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for the server's answer")
    args = p.parse_args(argv)
    try:
        status, answer = request_reload(args.url, args.checkpoint, args.api_key, args.timeout)
    except (urllib.error.URLError, OSError) as exc:
        print(f"vllm-mtp reload: cannot reach {reload_url(args.url)}: {exc}")
        return 1
    if status == 200:
        print(f"version {answer['version']} serves: {answer['path']} ({answer['seconds']:.2f} s, "
              f"{len(answer.get('workers') or [])} worker(s))")
        return 0
    if status == 429:
        print(f"vllm-mtp reload: too soon after the last reload: {answer.get('error')}")
        return 1
    if status == 404:
        print(f"vllm-mtp reload: {reload_url(args.url)} does not exist: start the server with "
              "vllm-mtp serve ... --enable-layer-reload LAYERS")
        return 1
    print(f"vllm-mtp reload: refused (HTTP {status}): {answer.get('error', answer)}")
    return 1
