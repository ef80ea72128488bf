"""``/metrics`` of ``vllm-mtp serve --record``: how much is recorded and what it costs the server.

Operators need both in the dashboards they already have: the share of traffic that reaches the
shards (sampled, recorded, skipped because recording lagged behind), the size of the directory,
whether recording is paused after a failure or for lack of disk, and the wall time spent in recording windows (each
window: the drafter's recording switched on, the sampled requests re-prefilled, the shard
written). Counters are read from the recorder's ``stats`` at scrape time (no second copy to keep
in step); names follow vLLM's ``vllm:`` style under ``vllm_mtp:record_``.
"""

from __future__ import annotations

import time

# recorder.stats key -> (metric name without prefix and _total, help)
COUNTERS = {
    "finished": ("finished_requests", "Completions the server finished (stop or length)"),
    "sampled": ("sampled_requests", "Finished completions sampled for recording"),
    "recorded": ("recorded_requests", "Completions written to shards, every position"),
    "incomplete": ("incomplete_requests", "Sampled completions left out: positions missing"),
    "skipped_busy": ("skipped_requests", "Sampled completions skipped: recording lagged behind"),
    "skipped_paused": ("paused_requests", "Completions not recorded while recording paused"),
    "cut_requests": ("cut_requests", "Completions cut to a window's token budget"),
    "rows_written": ("written_rows", "Drafter rows the workers wrote for recording windows"),
    "rows_dropped": ("dropped_rows", "Rows of other traffic during windows, not written"),
    "calls_by_tokens": ("calls_matched_by_tokens", "Drafter calls during windows whose rows' "
                        "requests the runner could not tell (matched by tokens alone)"),
    "pauses": ("pauses", "Times recording paused (a failed window, or no room on the disk)"),
    "tokens": ("recorded_tokens", "Tokens of the completions written to shards"),
    "failed_windows": ("failed_windows", "Recording windows that failed (logged)"),
    "shards_removed": ("removed_shards", "Oldest shards removed to keep --record-max-gb"),
    "window_seconds": ("window_seconds", "Wall seconds spent in recording windows"),
}
PREFIX = "vllm_mtp:record_"


class RecordCollector:
    """Prometheus collector over a ``TrafficRecorder``."""

    def __init__(self, recorder):
        self.recorder = recorder

    def describe(self):
        """Names only: ``registry.register`` calls this under the registry's lock."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for name, _ in COUNTERS.values():
            yield CounterMetricFamily(PREFIX + name, "")
        yield GaugeMetricFamily(PREFIX + "directory_bytes", "")
        yield GaugeMetricFamily(PREFIX + "active", "")

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.recorder.stats
        for key, (name, text) in COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, text, value=float(stats[key]))
        yield GaugeMetricFamily(PREFIX + "directory_bytes",
                                "Bytes of shards in the recording directory after the last "
                                "window", value=float(self.recorder.directory_bytes))
        paused = time.monotonic() < self.recorder.paused_until
        yield GaugeMetricFamily(PREFIX + "active", "1 while recording, 0 while it pauses after "
                                "a failure or for lack of disk (the server goes on serving)",
                                value=0.0 if paused else 1.0)


def register(recorder) -> None:
    """Add the collector to the registry vLLM's ``/metrics`` serves (one API server process:
    ``--record`` refuses ``--api-server-count`` above 1)."""
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    get_prometheus_registry().register(RecordCollector(recorder))


def read(base_url: str) -> dict[str, float]:
    """A server's recording figures from its ``/metrics`` (names without prefix and ``_total``;
    empty for a server without ``--record``)."""
    from ..engine.metrics import page, parse_prometheus

    return {name[len(PREFIX):].removesuffix("_total"): value
            for (name, _), value in parse_prometheus(page(base_url)).items()
            if name.startswith(PREFIX) and not name.endswith("_created")}
