"""The metrics registry (``pipeline.metrics``): labels stay in closed sets, the endpoint serves them."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from modalign.pipeline import cli
from modalign.pipeline.metrics import LABEL_VALUES, OTHER, WATCH_PORT, DEFAULT_HOST, Metrics, bounded, deid_kind
from modalign.schemas.errors import EnvironmentFaultError, QuarantineReason

pytestmark = pytest.mark.unit

SESSION_LIKE = ["sample-meeting", "subject-0001", "file:///data/in/room.mp4", "s3://bucket/in/a.wav", "x" * 300]


def _samples(m: Metrics) -> list:
    return [s for fam in m.registry.collect() for s in fam.samples]


def _feed(m: Metrics, values: list[str]) -> None:
    """Every feeding call, with ``values`` wherever a label value comes from the data."""
    for v in values:
        m.batch_ingested(v, 3, 0.01)
        m.source_done(v, v, 100, {v: 1, f"voice_frames:{v}": 2, "pii_replaced": 1})
        m.embedded({"granularities": {v: 1}, "seconds": 0.02, "modality": v})
        m.quarantine(v)
        m.stage(v, 0.1, v)
        m.cache_stats({"hits": {v: 1}, "misses": {v: 2}})
        m.listing(5, {v: 1, "ready": 2})
        m.processed.labels(bounded("outcome", v)).inc()


def test_label_values_stay_in_their_closed_sets_whatever_the_data():
    m = Metrics()
    _feed(m, SESSION_LIKE + [f"session-{i}" for i in range(200)])
    few = len({(s.name, tuple(sorted(s.labels.items()))) for s in _samples(m)})
    _feed(m, [f"other-session-{i}" for i in range(500)])
    samples = _samples(m)
    # 700 distinct session-like values later, not one more series.
    assert len({(s.name, tuple(sorted(s.labels.items()))) for s in samples}) == few
    for s in samples:
        for label, value in s.labels.items():
            if label == "le":  # histogram bucket bounds: fixed by the code
                continue
            assert value in LABEL_VALUES[label] or value == OTHER, (s.name, label, value)
    text = m.exposition().decode()
    assert not any(v in text for v in SESSION_LIKE)
    # what was fed under known values is counted under them, the rest under `other`
    assert m.value("modalign_events_total", modality=OTHER) == 3 * 705
    assert m.value("modalign_deidentified_items_total", kind="pii_replaced") == 705
    assert m.value("modalign_deidentified_items_total", kind="voice_frames") == 2 * 705


def test_known_values_keep_their_names():
    m = Metrics()
    m.batch_ingested("video", 7, 0.5)
    m.source_done("audio", "partial", 1234, {"voice_frames:voiceanon@3/mcadams": 40, "faces_blurred": 2})
    m.quarantine(QuarantineReason.FILE_EMPTY)
    m.cache_stats({"hits": {"frame": 4, "roi": 0}, "misses": {"frame": 1}})
    assert m.value("modalign_events_total", modality="video") == 7
    assert m.value("modalign_stage_seconds_count", stage="ingest", modality="video") == 1
    assert m.value("modalign_stage_seconds_sum", stage="ingest", modality="video") == 0.5
    assert m.value("modalign_sources_total", modality="audio", status="partial") == 1
    assert m.value("modalign_source_bytes_total", modality="audio") == 1234
    assert m.value("modalign_deidentified_items_total", kind="voice_frames") == 40
    assert m.value("modalign_deidentified_items_total", kind="faces_blurred") == 2
    assert m.value("modalign_quarantined_total", reason="file_empty") == 1
    assert m.value("modalign_cache_lookups_total", granularity="frame", result="hit") == 4
    assert m.value("modalign_cache_lookups_total", granularity="roi", result="hit") is None  # 0: no series
    assert deid_kind("voice_frames:waveform_dropped") == "voice_frames" and deid_kind("names") == OTHER


def test_the_endpoint_serves_the_registry_and_a_busy_port_is_an_environment_fault():
    m = Metrics()
    port = m.serve(0)
    try:
        m.batch_ingested("pdf", 2, 0.3)
        body = urllib.request.urlopen(m.url, timeout=10).read().decode()
        fams = {f.name: f for f in text_string_to_metric_families(body)}
        (sample,) = [s for s in fams["modalign_events"].samples if s.labels == {"modality": "pdf"}]
        assert sample.value == 2 and not any(n.endswith("_created") for n in fams)
        with pytest.raises(EnvironmentFaultError, match=f"127.0.0.1:{port}.*--metrics-port"):
            Metrics().serve(port)
    finally:
        m.close()
    with socket.socket() as s:  # closed: nothing listens there any more (TIME_WAIT aside)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_cli_defaults():
    assert (cli.WATCH_PORT, cli.METRICS_HOST) == (WATCH_PORT, DEFAULT_HOST)
    p = cli.build_parser()
    run = p.parse_args(["run", "in", "--out", "o"])
    watch = p.parse_args(["watch", "in", "--out", "o"])
    assert run.metrics_port is None and watch.metrics_port is None  # watch: WATCH_PORT unless said
    assert p.parse_args(["watch", "in", "--out", "o", "--metrics-port", "0"]).metrics_port == 0
