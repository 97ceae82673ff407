"""OpenLineage events of real runs: the generated sample meeting with the HTTP transport pointed
at a local server started here (which captures every event), and a run that fails at its commit.

Every event is validated against the spec as the client ships it (``tests/openlineage_spec.py``)
and against our de-identification facet's schema; what they say is checked against the committed
lineage rows."""

from __future__ import annotations

import errno
import json
import threading
import uuid
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import modalign
import openlineage_spec as spec
from clips import write_tone
from modalign.pipeline import openlineage as ol
from modalign.pipeline.commits import CommitLog
from modalign.pipeline.runner import Runner
from modalign.pipeline.sample import PLANTED_PII
from modalign.schemas.config import RunConfig
from modalign.schemas.errors import EnvironmentFaultError

pytestmark = pytest.mark.integration

CUSTOM = {ol.DEID_FACET_SCHEMA_URL: ol.deid_facet_schema()}
KEY_ENV, KEY = "MODALIGN_TEST_OPENLINEAGE_KEY", "test-key-7f3a"


class _Capture(BaseHTTPRequestHandler):
    """Records (path, headers, event) of every POST on its server's ``captured`` list."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.captured.append((self.path, dict(self.headers), json.loads(body)))  # type: ignore[attr-defined]
        self.send_response(201)
        self.end_headers()

    def log_message(self, *_a) -> None:
        pass


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Capture)
    srv.captured = []  # type: ignore[attr-defined]
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _config(server, keys: Path, **kw) -> RunConfig:
    return RunConfig(key_store=keys, openlineage={"http": {"url": f"http://127.0.0.1:{server.server_address[1]}",
                                                           "api_key_env": KEY_ENV, "timeout_s": 10}}, **kw)


def _file_events(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / ol.EVENTS_DIR).iterdir())]


@pytest.fixture(scope="module")
def meeting(ray_local, sample_manifest, server, tmp_path_factory):
    """(OUT, events the server received, lineage rows) of one run of the sample meeting."""
    mp = pytest.MonkeyPatch()
    mp.setenv(KEY_ENV, KEY)
    out = tmp_path_factory.mktemp("ol-out") / "out"
    first = len(server.captured)
    try:
        summary = Runner(_config(server, out.parent / "keys"), out, progress=lambda _m: None).run(sample_manifest)
    finally:
        mp.undo()
    assert summary["counts"]["quarantined"] == 0
    received = server.captured[first:]
    rows = modalign.open(out).table("lineage_sources").to_table().to_pylist()
    return out, received, rows


def test_the_endpoint_receives_start_sessions_and_complete_of_one_run(meeting, sample_manifest):
    out, received, rows = meeting
    assert {p for p, _, _ in received} == {"/api/v1/lineage"}
    assert all(h.get("Authorization") == f"Bearer {KEY}" for _, h, _ in received)
    events = [e for _, _, e in received]
    for e in events:
        spec.validate(e, CUSTOM)
    run_id = str(uuid.UUID(hex=modalign.open(out).run["run_id"]))
    sid = "sample-meeting"
    assert [(e["eventType"], e["job"]["name"]) for e in events] == [
        ("START", "modalign.run"), ("START", f"modalign.run.session.{sid}"),
        ("COMPLETE", f"modalign.run.session.{sid}"), ("COMPLETE", "modalign.run")]
    assert {e["run"]["runId"] for e in events[::3]} == {run_id}
    assert {e["run"]["runId"] for e in events[1:3]} == {ol.session_uuid(run_id, sid)}
    assert all(e["run"]["facets"]["parent"]["run"]["runId"] == run_id for e in events[1:3])

    # inputs: the real sources, with the versions and hashes of their lineage rows
    complete = events[-1]
    by_path = {str(Path(r["source_uri"].removeprefix("file://"))): r for r in rows}
    assert {i["name"] for i in complete["inputs"]} == set(by_path) == {
        str((sample_manifest.parent / n).resolve()) for n in ("room.mp4", "lapel.wav", "slides.pdf")}
    for i in complete["inputs"]:
        v = i["facets"]["version"]
        assert (v["datasetVersion"], v["sha256"]) == (by_path[i["name"]]["source_version"],
                                                      by_path[i["name"]]["source_sha256"])
    assert {i["name"]: i["facets"]["version"]["datasetVersion"] for i in events[0]["inputs"]} == {
        n: r["source_version"] for n, r in by_path.items()}

    # outputs: every committed table, with its schema; the run's COMPLETE names the commit
    o = modalign.open(out)
    outputs = {Path(d["name"]).relative_to(out).as_posix(): d for d in complete["outputs"]}
    assert set(outputs) == {ol.TABLES[t].PATH for t in o.tables()}
    for t in o.tables():
        d = outputs[ol.TABLES[t].PATH]
        assert [f["name"] for f in d["facets"]["schema"]["fields"]] == ol.TABLES[t].schema().names
        assert d["facets"]["version"]["datasetVersion"] == str(o.version)
        assert d["outputFacets"]["outputStatistics"]["fileCount"] == len(o.files(t))
    vector = outputs["features"]["facets"]["columnLineage"]["fields"]["vector"]["inputFields"]
    assert {(Path(f["name"]).relative_to(out).as_posix(), f["field"]) for f in vector} == {
        ("events/video", "frame_jpeg"), ("events/audio", "mfcc"), ("events/pdf", "text")}


def test_the_deid_facets_count_what_the_lineage_rows_count(meeting):
    out, received, rows = meeting
    session_complete, complete = received[2][2], received[3][2]
    for event in (session_complete, complete):
        for d in event["outputs"]:
            table = next(t for t, r in ol.TABLES.items() if Path(d["name"]) == out / r.PATH)
            modality = ol.EVENT_TABLES.get(table)
            want: Counter = Counter()
            for r in rows:
                if modality in (None, r["modality"]):
                    for h in r["deid"]:
                        want[(r["modality"], h["method"], h["detector"])] += h["count"]
            facet = d["facets"][ol.DEID_FACET]
            assert Counter({(x["modality"], x["method"], x["detector"]): x["count"] for x in facet["removed"]}) == want
            assert facet["policy"]["tag"] == {r["policy"] for r in rows}.pop() == modalign.open(out).run["versions"]["policy"]
    pdf = next(d for d in complete["outputs"] if d["name"].endswith("events/pdf"))[
        "facets"][ol.DEID_FACET]
    assert sum(x["count"] for x in pdf["removed"]) >= 6  # the slides' planted names, e-mails and phones


def test_no_planted_personal_data_in_any_event_and_the_files_hold_the_same_events(meeting):
    out, received, _ = meeting
    texts = [json.dumps(e) for _, _, e in received]
    for _, value, _ in PLANTED_PII:
        for variant in {value, value.lower(), value.split()[0], value.replace(" ", "")}:
            assert all(variant not in t for t in texts), variant
    assert "subject-000" not in "".join(texts)
    files = _file_events(out)
    assert files == [e for _, _, e in received]  # the same events, in the same order
    assert not modalign.open(out).snapshot.under(ol.EVENTS_DIR)  # a log beside the commit, not in it


def test_a_run_that_fails_at_its_commit_emits_fail(ray_local, server, tmp_path, monkeypatch):
    import modalign.pipeline.runner as runner

    (tmp_path / "in").mkdir()
    write_tone(tmp_path / "in" / "tone.wav", seconds=1.0)
    out = tmp_path / "out"

    def read_only(*_a, **_k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(runner, "build_indexes", read_only)
    first = len(server.captured)
    with pytest.raises(EnvironmentFaultError):
        Runner(_config(server, tmp_path / "keys"), out, progress=lambda _m: None).run(tmp_path / "in")
    events = [e for _, _, e in server.captured[first:]]
    assert [e["eventType"] for e in events] == ["START", "START", "COMPLETE", "FAIL"]
    fail = events[-1]
    assert fail["job"]["name"] == "modalign.run" and fail["run"]["runId"] == events[0]["run"]["runId"]
    assert fail["run"]["facets"]["errorMessage"]["message"].startswith("[environment_fault]")
    for e in events:
        spec.validate(e, CUSTOM)
    assert _file_events(out) == events
    assert CommitLog.of(out).latest() is None  # nothing was committed
