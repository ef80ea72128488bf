"""``/metrics`` for adaptive k: the k each step drafted, the k each batch-size bucket serves and
the estimates behind it, read from the engine core's state file at scrape time
(``state_file.py``); names follow vLLM's style under ``vllm_mtp:adaptive_k_``."""

from __future__ import annotations

from .state_file import read_state

PREFIX = "vllm_mtp:adaptive_k_"


class AdaptiveKCollector:
    """Prometheus collector over the engine core's last adaptive-k summary."""

    def describe(self):
        """Names only: ``registry.register`` calls this under the registry's lock."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield CounterMetricFamily(PREFIX + "steps", "", labels=["k"])
        for name in ("chosen", "acceptance", "tokens_per_second", "step_seconds"):
            yield GaugeMetricFamily(PREFIX + name, "")

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        state = read_state() or {}
        steps = CounterMetricFamily(PREFIX + "steps", "Engine steps by the k they drafted",
                                    labels=["k"])
        for k, n in (state.get("steps_at_k") or {}).items():
            steps.add_metric([str(k)], float(n))
        yield steps
        chosen = GaugeMetricFamily(PREFIX + "chosen", "The k a batch-size bucket (batches up "
                                   "to that size) is served with", labels=["batch_bucket"])
        rate = GaugeMetricFamily(PREFIX + "tokens_per_second", "Estimated output tokens per "
                                 "second per request at each k", labels=["batch_bucket", "k"])
        cost = GaugeMetricFamily(PREFIX + "step_seconds", "Median seconds of a step at each k",
                                 labels=["batch_bucket", "k"])
        for bucket, entry in (state.get("buckets") or {}).items():
            chosen.add_metric([str(bucket)], float(entry["k"]))
            for k, value in entry.get("tokens_per_s_per_request", {}).items():
                rate.add_metric([str(bucket), str(k)], float(value))
            for k, value in entry.get("step_ms", {}).items():
                cost.add_metric([str(bucket), str(k)], float(value) / 1000)
        yield chosen
        yield rate
        yield cost
        acceptance = GaugeMetricFamily(PREFIX + "acceptance", "Estimated P(the first j drafts "
                                       "are all accepted)", labels=["position"])
        for position, value in enumerate(state.get("acceptance") or [], start=1):
            acceptance.add_metric([str(position)], float(value))
        yield acceptance


def register_collector() -> None:
    """Add the collector to the registry vLLM's ``/metrics`` serves (once per process)."""
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    registry = get_prometheus_registry()
    if not any(isinstance(c, AdaptiveKCollector)
               for c in list(getattr(registry, "_collector_to_names", {}))):
        registry.register(AdaptiveKCollector())
