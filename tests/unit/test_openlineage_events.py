"""OpenLineage events built from a synthetic lineage, checked against the spec (as the client
package ships it, ``tests/openlineage_spec.py``) and our de-identification facet's schema."""

from __future__ import annotations

import copy
import json
import logging
import time
import uuid
from collections import Counter
from pathlib import Path

import jsonschema
import pytest

import openlineage_spec as spec
from modalign.pipeline import openlineage as ol
from modalign.pipeline.commits import Snapshot
from modalign.pipeline.discovery import discover
from modalign.schemas.config import RunConfig
from modalign.schemas.errors import ConfigError, EnvironmentFaultError
from modalign.schemas.load import load_model
from modalign.schemas.tables import SourceLineageRow

pytestmark = pytest.mark.unit

RUN_ID = "1834101708f64e5a89d903f9069ca30b"
POLICY = RunConfig().policy.tag
FACE = "mediapipe-face-detection@0.10.21/full-range/tiles2+short-range+mtcnn@facenet-pytorch-2.6.0/0.9"
TEXT = "tesseract@5.3.0+spacy-en_core_web_sm@3.8.0+regex@4+names=35280,words=64005"
PII = "spacy-en_core_web_sm@3.8.0+regex@4+names=35280,words=64005"
CUSTOM = {ol.DEID_FACET_SCHEMA_URL: ol.deid_facet_schema()}


def _header(method: str, detector: str, count: int) -> dict:
    return {"policy": POLICY, "method": method, "detector": detector, "count": count, "threshold": 0.5}


def _row(source_id: str, uri: str, modality: str, deid: list[dict], session: str = "meet", **kw) -> SourceLineageRow:
    return SourceLineageRow(run_id=RUN_ID, session_id=session, source_id=source_id, source_uri=uri,
                            source_version=f"local:{len(uri)}:17", modality=modality, status="ingested", events=4,
                            operators="x@1", policy=POLICY, deid=deid, subjects=["subject-0001", "subject-0002"],
                            source_sha256="sha256:" + uri.encode().hex()[:64].ljust(64, "0"), **kw)


@pytest.fixture
def rows(tmp_path) -> list[SourceLineageRow]:
    inp = tmp_path / "in"
    return [
        _row("room", (inp / "room.mp4").as_uri(), "video", [_header("blur_permute", FACE, 25),
                                                            _header("blur_permute", TEXT, 7)]),
        _row("room.audio", (inp / "room.mp4").as_uri(), "audio", [_header("voiceanon@3/seg=4s", "none", 0)],
             track_of="room"),
        _row("lapel", (inp / "lapel.wav").as_uri(), "audio", [_header("voiceanon@3/seg=4s", "none", 0)]),
        _row("slides", (inp / "slides.pdf").as_uri(), "pdf", [_header("pseudonymise", PII, 8)]),
        _row("deck", (inp / "deck.pdf").as_uri(), "pdf", [_header("pseudonymise", PII, 3),
                                                          _header("keep", PII, 2)]),
    ]


FILES = ["events/video/meet/room-1834101708f6-00000.parquet", "events/audio/meet/lapel-1834101708f6-00000.parquet",
         "events/audio/meet/room.audio-1834101708f6-00000.parquet", "events/pdf/meet/slides-1834101708f6-00000.parquet",
         "events/pdf/meet/deck-1834101708f6-00000.parquet", "records/meet/1834101708f6.parquet",
         "ctal/log/meet/1834101708f6.parquet", "ctal/jsonl/meet/1834101708f6.jsonl",
         "ctal/summary/meet/1834101708f6.parquet", "features/efficientnet-lite0@1/frame/meet/room-183410170f6-00000.parquet",
         "lineage/sources/meet/183410170f6.parquet", "index/efficientnet-lite0@1__frame-183410170f6.faiss"]


def _event(rows, out: Path, event_type: str = "COMPLETE") -> dict:
    from openlineage.client.serde import Serde

    dumped = [r.model_dump() for r in rows]
    rid = ol.run_uuid(RUN_ID)
    e = ol.run_event(event_type, run_id=ol.session_uuid(rid, "meet"), namespace="modalign",
                     job_name="modalign.run.session.meet", inputs=ol.input_datasets(dumped),
                     outputs=ol.output_datasets(out, FILES, dumped, version="4"),
                     parent=(rid, "modalign", "modalign.run"), job_type="TASK")
    return json.loads(Serde.to_json(e))


