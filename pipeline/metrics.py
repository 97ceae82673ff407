"""Prometheus metrics of ``modalign run`` and ``modalign watch``, served over HTTP by the driver.

Where it sits: beside the runner and the watch loop, on the driver only. Workers never touch it:
what they measure reaches the driver through the item stream and the actors' results
(``pipeline.runner`` routes them), so one endpoint shows the whole run and no Ray metrics agent
is needed. Each ``Metrics`` has its own ``CollectorRegistry`` (not prometheus_client's global
one): two runs in one process never mix their series, and a test reads exactly its own.

Labels are bounded: a label takes values from a closed set (the modalities of
``operators.modalities.PLANS``, the ``QuarantineReason`` codes, the de-identification kinds,
the feature granularities, the stages below); anything else is counted under ``other``.
No session id, source id, URI or path is ever a label value.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from modalign.operators.cache.keys import GRANULARITIES
from modalign.operators.modalities import PLANS
from modalign.schemas.errors import QuarantineReason

DEFAULT_HOST = "127.0.0.1"  # loopback unless asked: in a pod, --metrics-host 0.0.0.0
WATCH_PORT = 9464  # `modalign watch` serves by default (OpenTelemetry's Prometheus exporter port)
OTHER = "other"

# Closed label sets.
MODALITIES = tuple(PLANS)
STAGES = ("ingest", "embed", "align", "index", "monitor", "quality", "commit")  # per-stage latency
MONITOR_ALARMS = ("embedding_drift", "norm_jump", "quality_shift")
QUALITY_ACTIONS = ("warn", "drop", "fail")  # what a broken quality expectation does
SOURCE_STATUSES = ("ingested", "partial", "quarantined", "no_stream")  # lineage row status
DEID_KINDS = ("faces_blurred", "frame_text_blurred", "pii_replaced", "voice_frames")
REASONS = tuple(r.value for r in QuarantineReason)
CACHE_RESULTS = ("hit", "miss")
WATCH_STATES = ("discovered", "committed", "ready", "settling", "waiting", "failed", "duplicate")
WATCH_OUTCOMES = ("committed", "failed", "abandoned")
RUN_OUTCOMES = ("committed", "failed")

LABEL_VALUES: dict[str, tuple[str, ...]] = {
    "modality": MODALITIES + ("all",), "stage": STAGES, "status": SOURCE_STATUSES, "kind": DEID_KINDS,
    "reason": REASONS, "granularity": GRANULARITIES, "result": CACHE_RESULTS, "state": WATCH_STATES,
    "outcome": tuple(dict.fromkeys(WATCH_OUTCOMES + RUN_OUTCOMES)), "alarm": MONITOR_ALARMS,
    "action": QUALITY_ACTIONS,
}
"""Every value a label may take (plus ``other``): what keeps the number of series bounded."""

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
LAG_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600, 7200)


def bounded(label: str, value: Any) -> str:
    """``value`` if it is one of ``label``'s closed set, else ``other``."""
    v = str(value)
    return v if v in LABEL_VALUES[label] else OTHER


def deid_kind(counter: str) -> str:
    """The kind of a run.json de-identification counter (``voice_frames:METHOD`` -> ``voice_frames``)."""
    return bounded("kind", counter.split(":", 1)[0])


