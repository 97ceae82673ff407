"""Prometheus metrics scraped over HTTP, on a real Ray: they say what run.json and watch.json say.

A run (in this process, the shared Ray) over the generated sample and an empty file is scraped
at its end; a ``modalign watch`` process with ``--metrics-port`` is scraped after its first commit
and while its second session is in flight, then gets SIGTERM: it drains (the session in flight
commits) and exits 0.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_kill_recovery import _wait_for
from test_watch import FAST, _watch_process

import modalign
from clips import write_tone
from modalign.pipeline.metrics import Metrics
from modalign.pipeline.runner import Runner
from modalign.pipeline.watch import STATUS_FILE, committed_versions
from modalign.schemas.config import RunConfig

pytestmark = pytest.mark.integration


def _scrape(url: str) -> dict[str, dict[tuple, float]]:
    """sample name -> {sorted label items: value}, from the endpoint over HTTP."""
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, dict[tuple, float]] = defaultdict(dict)
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out[s.name][tuple(sorted(s.labels.items()))] = s.value
    return out


def _v(scraped: dict, name: str, **labels: str) -> float:
    return scraped.get(name, {}).get(tuple(sorted(labels.items())), 0.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_run_metrics_equal_run_json(ray_local, sample_manifest, tmp_path):
    inp = tmp_path / "in"
    shutil.copytree(sample_manifest.parent, inp / "meeting")
    (inp / "broken.wav").write_bytes(b"")  # a session of its own, quarantined as file_empty
    out = tmp_path / "out"
    metrics = Metrics()
    metrics.serve(0)
    try:
        monitor = {"embedding": {"window": 4, "reference_windows": 2, "alpha": 0, "alpha_step": 0}}  # alarms
        summary = Runner(RunConfig(key_store=tmp_path / "keys", monitor=monitor, **FAST), out,
                         progress=lambda _m: None, metrics=metrics).run(inp)
        got = _scrape(metrics.url)  # the run is over; the endpoint is still up (the caller's)
    finally:
        metrics.close()
    run_json = json.loads((out / "run.json").read_text())
    assert run_json["run_id"] == summary["run_id"]
    c = run_json["counts"]
    assert c["sessions"] == 2 and c["quarantined"] == 1 and c["events"]["video"] > 0
    for modality, n in c["events"].items():
        assert _v(got, "modalign_events_total", modality=modality) == n, modality
    for g, n in c["features"].items():
        assert _v(got, "modalign_features_total", granularity=g) == n, g
    for result, key in (("hit", "hits"), ("miss", "misses")):
        for g, n in c["cache"][key].items():
            assert _v(got, "modalign_cache_lookups_total", granularity=g, result=result) == n, (g, result)
    assert sum(c["cache"]["misses"].values()) > 0
    for kind in ("faces_blurred", "frame_text_blurred", "pii_replaced"):
        assert _v(got, "modalign_deidentified_items_total", kind=kind) == c[kind], kind
    assert c["pii_replaced"] > 0
    assert _v(got, "modalign_deidentified_items_total", kind="voice_frames") == sum(c["voice_frames"].values()) > 0
    for name in ("ticks", "gaps", "drift_alarms"):
        assert _v(got, f"modalign_{name}_total") == c[name], name
    assert _v(got, "modalign_monitor_windows") == run_json["monitor"]["windows"] > 0
    for kind in ("embedding_drift", "norm_jump", "quality_shift"):
        assert _v(got, "modalign_monitor_alarms", alarm=kind) == c["monitor_alarms"][kind], kind
    assert c["monitor_alarms"]["embedding_drift"] > 0
    assert _v(got, "modalign_stage_seconds_count", stage="monitor", modality="all") == 1
    assert _v(got, "modalign_stage_seconds_count", stage="quality", modality="all") == 1
    for action, n in c["quality"].items():  # expectation violations (the default expectations only warn)
        assert sum(v for k, v in got["modalign_quality_violations_total"].items() if dict(k)["action"] == action) == n
    assert _v(got, "modalign_sessions_committed_total") == 2
    assert _v(got, "modalign_runs_total", outcome="committed") == 1

    # Quarantine per reason = the committed quarantine rows; sources per status = the lineage rows.
    output = modalign.open(out)
    rows = output.table("quarantine").to_table().to_pylist()
    assert [r["reason_code"] for r in rows] == ["file_empty"]
    assert _v(got, "modalign_quarantined_total", reason="file_empty") == 1
    assert sum(got["modalign_quarantined_total"].values()) == c["quarantined"]
    lineage = output.table("lineage_sources").to_table().to_pylist()
    per_status: dict[tuple, int] = defaultdict(int)
    for r in lineage:
        per_status[(r["modality"], r["status"])] += 1
    assert {(dict(k)["modality"], dict(k)["status"]): v for k, v in got["modalign_sources_total"].items()} == per_status
    sizes: dict[str, int] = defaultdict(int)
    for r in lineage:
        if r["track_of"] is None:
            sizes[r["modality"]] += (inp / "meeting" / Path(r["source_uri"]).name).stat().st_size
    for modality, n in sizes.items():
        assert _v(got, "modalign_source_bytes_total", modality=modality) == n, modality

    # Latency histograms: one ingest observation per events file, one align per session, one index build
    # and one commit; the embed stage saw every embedded batch.
    files = json.loads(next((out / "_modalign" / "commits").glob("v*.json")).read_text())
    n_events = defaultdict(int)
    for s in files["sessions"].values():
        for f in s["files"]:
            if f.startswith("events/"):
                n_events[f.split("/")[1]] += 1
    for modality, n in n_events.items():
        assert _v(got, "modalign_stage_seconds_count", stage="ingest", modality=modality) == n, modality
    assert _v(got, "modalign_stage_seconds_count", stage="align", modality="all") == 2
    assert _v(got, "modalign_stage_seconds_count", stage="commit", modality="all") == 1
    assert _v(got, "modalign_stage_seconds_count", stage="index", modality="all") == 1
    assert _v(got, "modalign_stage_seconds_count", stage="embed", modality="video") > 0
    assert _v(got, "modalign_stage_seconds_sum", stage="ingest", modality="video") > 0
    for labels in got["modalign_stage_seconds_count"]:  # nothing but closed label values
        assert dict(labels)["stage"] in ("ingest", "embed", "align", "index", "monitor", "quality", "commit")
        assert dict(labels)["modality"] in ("video", "audio", "pdf", "all")


def test_watch_metrics_equal_watch_json_and_sigterm_drains(tmp_path):
    inp, out, keys = tmp_path / "in", tmp_path / "out", tmp_path / "keys"
    inp.mkdir()
    write_tone(inp / "first.wav", seconds=1.0)
    port = _free_port()
    proc = _watch_process(inp, out, keys, "--metrics-port", str(port), "--max-in-flight", "1")
    url = f"http://127.0.0.1:{port}/metrics"
    status = lambda: json.loads((out / STATUS_FILE).read_text()) if (out / STATUS_FILE).is_file() else {}  # noqa: E731
    try:
        _wait_for(lambda: status().get("sessions_committed") == 1 and status().get("state") == "watching",
                  timeout=240, what="the first commit")
        got, st = _scrape(url), status()
        assert st["sessions_committed"] == 1  # nothing new meanwhile: the scrape and the file agree
        assert _v(got, "modalign_watch_sessions_processed_total", outcome="committed") == 1
        assert _v(got, "modalign_watch_lag_seconds_count") == 1
        assert abs(_v(got, "modalign_watch_lag_seconds_sum") - st["lag_s"]["last"]) < 0.002
        assert _v(got, "modalign_watch_batch_seconds_count") == st["batches"] == 1
        assert abs(_v(got, "modalign_watch_batch_seconds_sum") - st["busy_s"]) < 0.06
        assert _v(got, "modalign_watch_in_flight") == 0 and st["in_flight"] == []
        for state in ("committed", "ready", "settling", "waiting", "failed", "duplicate"):
            assert _v(got, "modalign_watch_sessions", state=state) == st["sessions"][state], state
        assert _v(got, "modalign_watch_objects") == 1 and _v(got, "modalign_watch_objects_seen_total") == 1
        assert _v(got, "modalign_events_total", modality="audio") == json.loads(
            (out / "run.json").read_text())["counts"]["events"]["audio"] > 0
        assert "first" not in urllib.request.urlopen(url, timeout=10).read().decode()  # no session ids

        write_tone(inp / "second.wav", seconds=1.0)
        _wait_for(lambda: status().get("in_flight") == ["second"], timeout=120, what="second in flight")
        got = _scrape(url)
        assert _v(got, "modalign_watch_in_flight") == 1
        assert _v(got, "modalign_watch_objects_seen_total") == 2
        proc.send_signal(signal.SIGTERM)  # drains: `second` commits, then the watch exits 0
        rc = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = Path(proc.log).read_text()
    assert rc == 0, log[-3000:]
    assert "SIGTERM: stopping after the 1 session(s) in flight commit" in log
    assert set(committed_versions(out)) == {"first", "second"}
    final = status()
    assert final["state"] == "stopped" and final["sessions_committed"] == 2 and final["exit_code"] == 0
    assert [r["session_id"] for r in final["recent"]] == ["first", "second"]
    with pytest.raises(OSError):  # the endpoint went with the process
        urllib.request.urlopen(url, timeout=2)