def test_an_event_of_a_synthetic_lineage_is_valid_and_says_what_the_rows_say(rows, tmp_path):
    out = tmp_path / "out"
    ev = _event(rows, out)
    spec.validate(ev, CUSTOM)
    assert ev["eventType"] == "COMPLETE" and ev["schemaURL"].startswith("https://openlineage.io/spec/2-0-2/")
    rid = str(uuid.UUID(hex=RUN_ID))
    assert ev["run"]["facets"]["parent"]["run"]["runId"] == rid and ev["run"]["runId"] == ol.session_uuid(rid, "meet")
    assert ev["run"]["runId"] != rid and uuid.UUID(ev["run"]["runId"]).version == 5

    # inputs: one per file (the video's own sound shares the video's), versions from the rows
    inputs = {i["name"]: i["facets"]["version"] for i in ev["inputs"]}
    assert sorted(inputs) == sorted(str(tmp_path / "in" / n) for n in ("room.mp4", "lapel.wav", "slides.pdf", "deck.pdf"))
    assert {i["namespace"] for i in ev["inputs"]} == {"file"}
    by_uri = {Path(r.source_uri.removeprefix("file://")).as_posix(): r for r in rows}
    for name, v in inputs.items():
        assert v["datasetVersion"] == by_uri[name].source_version and v["sha256"] == by_uri[name].source_sha256

    # outputs: one per table folder (not ctal/jsonl, not the FAISS index), with schema facets
    outputs = {o["name"]: o for o in ev["outputs"]}
    tables = {"events_video", "events_audio", "events_pdf", "records", "ctal", "ctal_summary", "features",
              "lineage_sources"}
    assert set(outputs) == {str(out / ol.TABLES[t].PATH) for t in tables}
    for t in tables:
        o = outputs[str(out / ol.TABLES[t].PATH)]
        assert [f["name"] for f in o["facets"]["schema"]["fields"]] == ol.TABLES[t].schema().names
        assert o["facets"]["version"]["datasetVersion"] == "4"
        assert o["outputFacets"]["outputStatistics"]["fileCount"] == sum(ol.table_of(f) == t for f in FILES)
    video_fields = {f["name"]: f for f in outputs[str(out / "events/video")]["facets"]["schema"]["fields"]}
    assert [f["name"] for f in video_fields["deid"]["fields"]] == ["policy", "method", "detector", "count", "threshold"]
    assert video_fields["face_boxes"]["type"].startswith("list<") and video_fields["t_ns"]["type"] == "int64"


def _removed(facet: dict) -> Counter:
    return Counter({(r["modality"], r["method"], r["detector"]): r["count"] for r in facet["removed"]})


def test_the_deid_facet_counts_equal_the_lineage_headers_of_the_rows_each_table_derives_from(rows, tmp_path):
    out = tmp_path / "out"
    outputs = {o["name"]: o["facets"] for o in _event(rows, out)["outputs"]}
    want: dict[str, Counter] = {}
    for table, modality in [("events_video", "video"), ("events_audio", "audio"), ("events_pdf", "pdf"),
                            ("records", None), ("features", None)]:
        c: Counter = Counter()
        for r in rows:
            if modality in (None, r.modality):
                for h in r.deid:
                    c[(r.modality, h.method, h.detector)] += h.count
        want[table] = c
    for table, c in want.items():
        facet = outputs[str(out / ol.TABLES[table].PATH)][ol.DEID_FACET]
        assert _removed(facet) == c, table
        assert facet["sources"] == sum(1 for r in rows if table not in ol.EVENT_TABLES
                                       or r.modality == ol.EVENT_TABLES[table])
        assert facet["policy"] == {"tag": POLICY, "id": RunConfig().policy.policy_id,
                                   "version": RunConfig().policy.version, "digest": RunConfig().policy.digest}
    pdf = outputs[str(out / "events/pdf")][ol.DEID_FACET]
    assert _removed(pdf)[("pdf", "pseudonymise", PII)] == 11 and _removed(pdf)[("pdf", "keep", PII)] == 2
    assert pdf["methods"] == ["keep", "pseudonymise"]
    video = outputs[str(out / "events/video")][ol.DEID_FACET]
    assert {(d["name"], d["version"]) for d in video["detectors"]} == {
        ("mediapipe-face-detection", "0.10.21/full-range/tiles2+short-range"),
        ("mtcnn", "facenet-pytorch-2.6.0/0.9"), ("tesseract", "5.3.0"),
        ("spacy-en_core_web_sm", "3.8.0"), ("regex", "4+names=35280,words=64005")}


