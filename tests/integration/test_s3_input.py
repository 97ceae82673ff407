"""INPUT on object storage: ``run s3://bucket/prefix`` and ``watch s3://...`` on a real SeaweedFS
(``tests/s3server.py``) and a real local Ray, with OUT a local folder.

One module fixture uploads the generated sample meeting (video with its own sound, lapel audio
whose clock is estimated against the video, slides PDF) and a session whose manifest names a
key outside its prefix and an absolute path, next to a canary object outside the prefix; it
runs that prefix once, and the same folder once from disk. The tests compare the two runs'
committed rows, check the sha256 the workers took while reading, that nothing outside the
prefix was requested or read, what a missing object and an unreachable store become, and a
watch that picks up a session uploaded after it started.

Ray's workers take their environment when Ray starts, so the fixture restarts the shared
local Ray once with the server's AWS variables set (as the CLI's own Ray would have them).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

import modalign
from clips import write_tone
from modalign.pipeline.layout import TABLES
from modalign.pipeline.runner import EXIT_QUARANTINED, Runner
from modalign.schemas.config import RunConfig
from s3server import s3_server

pytestmark = pytest.mark.integration

FAST = {"runtime": {"num_cpus": 2, "ingest_actors": 1},
        "policy": {"face": {"action": "keep"}, "frame_text": {"action": "keep"}}}
# differ between two clean runs by design, or name where the source was read from (checked apart)
VOLATILE = {"run_id", "trace_id", "latency_ms", "source_uri", "source_version"}
CANARY = b"%PDF-1.4\n% CANARY-OUTSIDE-THE-PREFIX-5531\n"


def _rows(out: Path, name: str) -> Counter:
    t = modalign.open(out).table(name).to_table()
    keep = [c for c in t.column_names if c not in VOLATILE and not (name == "quarantine" and c == "message")]
    return Counter(json.dumps(r, sort_keys=True, default=str) for r in t.select(keep).to_pylist())


def _column(out: Path, name: str, *cols: str) -> list[tuple]:
    t = modalign.open(out).table(name).to_table()
    return [tuple(r[c] for c in cols) for r in t.to_pylist()]


class _Calls:
    """Every S3 call a boto3 client makes (operation, key), recorded by a botocore event hook."""

    def __init__(self, client) -> None:
        self.calls: list[tuple[str, str | None]] = []
        client.meta.events.register("provide-client-params.s3.*", self._record)

    def _record(self, model, params, **_kw) -> None:
        self.calls.append((model.name, params.get("Key") or params.get("Prefix")))


@pytest.fixture(scope="module")
def s3_runs(ray_local, sample_manifest, tmp_path_factory):
    """(server, local INPUT folder, OUT of the s3:// run, OUT of the local run, run summaries)."""
    root = tmp_path_factory.mktemp("s3-input")
    with s3_server(root / "s3") as s3:
        saved = {k: os.environ.get(k) for k in s3.env()}
        os.environ.update(s3.env())
        ray_local.shutdown()  # the workers must start with the AWS variables
        ray_local.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        try:
            inp = root / "in"
            shutil.copytree(sample_manifest.parent, inp / "meeting")
            (inp / "escape").mkdir()
            write_tone(inp / "escape" / "mic.wav", seconds=1.0)
            (inp / "escape" / "manifest.yaml").write_text(
                "session_id: escape\nsources:\n  - {id: mic, uri: mic.wav, modality: audio}\n"
                "  - {id: up, uri: ../../outside/canary.pdf, modality: pdf}\n"
                "  - {id: abs, uri: /outside/canary.pdf, modality: pdf}\n")
            client = s3.client()
            client.put_object(Bucket=s3.bucket, Key="outside/canary.pdf", Body=CANARY)
            for p in sorted(inp.rglob("*")):
                if p.is_file():
                    client.upload_file(str(p), s3.bucket, "rec/" + p.relative_to(inp).as_posix())
            cfg = RunConfig(key_store=root / "keys", **FAST)
            out_s3, out_local = root / "out-s3", root / "out-local"
            summaries = (Runner(cfg, out_s3, progress=lambda _m: None).run(f"s3://{s3.bucket}/rec"),
                         Runner(cfg, out_local, progress=lambda _m: None).run(inp))
            yield s3, inp, out_s3, out_local, summaries
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def test_s3_input_gives_the_rows_of_the_same_folder(s3_runs):
    s3, inp, out_s3, out_local, (summary_s3, summary_local) = s3_runs
    assert summary_s3["exit_code"] == summary_local["exit_code"] == EXIT_QUARANTINED  # the escape session
    assert summary_s3["counts"]["events"] == summary_local["counts"]["events"]
    assert summary_s3["counts"]["events"]["video"] > 0 and summary_s3["counts"]["events"]["pdf"] > 0
    for name in TABLES:
        a, b = _rows(out_local, name), _rows(out_s3, name)
        assert a == b, f"{name}: {sum((a - b).values())} rows lost, {sum((b - a).values())} extra"

    # source URIs and versions: the objects, with the listing's ETag and size
    listed = {o["Key"]: o for o in s3.client().list_objects_v2(Bucket=s3.bucket, Prefix="rec/")["Contents"]}
    rows = _column(out_s3, "lineage_sources", "session_id", "source_id", "source_uri", "source_version",
                   "source_sha256", "clock_method")
    assert {(sid, src) for sid, src, *_ in rows} == {
        ("sample-meeting", "room_video"), ("sample-meeting", "room_video.audio"), ("sample-meeting", "lapel"),
        ("sample-meeting", "slides"), ("escape", "mic")}
    for sid, src, uri, version, sha256, clock in rows:
        key = uri.removeprefix(f"s3://{s3.bucket}/")
        assert uri.startswith(f"s3://{s3.bucket}/rec/") and key in listed, uri
        obj = listed[key]
        assert version == f"etag:{obj['ETag'].strip(chr(34))}:{obj['Size']}"
        local = inp / key.removeprefix("rec/")
        assert sha256 == "sha256:" + hashlib.sha256(local.read_bytes()).hexdigest(), (src, "sha256 of the bytes read")
        if src == "lapel":  # its clock was estimated against the video, read from the store too
            assert clock == "estimated"
    events = _column(out_s3, "events_video", "source_uri", "source_version")
    assert {e for e in events} == {(f"s3://{s3.bucket}/rec/meeting/room.mp4",
                                    next(v for _, s, _, v, _, _ in rows if s == "room_video"))}


def test_a_key_outside_the_prefix_is_refused_before_any_request(s3_runs):
    s3, _inp, out_s3, _out_local, _ = s3_runs
    q = _column(out_s3, "quarantine", "session_id", "source_id", "source_uri", "source_version", "reason_code",
                "stage")
    assert sorted(q) == [("escape", "abs", "/outside/canary.pdf", None, "path_outside_root", "discover"),
                         ("escape", "up", "../../outside/canary.pdf", None, "path_outside_root", "discover")]
    (message,) = {m for (m,) in _column(out_s3, "quarantine", "message")
                  if m.startswith(f"s3://{s3.bucket}/rec/escape/manifest.yaml: sources.1.uri:")}
    assert f"outside the input root (s3://{s3.bucket}/rec/escape)" in message
    assert not any("canary" in uri for *_, uri, _v, _s, _c in
                   _column(out_s3, "lineage_sources", "session_id", "source_id", "source_uri", "source_version",
                           "source_sha256", "clock_method"))
    digest = hashlib.sha256(CANARY).hexdigest().encode()
    for f in out_s3.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            assert b"CANARY-OUTSIDE" not in data and digest not in data, f

    # Discovery again, every call it makes recorded: one listing of the prefix, GETs of its two
    # manifests, nothing else; no media object and no key outside the prefix is requested.
    from modalign.pipeline.discovery import discover_objects
    from modalign.pipeline.objstore import Location, S3Store

    store = S3Store(Location(bucket=s3.bucket))
    calls = _Calls(store.client)
    sessions = discover_objects(Location.parse(f"s3://{s3.bucket}/rec"), store=store)
    assert sorted(s.manifest.session_id for s in sessions) == ["escape", "sample-meeting"]
    assert sorted(calls.calls) == [("GetObject", "rec/escape/manifest.yaml"),
                                   ("GetObject", "rec/meeting/manifest.yaml"), ("ListObjectsV2", "rec")]
    escape = next(s for s in sessions if s.manifest.session_id == "escape")
    assert sorted((spec.id, exc.code) for spec, exc in escape.refusals()) == [("abs", "path_outside_root"),
                                                                             ("up", "path_outside_root")]


def test_a_missing_object_is_quarantined_an_unreachable_store_is_a_fault(s3_runs, tmp_path):
    """In this process (no Ray): the worker's read of an object that is gone, and of a store that is down."""
    from modalign.pipeline.discovery import ObjectPath
    from modalign.pipeline.items import DoneItem, FaultItem, QuarantineItem, SourceJob
    from modalign.pipeline.worker import IngestWorker
    from modalign.schemas.manifest import SourceSpec

    s3 = s3_runs[0]
    spec = SourceSpec(id="mic", uri="gone.wav", modality="audio")
    job = SourceJob(run_id="r" * 32, session_id="s", spec=spec, path=ObjectPath(s3.bucket, "rec/gone.wav"),
                    uri=f"s3://{s3.bucket}/rec/gone.wav", version="etag:0123:100", size=100)
    worker = IngestWorker(RunConfig(key_store=tmp_path / "keys", **FAST), tmp_path / "out", tmp_path / "keys")
    items = list(worker.ingest(job))
    assert [type(i) for i in items] == [QuarantineItem, DoneItem]
    assert items[0].row.reason_code == "file_missing" and items[0].row.stage == "read"
    assert items[1].row.status == "quarantined"

    # an object replaced since the listing: that version is gone
    real = s3_runs[1] / "meeting" / "lapel.wav"
    changed = SourceJob(run_id="r" * 32, session_id="s", spec=spec, path=ObjectPath(s3.bucket, "rec/meeting/lapel.wav"),
                        uri=f"s3://{s3.bucket}/rec/meeting/lapel.wav", version=f"etag:0123:{real.stat().st_size}")
    items = list(worker.ingest(changed))
    assert [type(i) for i in items] == [QuarantineItem, DoneItem]
    assert items[0].row.reason_code == "file_missing" and "changed since it was listed" in items[0].row.message

    # a document over the in-memory cap: refused before any byte is read (the key does not even exist)
    small = RunConfig(key_store=tmp_path / "keys", ingest={"max_object_memory_bytes": 1000}, **FAST)
    deck = SourceJob(run_id="r" * 32, session_id="s", spec=SourceSpec(id="deck", uri="d.pdf", modality="pdf"),
                     path=ObjectPath(s3.bucket, "rec/nowhere.pdf"), uri=f"s3://{s3.bucket}/rec/nowhere.pdf",
                     version="etag:0123:5000", size=5000)
    items = list(IngestWorker(small, tmp_path / "out", tmp_path / "keys").ingest(deck))
    assert [type(i) for i in items] == [QuarantineItem, DoneItem]
    assert items[0].row.reason_code == "limit_exceeded" and "max_object_memory_bytes=1000" in items[0].row.message

    down = RunConfig(key_store=tmp_path / "keys", storage={"endpoint_url": "http://127.0.0.1:9", "max_attempts": 2,
                                                          "connect_timeout_s": 1}, **FAST)
    items = list(IngestWorker(down, tmp_path / "out", tmp_path / "keys").ingest(job))
    assert [type(i) for i in items] == [FaultItem]
    assert "cannot reach the object store" in items[0].message and s3.bucket in items[0].message


def test_watch_over_s3_commits_a_session_uploaded_after_it_started(s3_runs, tmp_path):
    from modalign.pipeline.listing import S3Listing
    from modalign.pipeline.watch import Watch, committed_versions

    s3 = s3_runs[0]
    client = s3.client()
    out = tmp_path / "out"
    watch = Watch(RunConfig(key_store=tmp_path / "keys", **FAST), S3Listing(f"s3://{s3.bucket}/incoming"), out,
                  interval_s=0.2, settle_s=1.0, progress=lambda _m: None)
    status: dict = {}
    thread = threading.Thread(target=lambda: status.update(watch.run()))
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while "discovered" not in watch.view and time.monotonic() < deadline:  # it has listed (nothing yet)
            time.sleep(0.1)
        assert watch.view["discovered"] == 0
        write_tone(tmp_path / "late.wav", seconds=1.0, hz=330.0)
        client.upload_file(str(tmp_path / "late.wav"), s3.bucket, "incoming/late/late.wav")
        client.put_object(Bucket=s3.bucket, Key="incoming/late/manifest.yaml",
                          Body=b"session_id: late\nsources:\n  - {id: mic, uri: late.wav, modality: audio}\n")
        deadline = time.monotonic() + 60
        while "late" not in watch.committed and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        watch.stop()
        thread.join(60)
    head = client.head_object(Bucket=s3.bucket, Key="incoming/late/late.wav")
    version = f"etag:{head['ETag'].strip(chr(34))}:{head['ContentLength']}"
    assert committed_versions(out) == {"late": frozenset({(f"s3://{s3.bucket}/incoming/late/late.wav", version)})}
    assert status["sessions_committed"] == 1 and status["exit_code"] == 0
    (sha,) = [r[0] for r in _column(out, "lineage_sources", "source_sha256")]
    assert sha == "sha256:" + hashlib.sha256((tmp_path / "late.wav").read_bytes()).hexdigest()
