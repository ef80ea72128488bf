"""HTTP routes ``vllm-mtp serve`` adds: ``POST /mtp/reload``, ``GET /mtp/layer`` and ``GET
/mtp/adapt``, and the drafter layer's version and per-version acceptance on ``/metrics``.

Built on vLLM's endpoint-plugin contract (``vllm/plugins/endpoint_plugins/interface.py``:
``attach_router`` adds the routes when vLLM builds the app, ``init_state`` receives the engine
client) and reaching the workers the way that contract names, ``collective_rpc`` to a method of
the worker extension (``vllm_mtp_plugin.live_worker``). They exist only when the server was
started with ``--enable-layer-reload LAYERS`` (or ``--adapt``), and read layers from below LAYERS only.

The routes change the server, so they are closed by a key of their own (``--reload-api-key``),
checked here: they sit outside the prefixes vLLM's ``--api-key`` guards (``/v1`` and others,
``serve/middleware/authenticate.py``), so an inference client's key opens none of them. Without
a key the server does not start unless told ``--allow-unauthenticated-reload``. A reload over
HTTP is refused with 429 for ``min_interval_s`` after the last one; the versions kept (and their
series on ``/metrics``) are bounded; answers name no path of the server's disk.
"""

import asyncio
import json
import time
from pathlib import Path

from .options import ReloadSettings

RELOAD_ROUTE = "/mtp/reload"
LAYER_ROUTE = "/mtp/layer"
ADAPT_ROUTE = "/mtp/adapt"
COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens")


def _logger():
    from vllm.logger import init_logger

    return init_logger("vllm.vllm_mtp_plugin.reload")


def served_config(model_config) -> dict:
    """The served checkpoint's config.json (the file, as a replacement's is read), else the
    config vLLM parsed from it."""
    path = Path(str(model_config.model)) / "config.json"
    if path.is_file():
        return json.loads(path.read_text())
    return model_config.hf_config.to_dict()


class LayerVersions:
    """Which layer serves (version 0: the one the server started with) and vLLM's speculative
    decoding counters at each swap, so that acceptance is told per version. A swap is counted
    between two engine steps: the drafts of the step just before it are verified just after,
    one step that counts for the new version."""

    def __init__(self, path: str, keep: int = 32):
        self.layers = [{"version": 0, "path": path, "since": time.time(), "start": None}]
        self.keep = max(keep, 2)
        # Set when a reload failed on some workers and putting the version back failed too;
        # cleared by the next swap that every worker takes.
        self.ranks_differ = False

    @property
    def current(self) -> dict:
        return self.layers[-1]

    def swapped(self, path: str, counters: dict[str, float]) -> dict:
        """The new version; only the first (what a rollback may return to) and the newest
        ``keep - 1`` are kept, so the history and its /metrics series stay bounded."""
        self.current["end"] = counters
        self.ranks_differ = False
        self.layers.append({"version": self.current["version"] + 1, "path": path,
                            "since": time.time(), "start": counters})
        if len(self.layers) > self.keep:
            del self.layers[1:len(self.layers) - self.keep + 1]
        return self.current

    def by_version(self, now: dict[str, float]) -> list[tuple[int, dict[str, float]]]:
        out = []
        for layer in self.layers:
            start, end = layer["start"] or {}, layer.get("end") or now
            out.append((layer["version"], {k: end.get(k, 0.0) - start.get(k, 0.0)
                                           for k in COUNTERS}))
        return out


def served_model_dir(model_config) -> str:
    """The directory the served checkpoint was loaded from (version 0, what a rollback loads):
    the model path given, resolved, or for a Hugging Face repository id its local snapshot."""
    model = Path(str(model_config.model)).expanduser()
    if model.is_dir():
        return str(model.resolve())
    try:
        from huggingface_hub import snapshot_download

        return str(Path(snapshot_download(str(model_config.model), revision=getattr(
            model_config, "revision", None), local_files_only=True)).resolve())
    except Exception:  # noqa: BLE001 - not cached locally: the id stays, a rollback says why
        return str(model_config.model)


def vllm_counters(registry) -> dict[str, float]:
    """vLLM's speculative decoding counters, summed over engines and labels."""
    totals = {name: 0.0 for name in COUNTERS}
    for family in registry.collect():
        if family.name in totals:
            totals[family.name] += sum(s.value for s in family.samples
                                       if s.name == family.name + "_total")
    return totals