def test_the_deid_facet_holds_no_personal_data_and_its_schema_refuses_any(rows, tmp_path):
    ev = _event(rows, tmp_path / "out")
    text = json.dumps([o["facets"][ol.DEID_FACET] for o in ev["outputs"]])
    assert "subject-0001" not in json.dumps(ev) and "subject" not in text  # subjects never leave lineage rows
    schema = ol.deid_facet_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    facet = ev["outputs"][0]["facets"][ol.DEID_FACET]
    checker = spec._checker()
    for bad in ({"pseudonyms": ["<PERSON_3f9a1c2b>"]}, {"methods": ["Clara Hartmann"]},
                {"removed": [{"modality": "pdf", "method": "x", "detector": "y", "count": 1, "text": "Clara"}]},
                {"policy": {**facet["policy"], "digest": "not-hex!"}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.Draft202012Validator(schema, format_checker=checker).validate({**facet, **bad})


def test_column_lineage_names_real_columns_and_follows_derivations(rows, tmp_path):
    for table, columns in ol.COLUMN_LINEAGE.items():
        names = ol.TABLES[table].schema().names
        for column, derivations in columns.items():
            assert column in names, (table, column)
            for src, src_col, subtype, _ in derivations:
                assert subtype in ("IDENTITY", "TRANSFORMATION", "AGGREGATION")
                if src.startswith("source:"):
                    assert ol.SOURCE_FIELD[src.split(":")[1]] == src_col
                else:
                    assert src_col in ol.TABLES[src].schema().names, (src, src_col)
    out = tmp_path / "out"
    outputs = {o["name"]: o["facets"] for o in _event(rows, out)["outputs"]}
    vector = outputs[str(out / "features")]["columnLineage"]["fields"]["vector"]["inputFields"]
    assert {(f["name"], f["field"]) for f in vector} == {
        (str(out / "events/video"), "frame_jpeg"), (str(out / "events/audio"), "mfcc"), (str(out / "events/pdf"), "text")}
    text = outputs[str(out / "events/pdf")]["columnLineage"]["fields"]["text"]["inputFields"]
    assert {(f["name"], f["field"]) for f in text} == {(str(tmp_path / "in" / n), "pages") for n in ("slides.pdf", "deck.pdf")}
    assert all(t["masking"] for f in text for t in f["transformations"])  # pseudonymised
    mfcc = outputs[str(out / "events/audio")]["columnLineage"]["fields"]["mfcc"]["inputFields"]
    assert all(t["masking"] for f in mfcc for t in f["transformations"])  # anonymised before MFCC
    kept = [r.model_copy(update={"deid": [h.model_copy(update={"method": "waveform_dropped"}) for h in r.deid]})
            if r.modality == "audio" else r for r in rows]  # voice policy keep_mfcc: the voice is still in the MFCCs
    outputs = {o["name"]: o["facets"] for o in _event(kept, out)["outputs"]}
    mfcc = outputs[str(out / "events/audio")]["columnLineage"]["fields"]["mfcc"]["inputFields"]
    assert mfcc and not any(t["masking"] for f in mfcc for t in f["transformations"])
    records = outputs[str(out / "records")]["columnLineage"]["fields"]["event_id"]["inputFields"]
    assert {f["name"] for f in records} == {str(out / p) for p in ("events/video", "events/audio", "events/pdf")}
    assert "drift_alarms" not in {Path(n).name for n in outputs}  # no file of it: not an output, not referenced


def test_every_facet_is_checked_against_the_schema_it_names(rows, tmp_path):
    ev = _event(rows, tmp_path / "out")
    for mutate in (lambda e: e["run"].__setitem__("runId", "run-1"),
                   lambda e: e["inputs"][0]["facets"]["version"].pop("datasetVersion"),
                   lambda e: e["outputs"][0]["facets"]["schema"]["fields"][0].pop("name"),
                   lambda e: e["outputs"][0]["facets"][ol.DEID_FACET]["removed"][0].__setitem__("count", -1),
                   lambda e: e["run"]["facets"]["parent"]["job"].pop("name"),
                   lambda e: e.__setitem__("eventTime", "2026-12-01"),
                   lambda e: e["job"]["facets"]["jobType"].__setitem__("_schemaURL", "https://example.org/x.json")):
        bad = copy.deepcopy(ev)
        mutate(bad)
        with pytest.raises(jsonschema.ValidationError):
            spec.validate(bad, CUSTOM)


def _session(tmp_path: Path):
    inp = tmp_path / "in"
    inp.mkdir()
    for name in ("a.wav", "b.wav"):
        (inp / name).write_bytes(b"RIFF0000")
    (inp / "manifest.yaml").write_text("session_id: s1\nsources:\n  - {id: a, uri: a.wav, modality: audio}\n"
                                       "  - {id: b, uri: b.wav, modality: audio}\n")
    return discover(inp / "manifest.yaml")


def _lineage_rows(sessions) -> list[SourceLineageRow]:
    s = sessions[0]
    return [_row(spec_.id, s.resolve(spec_).as_uri(), "audio", [_header("voiceanon@3", "none", 0)], session="s1")
            for spec_ in s.manifest.sources]


def _files(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / ol.EVENTS_DIR).iterdir())]


