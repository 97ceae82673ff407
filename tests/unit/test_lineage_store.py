"""The lineage store and its queries over a committed OUT written by ``benchmarks/lineage.py``'s
generator (the project's writers and commit protocol, no Ray): ID parsing, committed files
only, ``trace`` of each ID kind, ``access`` against a direct pyarrow read, the HTML report,
and per-source subjects in the manifest."""

from __future__ import annotations

import html.parser
import importlib.util
import json
import shutil
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.dataset as ds
import pytest

from modalign.pipeline.cli import main
from modalign.pipeline.lineage import LineageStore, access, parse_id, render_access_html, trace
from modalign.schemas.config import RunConfig
from modalign.schemas.errors import ConfigError
from modalign.schemas.manifest import Manifest
from modalign.schemas.policy import DeidPolicy

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
LEGAL = "<script>alert('x')</script> & GDPR Art. 6(1)(f)"


def _bench():
    spec = importlib.util.spec_from_file_location("lineage_bench", ROOT / "benchmarks" / "lineage.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    """(bench module, OUT, what it planted): 6 sessions, a policy whose legal basis is markup."""
    bench = _bench()
    out = tmp_path_factory.mktemp("lineage") / "out"
    config = RunConfig(policy=DeidPolicy(legal_basis=LEGAL))
    planted = bench.generate(out, 6, config=config)
    return bench, out, planted


def _committed(out: Path, table: str) -> ds.Dataset:
    import modalign

    return modalign.open(out).table(table)


def test_ids_parse_into_their_kinds(tmp_path):
    out = tmp_path / "out"
    assert parse_id("8022945079494116854", out).feature_id == 8022945079494116854
    t = parse_id("sample-meeting:42", out)
    assert (t.kind, t.session_id, t.tick) == ("tick", "sample-meeting", 42)
    e = parse_id("sample-meeting/room_video.audio/mfcc/7", out)
    assert (e.kind, e.session_id, e.source_id) == ("event", "sample-meeting", "room_video.audio")
    assert parse_id("records/s/ab.parquet", out).path == "records/s/ab.parquet"
    assert parse_id("./records//s/ab.parquet", out).path == "records/s/ab.parquet"
    assert parse_id(str(out / "records" / "s" / "ab.parquet"), out).path == "records/s/ab.parquet"
    for bad in ("../elsewhere.parquet", str(tmp_path / "other" / "x.parquet"), "0", "", "records/../../x"):
        with pytest.raises(ConfigError):
            parse_id(bad, out)


def test_views_read_the_committed_files_only(gen):
    _, out, _ = gen
    committed = _committed(out, "events_pdf").count_rows()
    stray_dir = out / "events" / "pdf" / "bench-0001"
    stray = stray_dir / "slides-ffffffffffff-00000.parquet"  # what a crashed attempt would leave
    shutil.copy(next(stray_dir.glob("*.parquet")), stray)
    lin = out / "lineage" / "sources" / "bench-0001"
    stray_lin = lin / "ffffffffffff.parquet"
    shutil.copy(next(lin.glob("*.parquet")), stray_lin)
    try:
        assert ds.dataset(out / "events" / "pdf", format="parquet").count_rows() == committed + 4  # a listing sees it
        with LineageStore(out) as store:
            assert store.query(f"SELECT count(*) AS n FROM {store.view('events_pdf')}")[0]["n"] == committed
            assert store.query(f"SELECT count(*) AS n FROM {store.view('lineage_sources')}")[0]["n"] == 6 * 4
            assert all("ffffffffffff" not in f for f in store.snapshot.files())
        assert access(out, "subject-0000")["counts"]["sources"] == 12  # sessions 0-2, each source once
    finally:
        stray.unlink()
        stray_lin.unlink()


def test_trace_of_an_event_names_its_source_policy_removals_and_model(gen):
    bench, out, planted = gen
    res = trace(out, "bench-0004/slides/block/0")
    assert res["kind"] == "event" and len(res["origins"]) == 1
    o = res["origins"][0]
    assert o["source_uri"] == planted["sources"]["bench-0004"]["slides"] == "file:///rec/bench-0004/slides.pdf"
    assert o["source_version"] == "local:1004:4" and o["run_id"] == planted["run_id"]
    assert o["policy"]["tag"] == planted["policy"] and o["policy"]["content"]["legal_basis"] == LEGAL
    assert [op["kind"] for op in o["operators"]] == ["pdf_text", "text_pii"] and o["operators"][1]["version"] == "0.2.0"
    assert o["model_ids"] == [bench.TEXT_MODEL] and o["detectors"] == [bench.TEXT_DETECTOR]
    assert o["removed"] == {"personal_data": {"person": 2}}
    ev = res["target"]["event"]
    assert ev["pii_counts"] == [{"kind": "person", "count": 1}] and "text" not in ev and "words" not in ev
    assert [p["pseudonym"] for p in ev["pseudonyms"]] == [f"<PERSON_{4 * 31:08x}>"]
    want = sorted(fid for fid, f in planted["features"].items() if f["event_id"] == "bench-0004/slides/block/0")
    assert [f["feature_id"] for f in res["target"]["features"]] == want and len(want) == 1
    assert res["target"]["features"][0]["index_file"].startswith("index/all-minilm-l6-v2@")
    assert [r["tick_index"] for r in res["target"]["timeline"]] == list(range(25))  # page 0 is held 1 s


def test_trace_of_a_feature_id_and_a_timeline_row(gen):
    bench, out, planted = gen
    fid, f = next((k, v) for k, v in planted["features"].items()
                  if v["session_id"] == "bench-0002" and v["source_id"] == "room_video" and v["event_id"].endswith("/25")
                  and v["model_id"] == bench.IMAGE_MODEL)
    res = trace(out, str(fid))
    assert res["target"]["feature"]["feature_id"] == fid and res["target"]["feature"]["event_id"] == f["event_id"]
    (o,) = res["origins"]
    assert (o["session_id"], o["source_id"], o["model_ids"]) == ("bench-0002", "room_video", [bench.IMAGE_MODEL])
    assert o["removed"] == {"face_boxes": 50, "frame_text_regions": 50}
    assert res["target"]["event"]["face_boxes"][0]["x0"] == 425  # the planted box of frame 25
    assert res["target"]["event"]["deid"]["detector"] == bench.FACE_DETECTOR

    tick = trace(out, "bench-0002:5")
    rows = {r["source_id"]: r for r in tick["target"]["timeline"]}
    assert set(rows) == {"room_video", "room_video.audio", "lapel", "slides"}
    assert rows["lapel"]["decision"] == "gap" and rows["lapel"]["event"] is None
    assert rows["room_video"]["event"]["event_id"] == "bench-0002/room_video/frame/5"
    assert [c["event_id"] for c in tick["target"]["ctal"]] == ["bench-0002/ctal/5"]
    lapel = next(o for o in tick["origins"] if o["source_id"] == "lapel")
    assert lapel["clock"]["method"] == "estimated" and lapel["clock"]["offset_ns"] == bench.LAPEL_OFFSET_NS
    assert "room_video" in lapel["clock"]["obtained"] and lapel["clock"]["ctal_summary"]["offset_confidence"] == 0.97
    assert lapel["subjects"] == ["subject-0000", "speaker-02"]


def test_trace_of_output_files(gen):
    bench, out, _ = gen
    with LineageStore(out) as store:
        rec = store.files("records", ["bench-0003"])[0]
        index = next(f for f in store.snapshot.shared if "mfcc-stats" in f)
    by_rel = trace(out, rec)
    assert by_rel["target"]["file"] == {"path": rec, "table": "records", "session_id": "bench-0003", "rows": 200}
    assert {o["source_id"] for o in by_rel["origins"]} == {"room_video", "room_video.audio", "lapel", "slides"}
    assert trace(out, str(out / rec))["target"] == by_rel["target"]  # absolute inside OUT
    jsonl = next(f for f in store.snapshot.sessions["bench-0003"]["files"] if f.startswith("ctal/jsonl/"))
    assert trace(out, jsonl)["target"]["file"]["rows"] == 19  # the lapel's gaps: ticks 0-18 (730 ms late)
    ix = trace(out, index)
    assert ix["target"]["file"]["vectors"] == 6 * 2 * 2 and ix["target"]["file"]["sessions"] == 6
    assert {o["source_id"] for o in ix["origins"]} == {"room_video.audio", "lapel"}
    assert all(o["model_ids"] == [bench.AUDIO_MODEL] for o in ix["origins"])


def test_the_human_trace_and_the_json_one_say_the_same(gen, capsys):
    bench, out, planted = gen
    assert main(["lineage", "trace", str(out), "bench-0001:2"]) == 0
    text = capsys.readouterr().out
    for want in ("tick 2 (80000000 ns) lapel: gap", "face boxes 402,20,542,170", planted["sources"]["bench-0001"]["lapel"],
                 f"policy    {planted['policy']}  (content from commit 1)", "estimated by cross-correlation against the "
                 "audio of room_video (confidence 0.97)", bench.IMAGE_MODEL, "video_frames@0.2.0 -> face_blur@0.6.0"):
        assert want in text, want
    assert main(["lineage", "trace", str(out), "bench-0001:2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["kind"] == "tick" and len(res["origins"]) == 4 and res["target"]["ctal"][0]["tick_index"] == 2


def test_a_policy_of_an_earlier_commit_is_found_in_its_record(gen, tmp_path):
    """A session carried over from an earlier run keeps that run's policy; its content comes
    from the commit record of that run, not from the latest run's summary."""
    bench, out, planted = gen
    from modalign.pipeline.commits import CommitLog

    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    log = CommitLog.of(copy)
    base = log.latest()
    newer = DeidPolicy(version="6")
    summary = dict(base.summary, config=RunConfig(policy=newer).model_dump(mode="json"))
    log.commit(base, run_id="f" * 32, sessions={}, shared=list(base.shared), summary=summary)
    (o,) = trace(copy, "bench-0000/slides/block/0")["origins"]
    assert o["policy"]["tag"] == planted["policy"] != newer.tag
    assert o["policy"]["content_from"] == "commit 1" and o["policy"]["content"]["legal_basis"] == LEGAL


@pytest.mark.parametrize("bad", ["bench-0001/slides/block/7", "bench-9999/lapel/mfcc/0", "12345", "bench-0001:999",
                                 "records/bench-0001/nope.parquet", "cache"])
def test_an_unknown_id_fails_naming_it(gen, bad, capsys):
    _, out, _ = gen
    with pytest.raises(ConfigError, match="unknown ID"):
        trace(out, bad)
    assert main(["lineage", "trace", str(out), bad]) == 1
    err = capsys.readouterr().err
    assert f"unknown ID {bad!r}" in err and "SESSION:TICK" in err


def _direct(out: Path, table: str, pairs: set[tuple[str, str]], column: str) -> list:
    t = _committed(out, table).to_table(columns=["session_id", "source_id", column])
    return sorted((v for s, src, v in zip(*(t.column(c).to_pylist() for c in ("session_id", "source_id", column)))
                   if (s, src) in pairs), key=lambda v: (v is None, v))


def test_access_of_a_session_subject_lists_exactly_its_sessions_rows(gen):
    bench, out, planted = gen
    rep = access(out, "subject-0001")  # sessions 3, 4, 5
    assert rep["sessions"] == ["bench-0003", "bench-0004", "bench-0005"]
    pairs = {(s, src) for s in rep["sessions"] for src in planted["sources"][s]}
    assert {(o["session_id"], o["source_id"]) for o in rep["sources"]} == pairs
    for table in ("events_video", "events_audio", "events_pdf"):
        assert sorted(e["event_id"] for e in rep["events"] if e["table"] == table) == _direct(out, table, pairs, "event_id")
    timeline = sorted((r["event_id"] for r in rep["timeline"]), key=lambda v: (v is None, v))
    assert timeline == _direct(out, "records", pairs, "event_id") and len(timeline) == 3 * 200
    fids = _direct(out, "features", pairs, "feature_id")
    assert sorted(f["feature_id"] for f in rep["features"]) == fids and len(fids) == 3 * 12
    assert sorted(i for ix in rep["faiss"] for i in ix["feature_ids"]) == fids
    assert all(ix["index_file"].startswith("index/") for ix in rep["faiss"])
    keys = set(_direct(out, "features", pairs, "cache_key"))
    assert {c["cache_key"] for c in rep["cache"]} == keys and all(c["segment"].startswith("cache/") for c in rep["cache"])
    ctal = _committed(out, "ctal").to_table(filter=pc.field("session_id").isin(rep["sessions"]))
    assert sorted(c["event_id"] for c in rep["ctal"]) == sorted(ctal.column("event_id").to_pylist())
    assert [p["pseudonym"] for p in rep["pseudonyms"]] == sorted(
        f"<PERSON_{(i * 31 + p) % 2**32:08x}>" for i in (3, 4, 5) for p in (0, 1))
    assert {f["path"].split("/")[0] for fs in rep["files"].values() for f in fs} >= {"events", "records", "features"}
    assert rep["files"]["lineage_sources"] == [{"path": f, "rows": 4} for f in sorted(
        {o["lineage_file"] for o in rep["sources"]})]
    assert all(o["policy"]["tag"] == planted["policy"] for o in rep["sources"])


def test_access_of_a_source_subject_lists_that_source_only(gen):
    _, out, planted = gen
    rep = access(out, "speaker-01")
    assert [(o["session_id"], o["source_id"]) for o in rep["sources"]] == [("bench-0001", "lapel")]
    pairs = {("bench-0001", "lapel")}
    assert sorted(e["event_id"] for e in rep["events"]) == _direct(out, "events_audio", pairs, "event_id")
    assert {r["source_id"] for r in rep["timeline"]} == {"lapel"} and len(rep["timeline"]) == 50
    assert {f["source_id"] for f in rep["features"]} == {"lapel"} and rep["pseudonyms"] == []
    for name in ("Clara Hartmann", "clara@example.com", ""):  # a name is refused, and not repeated
        with pytest.raises(ConfigError, match="not a data-subject id") as err:
            access(out, name)
        assert name not in str(err.value) or not name
    nobody = access(out, "subject-4242")
    assert nobody["sources"] == [] and nobody["events"] == [] and set(nobody["counts"].values()) == {0}


class _Parser(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.attrs: list[tuple[str, str | None]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs += attrs

    def handle_data(self, data):
        self.text.append(data)


def test_the_html_report_is_escaped_and_self_contained(gen, tmp_path):
    _, out, _ = gen
    target = tmp_path / "report" / "access.html"
    assert main(["lineage", "access", str(out), "--subject", "subject-0001", "--format", "html",
                 "--out", str(target)]) == 0
    page = target.read_text(encoding="utf-8")
    assert page == render_access_html(access(out, "subject-0001"))
    p = _Parser()
    p.feed(page)
    assert "script" not in p.tags and not any(k in ("src", "href") for k, _ in p.attrs)  # nothing runs or loads
    assert "&lt;script&gt;" in page and LEGAL in "".join(p.text)  # the legal basis shown, as text
    assert "bench-0004/slides/block/0" in page and "&lt;PERSON_" in page
    assert main(["lineage", "access", str(out), "--subject", "subject-0001", "--out", str(out / "a.html")]) == 1
    assert not (out / "a.html").exists()


def test_access_json_on_the_command_line(gen, capsys):
    _, out, _ = gen
    assert main(["lineage", "access", str(out), "--subject", "speaker-01", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["subject"] == "speaker-01" and rep["counts"]["sources"] == 1 and rep["counts"]["faiss_ids"] == 2


def test_sources_may_list_subjects_of_their_own():
    m = Manifest.model_validate({"session_id": "s", "subjects": ["subject-0001"], "sources": [
        {"id": "cam", "uri": "cam.mp4", "modality": "video", "subjects": ["subject-0002", "subject-0001"]},
        {"id": "mic", "uri": "mic.wav", "modality": "audio"}]})
    got = {s.id: m.subjects_of(s) for s in m.ingest_sources()}
    assert got == {"cam": ("subject-0001", "subject-0002"), "cam.audio": ("subject-0001", "subject-0002"),
                   "mic": ("subject-0001",)}
    old = Manifest.model_validate({"session_id": "s", "sources": [{"id": "a", "uri": "a.wav", "modality": "audio"}]})
    assert old.sources[0].subjects == []  # manifests without the field stay valid
    for bad in (["Clara Hartmann"], ["clara@example.com"], ["subject-1", "subject-1"], [""]):
        with pytest.raises(ValueError, match="sources.0.subjects"):
            Manifest.model_validate({"session_id": "s", "sources": [
                {"id": "a", "uri": "a.wav", "modality": "audio", "subjects": bad}]})


def test_the_runner_hands_each_source_its_subjects(tmp_path):
    from modalign.pipeline.discovery import discover
    from modalign.pipeline.runner import Runner, _SessionState
    from modalign.pipeline.worker import lineage_row, source_lineage

    (tmp_path / "in").mkdir()
    for name in ("a.wav", "b.wav"):
        (tmp_path / "in" / name).write_bytes(b"RIFF" + b"\0" * 64)
    (tmp_path / "in" / "m.yaml").write_text(
        "session_id: s\nsubjects: [subject-0001]\nsources:\n"
        "  - {id: a, uri: a.wav, modality: audio, subjects: [subject-0009]}\n  - {id: b, uri: b.wav, modality: audio}\n")
    (session,) = discover(tmp_path / "in")
    runner = Runner(RunConfig(key_store=tmp_path / "keys"), tmp_path / "out")
    st = _SessionState(session, aligner=None)
    jobs = {spec.id: runner._job(st, spec) for spec in session.manifest.ingest_sources()}
    assert jobs["a"].subjects == ("subject-0001", "subject-0009") and jobs["b"].subjects == ("subject-0001",)
    row = lineage_row(jobs["a"], source_lineage(jobs["a"], "p@1"), jobs["a"].spec.clock, status="ingested")
    assert row.subjects == ["subject-0001", "subject-0009"]