class VersionCollector:
    """Prometheus collector: ``vllm_mtp:drafter_layer_version`` and, per version,
    ``vllm_mtp:spec_decode_num_{drafts,draft_tokens,accepted_tokens}_by_layer_total``."""

    def __init__(self, versions: LayerVersions, registry, name_of=str):
        self.versions, self.registry, self._inside = versions, registry, False
        self.name_of = name_of  # a layer's name on /metrics, which anyone may read: no path

    def describe(self):
        """The names, without values: ``registry.register`` asks for them under the registry's
        lock, where ``collect`` (which reads the registry) would wait forever."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield GaugeMetricFamily("vllm_mtp:drafter_layer_version", "")
        yield GaugeMetricFamily("vllm_mtp:drafter_layer_info", "", labels=["version", "layer"])
        for name in COUNTERS:
            yield CounterMetricFamily(f"vllm_mtp:{name.split(':', 1)[1]}_by_layer", "",
                                      labels=["version"])

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        if self._inside:  # reading vLLM's counters walks the registry, this collector included
            return
        self._inside = True
        try:
            now = vllm_counters(self.registry)
        finally:
            self._inside = False
        version = GaugeMetricFamily("vllm_mtp:drafter_layer_version",
                                    "Version of the MTP layer serving (0: the one started with)")
        version.add_metric([], self.versions.current["version"])
        yield version
        info = GaugeMetricFamily("vllm_mtp:drafter_layer_info",
                                 "Each layer version: its checkpoint's path below the reload "
                                 "directory (\"started with\": the served checkpoint's)",
                                 labels=["version", "layer"])
        for layer in self.versions.layers:
            info.add_metric([str(layer["version"]), self.name_of(layer["path"])],
                            1.0 if layer is self.versions.current else 0.0)
        yield info
        families = {name: CounterMetricFamily(
            f"vllm_mtp:{name.split(':', 1)[1]}_by_layer",
            f"{name} while each layer version served", labels=["version"]) for name in COUNTERS}
        for v, counts in self.versions.by_version(now):
            for name, value in counts.items():
                families[name].add_metric([str(v)], value)
        yield from families.values()


class LiveEndpoints:
    """vLLM endpoint plugin (``EndpointPlugin`` protocol) for layer reload."""

    name = "vllm-mtp-live"
    required_tasks = ("generate",)

    def __init__(self, settings: ReloadSettings):
        self.settings = settings
        self.engine = None
        self.lock = asyncio.Lock()
        self.versions: LayerVersions | None = None
        self.served: dict = {}
        self.adapter = None  # adapt.Adapter, started with the server (``--adapt``)
        self.last_http_reload = float("-inf")  # monotonic time a reload over HTTP began loading

    def authorized(self, headers) -> bool:
        """The request carries the reload key (``Authorization: Bearer KEY``), compared in
        constant time; every request is, where the operator allowed unauthenticated reloads."""
        import hashlib
        import secrets

        if self.settings.api_key is None:
            return True
        scheme, _, given = (headers.get("Authorization") or "").partition(" ")
        digest = hashlib.sha256
        return scheme.lower() == "bearer" and secrets.compare_digest(
            digest(given.encode("utf-8", "surrogatepass")).digest(),
            digest(self.settings.api_key.encode("utf-8", "surrogatepass")).digest())

    def attach_router(self, app) -> None:
        from fastapi import APIRouter, Depends, HTTPException, Request
        from fastapi.responses import JSONResponse

        def admin(request: Request) -> None:
            if not self.authorized(request.headers):
                raise HTTPException(401, "Unauthorized: the MTP admin routes take the reload key "
                                         "(vllm-mtp serve --reload-api-key), not an inference key")

        router = APIRouter(dependencies=[Depends(admin)])

        @router.post(RELOAD_ROUTE)
        async def reload(request: Request):
            kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":  # a web page cannot send this cross-site unasked
                return JSONResponse({"error": "send Content-Type: application/json"}, 415)
            try:
                body = await request.json()
                path = body["path"]
            except (ValueError, KeyError, TypeError, RecursionError):
                return JSONResponse({"error": 'send {"path": "<checkpoint directory>"}'}, 400)
            if not isinstance(path, str) or not path:
                return JSONResponse({"error": 'send {"path": "<checkpoint directory>"}'}, 400)
            status, answer = await self.reload(path, over_http=True)
            headers = {"Retry-After": str(answer["retry_after"])} if status == 429 else None
            return JSONResponse(self.public_answer(answer), status, headers=headers)

        @router.get(LAYER_ROUTE)
        async def layer():
            if self.versions is None:
                return JSONResponse({"error": "the server is starting"}, 503)
            answer = {k: v for k, v in self.versions.current.items()
                      if k in ("version", "path", "since", "prefix_cache_reset")}
            answer["ranks_differ"] = self.versions.ranks_differ
            return JSONResponse(self.public_answer(answer))

        @router.get(ADAPT_ROUTE)
        async def adapt():
            if self.adapter is None:
                return JSONResponse({"error": "this server runs without --adapt"}, 404)
            return JSONResponse(self.public_answer(self.adapter.status()))

        app.include_router(router)

    async def init_state(self, engine_client, state, args) -> None:
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        self.engine = engine_client
        if engine_client is None:
            return
        if self.settings.api_key is None:
            _logger().warning("vllm-mtp serve: the MTP admin routes (%s, %s) take no key "
                              "(--allow-unauthenticated-reload): anyone who reaches this port "
                              "can replace the drafter", RELOAD_ROUTE, ADAPT_ROUTE)
        self.served = served_config(engine_client.model_config)
        self.versions = LayerVersions(served_model_dir(engine_client.model_config),
                                      self.settings.max_versions)
        registry = get_prometheus_registry()
        registry.register(VersionCollector(self.versions, registry, self.layer_name))
        if self.adapter is not None:
            self.adapter.start()

    def resolve(self, given: str) -> Path:
        """``given`` (absolute, or relative to DIR) if it lies below DIR or is a layer that served
        before (a rollback: the checkpoint the server started with lies elsewhere), else
        ``PermissionError``."""
        root = self.settings.directory
        try:
            path = Path(given).expanduser()
            path = (path if path.is_absolute() else root / path).resolve()
            str(path).encode()
        except (ValueError, UnicodeError, OSError, RuntimeError) as exc:
            raise ValueError(f"{given!r} is not a usable path ({type(exc).__name__}).") from None
        served = {layer["path"] for layer in self.versions.layers} if self.versions else set()
        if not path.is_relative_to(root) and str(path) not in served:
            raise PermissionError(f"{given}: outside the directory this server reads layers "
                                  "from (--enable-layer-reload), and no layer that served here; "
                                  "copy or train the layer into it.")
        return path

    def layer_name(self, path: str) -> str:
        """A layer as answers and /metrics show it: its path below the reload directory, else
        "started with" (the served checkpoint): no path of the server's disk."""
        try:
            return str(Path(path).relative_to(self.settings.directory))
        except ValueError:
            return "started with"

    def public_answer(self, answer):
        """``answer`` (JSON values) with ``public`` applied to every string in it."""
        if isinstance(answer, str):
            return self.public(answer)
        if isinstance(answer, dict):
            return {k: self.public_answer(v) for k, v in answer.items()}
        if isinstance(answer, list):
            return [self.public_answer(v) for v in answer]
        return answer

    def public(self, text: str) -> str:
        """``text`` with the server's own paths replaced by the names a client knows."""
        text = text.replace(str(self.settings.directory), "LAYERS")
        if self.adapter is not None:  # --adapt DIR: its rounds' logs and data
            for form in {str(self.adapter.directory.resolve()), str(self.adapter.directory)}:
                text = text.replace(form, "DIR")
        if self.versions is not None:
            text = text.replace(self.versions.layers[0]["path"], "the served checkpoint")
        return text

    async def reload(self, given: str, over_http: bool = False) -> tuple[int, dict]:
        """Check, then load ``given`` in every worker. ``over_http``: a client's reload, which
        starts the --reload-min-interval clock (--adapt's own swaps and rollbacks do not)."""
        from vllm_mtp_plugin.reload import ReloadRefused, check_replacement

        from vllm.v1.metrics.prometheus import get_prometheus_registry

        if self.engine is None:
            return 503, {"error": "the server is starting"}
        try:
            path = self.resolve(given)
        except PermissionError as exc:
            return 403, {"error": self.public(str(exc))}
        except ValueError as exc:
            return 400, {"error": self.public(str(exc))}
        async with self.lock:
            try:
                await asyncio.to_thread(check_replacement, path, self.served)
            except ReloadRefused as exc:
                _logger().warning("vllm-mtp reload refused: %s", exc)
                return 400, {"error": self.public(str(exc)),
                             "version": self.versions.current["version"]}
            started = time.monotonic()
            wait = self.settings.min_interval_s - (started - self.last_http_reload)
            if over_http and wait > 0:
                return 429, {"error": f"one reload per {self.settings.min_interval_s:g} s "
                                      "(--reload-min-interval); try again later",
                             "retry_after": max(1, int(wait + 0.999)),
                             "version": self.versions.current["version"]}
            if over_http:
                self.last_http_reload = started
            results = await self.engine.collective_rpc("reload_mtp_layer",
                                                       args=(str(path), self.served))
            errors = [r["error"] for r in results if isinstance(r, dict) and "error" in r]
            if errors:
                _logger().error("vllm-mtp reload of %s failed on %d worker(s): %s", path,
                                len(errors), errors[0])
                answer = {"error": self.public(errors[0]), "workers_failed": len(errors),
                          "version": self.versions.current["version"]}
                if len(errors) < len(results):
                    answer["realigned"] = await self._realign(len(results) - len(errors))
                return 400 if all(r.get("refused") for r in results if "error" in r) else 500, \
                    answer
            layer = self.versions.swapped(str(path), vllm_counters(get_prometheus_registry()))
            layer["prefix_cache_reset"] = await self.engine.reset_prefix_cache()
            if not layer["prefix_cache_reset"]:
                asyncio.get_running_loop().create_task(self._reset_when_free(layer))
        seconds = time.monotonic() - started
        _logger().info("vllm-mtp reload: version %d serves, from %s (%d workers, %.2f s)",
                       layer["version"], path, len(results), seconds)
        return 200, {"version": layer["version"], "path": str(path), "seconds": seconds,
                     "prefix_cache_reset": layer["prefix_cache_reset"], "workers": results}

    async def _realign(self, loaded: int) -> bool:
        """Some workers (tensor-parallel ranks) took the new layer and others failed (each of
        those put its previous layer back): load the serving version's layer on every worker
        again, so all ranks draft with the same layer. False (logged, and ``/mtp/layer`` says
        ``ranks_differ``) if that fails too."""
        current = self.versions.current
        results = await self.engine.collective_rpc("reload_mtp_layer",
                                                   args=(current["path"], self.served))
        errors = [r["error"] for r in results if isinstance(r, dict) and "error" in r]
        if errors:
            self.versions.ranks_differ = True
            _logger().error("vllm-mtp reload: %d worker(s) had loaded the new layer; putting "
                            "version %d back failed on %d: %s. The ranks draft with different "
                            "layers: reload a layer that loads on every rank, or restart.",
                            loaded, current["version"], len(errors), errors[0])
            return False
        _logger().warning("vllm-mtp reload: %d worker(s) had loaded the new layer; version %d "
                          "is back on every worker", loaded, current["version"])
        return True

    async def _reset_when_free(self, layer: dict, every_s: float = 0.5,
                               give_up_s: float = 120.0) -> None:
        """The prefix cache holds the old layer's KV entries (the drafter's attention shares the
        blocks): a request reusing them drafts worse until they go. vLLM resets it only while no
        running request holds blocks; retried until then, not forced (forcing preempts every
        running request)."""
        deadline = time.monotonic() + give_up_s
        while time.monotonic() < deadline and layer is self.versions.current:
            await asyncio.sleep(every_s)
            if await self.engine.reset_prefix_cache():
                layer["prefix_cache_reset"] = True
                return
        _logger().warning("vllm-mtp reload: the prefix cache could not be reset (requests kept "
                          "running); cached prefixes keep the old layer's entries until evicted")


def install(plugin: LiveEndpoints) -> None:
    """Hand ``plugin`` to vLLM's endpoint-plugin loading, in this process only.

    What it does: ``vllm.plugins.load_endpoint_plugins`` (called by ``launchers/app.py:
    attach_endpoint_plugins`` when vLLM builds the app) returns vLLM's list plus ``plugin``. Why a
    patch and not the ``vllm.endpoint_plugins`` entry point: vLLM loads endpoint plugins only
    when named in ``VLLM_PLUGINS`` and warns on every ``vllm serve`` of every user who did not,
    and setting ``VLLM_PLUGINS`` would also filter the platform and general plugins (vllm-ascend's
    among them). Applied by ``vllm-mtp serve --enable-layer-reload`` only. When it can go: if
    vLLM accepts endpoint plugins from the command line.
    """
    import vllm.plugins as plugins

    original = getattr(plugins.load_endpoint_plugins, "__wrapped__",
                       plugins.load_endpoint_plugins)

    def load_endpoint_plugins(supported_tasks=None):
        return [*original(supported_tasks), plugin]

    load_endpoint_plugins.__wrapped__ = original
    plugins.load_endpoint_plugins = load_endpoint_plugins