def test_a_run_writes_one_atomic_file_per_event_whose_names_sort_by_time(tmp_path):
    sessions = _session(tmp_path)
    out = tmp_path / "out"
    run = ol.RunLineage(RunConfig().openlineage, out, RUN_ID)
    run.start(sessions)
    run.session_done("s1", _lineage_rows(sessions), ["events/audio/s1/a-1.parquet", "records/s1/1.parquet"])
    run.complete(Snapshot(version=1, run_id=RUN_ID, committed_at="", sessions={
        "s1": {"run_id": RUN_ID, "files": ["events/audio/s1/a-1.parquet", "records/s1/1.parquet"]},
        "old": {"run_id": "ffffffffffffffffffffffffffffffff", "files": ["events/pdf/old/x.parquet"]}}))
    run.end(RuntimeError("after the end"))  # nothing: the run is over
    names = sorted(p.name for p in (out / ol.EVENTS_DIR).iterdir())
    assert len(names) == 4 and not any(n.startswith(".") for n in names)  # no temporary file left
    events = _files(out)
    assert [(e["eventType"], e["job"]["name"]) for e in events] == [
        ("START", "modalign.run"), ("START", "modalign.run.session.s1"),
        ("COMPLETE", "modalign.run.session.s1"), ("COMPLETE", "modalign.run")]
    assert [e["eventTime"] for e in events] == sorted(e["eventTime"] for e in events)
    rid = str(uuid.UUID(hex=RUN_ID))
    assert events[0]["run"]["runId"] == events[3]["run"]["runId"] == rid
    assert events[1]["run"]["runId"] == events[2]["run"]["runId"] == ol.session_uuid(rid, "s1")
    assert all(e["run"]["facets"]["parent"]["run"]["runId"] == rid for e in events[1:3])
    start_inputs = {i["name"]: i["facets"]["version"] for i in events[0]["inputs"]}
    assert set(start_inputs) == {str((tmp_path / "in" / n).resolve()) for n in ("a.wav", "b.wav")}
    assert all("sha256" not in v for v in start_inputs.values())  # not read yet at START
    assert all("sha256" in i["facets"]["version"] for i in events[3]["inputs"])
    assert {Path(o["name"]).name for o in events[3]["outputs"]} == {"audio", "records"}  # the run's, not "old"'s
    for e in events:
        spec.validate(e, CUSTOM)


def test_fail_and_abort_end_the_run_and_its_unfinished_sessions(tmp_path):
    sessions = _session(tmp_path)
    for error, kind in ((EnvironmentFaultError("cannot write /x (Read-only file system)"), "FAIL"),
                        (KeyboardInterrupt(), "ABORT")):
        out = tmp_path / kind
        run = ol.RunLineage(RunConfig().openlineage, out, uuid.uuid4().hex)
        run.start(sessions)
        run.end(error)
        events = _files(out)
        assert [(e["eventType"], e["job"]["name"]) for e in events] == [
            ("START", "modalign.run"), ("START", "modalign.run.session.s1"),
            (kind, "modalign.run.session.s1"), (kind, "modalign.run")]
        assert len({e["run"]["runId"] for e in events}) == 2
        for e in events:
            spec.validate(e, CUSTOM)
    assert events[-1]["run"]["facets"]["errorMessage"]["message"] == "KeyboardInterrupt (see the run's log)"
    failed = _files(tmp_path / "FAIL")[-1]["run"]["facets"]["errorMessage"]
    assert failed["message"].startswith("[environment_fault] cannot write /x") and failed["programmingLanguage"] == "PYTHON"
    # any other exception: its type only (its text may quote anything, a name in a document say)
    out = tmp_path / "other"
    run = ol.RunLineage(RunConfig().openlineage, out, uuid.uuid4().hex)
    run.end(ValueError("unexpected 'Clara Hartmann'"))
    assert "Clara" not in (out / ol.EVENTS_DIR).joinpath(sorted(p.name for p in (out / ol.EVENTS_DIR).iterdir())[-1]).read_text()