class Metrics:
    """The series of one run or watch (its own registry) and, once ``serve``d, its HTTP endpoint."""

    def __init__(self) -> None:
        disable_created_metrics()  # no ``*_created`` twin of every counter: half the series
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.host: str | None = None
        self.port: int | None = None
        # -- run (the runner feeds these from the items it routes and the actors' results)
        self.events = Counter("modalign_events", "Events ingested (video frames, MFCC frames, text blocks)",
                              ["modality"], registry=r)
        self.source_bytes = Counter("modalign_source_bytes", "Bytes of the sources ingested (their size)",
                                    ["modality"], registry=r)
        self.sources = Counter("modalign_sources", "Sources finished, by lineage status", ["modality", "status"],
                               registry=r)
        self.quarantined = Counter("modalign_quarantined", "Quarantine rows (rejected sources or ranges)",
                                   ["reason"], registry=r)
        self.deidentified = Counter("modalign_deidentified_items",
                                    "De-identified items (faces and frame-text regions blurred, personal-data "
                                    "items replaced, MFCC frames under a voice policy)", ["kind"], registry=r)
        self.features = Counter("modalign_features", "Feature rows written", ["granularity"], registry=r)
        self.cache = Counter("modalign_cache_lookups", "Feature cache lookups", ["granularity", "result"],
                             registry=r)
        self.ticks = Counter("modalign_ticks", "Aligned ticks decided", registry=r)
        self.gaps = Counter("modalign_gaps", "Gaps in the aligned timeline", registry=r)
        self.drift_alarms = Counter("modalign_drift_alarms", "Clock drift alarms", registry=r)
        self.sessions = Counter("modalign_sessions_committed", "Sessions committed", registry=r)
        self.monitor_windows = Gauge("modalign_monitor_windows",
                                     "Embedding-monitor windows of the committed features (rebuilt every commit)",
                                     registry=r)
        self.monitor_alarms = Gauge("modalign_monitor_alarms", "Monitor alarms in the committed state, by kind",
                                    ["alarm"], registry=r)
        self.quality_violations = Counter("modalign_quality_violations",
                                          "Records that broke a quality expectation, by modality and action "
                                          "(warn: counted, drop: not written, fail: the run stopped)",
                                          ["modality", "action"], registry=r)
        self.quality_shift_alarms = Gauge("modalign_quality_shift_alarms",
                                          "Quality-shift alarms of the committed state against the reference, "
                                          "by modality (rebuilt every commit)", ["modality"], registry=r)
        self.runs = Counter("modalign_runs", "Runs (a watch: batches) ended", ["outcome"], registry=r)
        self.stage_seconds = Histogram("modalign_stage_seconds",
                                       "Latency per stage: ingest (one batch decoded, de-identified and "
                                       "written, in the worker), embed (one batch, in the embedder), align (a "
                                       "session's finish), index (FAISS build), monitor (embedding drift), "
                                       "quality (the quality-shift check), commit", ["stage", "modality"],
                                       buckets=LATENCY_BUCKETS, registry=r)
        # -- watch
        self.objects_seen = Counter("modalign_watch_objects_seen",
                                    "Object versions seen in INPUT's listing (a new key, or new bytes of one)",
                                    registry=r)
        self.objects = Gauge("modalign_watch_objects", "Objects in INPUT's last listing", registry=r)
        self.watch_sessions = Gauge("modalign_watch_sessions", "Sessions of INPUT's last listing, by state",
                                    ["state"], registry=r)
        self.processed = Counter("modalign_watch_sessions_processed", "Sessions processed, by outcome",
                                 ["outcome"], registry=r)
        self.in_flight = Gauge("modalign_watch_in_flight", "Sessions in flight", registry=r)
        self.lag = Histogram("modalign_watch_lag_seconds", "Commit time minus the time a session became ready",
                             buckets=LAG_BUCKETS, registry=r)
        self.batch_seconds = Histogram("modalign_watch_batch_seconds",
                                       "Duration of one batch: run and commit of its sessions",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.polls = Counter("modalign_watch_polls", "Listings of INPUT", registry=r)

    # -- feeding (the runner) -------------------------------------------------------------
    def stage(self, stage: str, seconds: float, modality: str = "all") -> None:
        self.stage_seconds.labels(bounded("stage", stage), bounded("modality", modality)).observe(max(0.0, seconds))

    def batch_ingested(self, modality: str, events: int, seconds: float | None) -> None:
        """One ingest batch (a ``MetaItem``) reached the driver."""
        self.events.labels(bounded("modality", modality)).inc(events)
        if seconds is not None:
            self.stage("ingest", seconds, modality)

    def source_done(self, modality: str, status: str, nbytes: int | None, deid: dict[str, int]) -> None:
        """A source's stream ended (its ``DoneItem``, or the driver's row for a dead worker)."""
        m = bounded("modality", modality)
        self.sources.labels(m, bounded("status", status)).inc()
        if nbytes:
            self.source_bytes.labels(m).inc(nbytes)
        for counter, n in deid.items():
            if counter.startswith("quality:"):  # quality:ACTION:MODALITY:INDEX (operators.quality.gate)
                _q, action, mod, *_ = counter.split(":") + ["", ""]
                if n:
                    self.quality_violations.labels(bounded("modality", mod), bounded("action", action)).inc(n)
                continue
            kind = deid_kind(counter)
            if kind != OTHER and n:
                self.deidentified.labels(kind).inc(n)

    def embedded(self, result: dict, modality: str = "all") -> None:
        """One embed result (``Embedder.embed``'s dict)."""
        for g, n in result.get("granularities", {}).items():
            self.features.labels(bounded("granularity", g)).inc(n)
        if result.get("seconds") is not None:
            self.stage("embed", result["seconds"], result.get("modality", modality))

    def quarantine(self, reason: str) -> None:
        self.quarantined.labels(bounded("reason", reason)).inc()

    def aligned(self, result: dict, seconds: float) -> None:
        """One session's aligner ``finish`` result."""
        self.ticks.inc(result["ticks"])
        self.gaps.inc(result["gaps"])
        self.drift_alarms.inc(result["drift_alarms"])
        self.stage("align", seconds)

    def monitored(self, result: dict) -> None:
        """A commit's monitors (``monitors.monitor_embeddings``): windows and alarms of the committed state."""
        self.monitor_windows.set(result["windows"])
        for kind in MONITOR_ALARMS:
            if kind in result["alarms"]:  # quality_shift is set by quality_monitored
                self.monitor_alarms.labels(kind).set(result["alarms"][kind])

    def quality_monitored(self, result: dict) -> None:
        """A commit's quality-shift check (``quality.monitor_quality``): its alarms in the committed state."""
        self.monitor_alarms.labels("quality_shift").set(result["alarms"])
        for modality in MODALITIES:
            self.quality_shift_alarms.labels(modality).set(result["by_modality"].get(modality, 0))

    def cache_stats(self, stats: dict) -> None:
        """The embedder's cache hits and misses of one run (``FeatureCache.stats``)."""
        for result, key in (("hit", "hits"), ("miss", "misses")):
            for g, n in stats.get(key, {}).items():
                if n:
                    self.cache.labels(bounded("granularity", g), result).inc(n)

    # -- feeding (the watch) --------------------------------------------------------------
    def listing(self, objects: int, view: dict) -> None:
        self.polls.inc()
        self.objects.set(objects)
        for state in WATCH_STATES:
            self.watch_sessions.labels(state).set(view.get(state, 0))

    # -- reading ----------------------------------------------------------------------------
    def exposition(self) -> bytes:
        """The text format Prometheus scrapes."""
        return generate_latest(self.registry)

    def value(self, name: str, **labels: str) -> float | None:
        """One sample's value (``modalign_events_total``, modality="video"), None when absent."""
        return self.registry.get_sample_value(name, labels)

    # -- the endpoint -----------------------------------------------------------------------
    def serve(self, port: int, host: str = DEFAULT_HOST) -> int:
        """Serve ``/metrics`` on ``host:port`` (0: a free port) in a daemon thread; returns the port.

        A port in use is an ``EnvironmentFaultError`` naming it (another watch, or another exporter)."""
        from prometheus_client import start_http_server

        from modalign.schemas.errors import EnvironmentFaultError

        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise EnvironmentFaultError(f"cannot serve metrics on {host}:{port} ({exc.strerror or exc}); choose "
                                        "another --metrics-port (0 turns the endpoint off)") from None
        self.host, self.port = host, self._server.server_address[1]
        return self.port

    @property
    def url(self) -> str | None:
        return None if self.port is None else f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
            self.port = None