def test_a_dead_http_endpoint_is_a_warning_and_the_file_events_are_kept(tmp_path, caplog):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = RunConfig(openlineage={"http": {"url": f"http://127.0.0.1:{port}", "timeout_s": 1, "retries": 0}}).openlineage
    sessions = _session(tmp_path)
    out = tmp_path / "out"
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="modalign"):
        run = ol.RunLineage(cfg, out, RUN_ID)
        run.start(sessions)
        run.session_done("s1", _lineage_rows(sessions), ["records/s1/1.parquet"])
        run.end(EnvironmentFaultError("disk full"))
    assert time.monotonic() - started < 10
    warnings = [r for r in caplog.records if "HTTP endpoint" in r.getMessage()]
    assert len(warnings) == 1 and "environment fault" in warnings[0].getMessage()  # tried once, then file only
    assert [e["eventType"] for e in _files(out)] == ["START", "START", "COMPLETE", "FAIL"]


def test_an_unwritable_event_folder_never_fails_the_run(tmp_path, caplog):
    out = tmp_path / "out"
    (out / "lineage").mkdir(parents=True)
    (out / ol.EVENTS_DIR).write_text("a file where the folder should be")
    with caplog.at_level(logging.WARNING, logger="modalign"):
        run = ol.RunLineage(RunConfig().openlineage, out, RUN_ID)
        run.start(_session(tmp_path))
        run.end(EnvironmentFaultError("read-only"))
    assert any("could not write OpenLineage event" in r.getMessage() for r in caplog.records)


def test_the_config_section_is_bounded_and_strict(tmp_path):
    cfg = RunConfig(openlineage={"namespace": "prod", "job_name": "meetings.nightly",
                                 "http": {"url": "https://marquez.internal:5000", "api_key_env": "OL_KEY"}})
    assert cfg.openlineage.http.timeout_s == 5.0 and cfg.openlineage.file
    for text, field in (("openlineage: {http: {url: 'http://user:secret@host'}}", "openlineage.http.url"),
                        ("openlineage: {http: {url: 'file:///etc/passwd'}}", "openlineage.http.url"),
                        ("openlineage: {http: {url: 'http://h', timeout_s: 0}}", "openlineage.http.timeout_s"),
                        ("openlineage: {http: {url: 'http://h', retries: 100}}", "openlineage.http.retries"),
                        ("openlineage: {http: {url: 'http://h', api_key: 'k'}}", "openlineage.http.api_key"),
                        ("openlineage: {job_name: 'a b'}", "openlineage.job_name"),
                        ("openlineage: {transport: file}", "openlineage.transport")):
        (tmp_path / "c.yaml").write_text(text + "\n")
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_model(RunConfig, tmp_path / "c.yaml")


def test_other_writers_emit_their_own_run_event(tmp_path):
    out = tmp_path / "out"
    rid = ol.emit_erasure(out, "0f" * 16, ["records/meet/abc.parquet", "events/pdf/meet/x.parquet", "index/m__roi.faiss"])
    (e,) = _files(out)
    spec.validate(e, CUSTOM)
    assert e["eventType"] == "COMPLETE" and e["job"]["name"] == "modalign.run.erasure" and e["run"]["runId"] == rid
    assert {Path(o["name"]).relative_to(out).as_posix() for o in e["outputs"]} == {"records", "events/pdf"}
    assert all(ol.DEID_FACET not in o["facets"] for o in e["outputs"])  # it knows no sources: says nothing of them
    assert rid == ol.run_uuid("0f" * 16)
    assert ol.emit(out, "START", job_name="x", run_id="not-hex", config=RunConfig(
        openlineage={"enabled": False}).openlineage) == ol.run_uuid("not-hex")
    assert len(_files(out)) == 1  # disabled: nothing written
