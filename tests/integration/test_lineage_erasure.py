"""``modalign lineage erase | verify`` on a real run (the ``lineage_run`` fixture of
``conftest.py``, erased on a copy): sessions sharing one subject.

The generated sample meeting lists subject-0001 and subject-0002 for every source; the
two-recorder audio session ``solo`` lists subject-0003 for both recorders and subject-0001
(and subject-0007) for its room recorder alone; the session ``deck`` lists no subject. Erasing
subject-0001 removes every source of the meeting and solo's room recorder; solo's lapel
recorder (subject-0003 only) stays, row for row. The deck, a copy of the meeting's slides that
merely mentions subject-0001 by name, goes too: the erasure finds it through the subject
registry in (the copy of) the key store.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import modalign
from modalign.operators.cache.index import FeatureIndex
from modalign.pipeline.cli import main
from modalign.pipeline.layout import TABLES
from modalign.pipeline.lineage import LineageStore, access, report_of
from modalign.pipeline.runner import Runner
from modalign.schemas.config import RunConfig

pytestmark = pytest.mark.integration

S = "subject-0001"
ERASED = {("sample-meeting", s) for s in ("room_video", "room_video.audio", "lapel", "slides")} | {("solo", "room")}
MENTIONED = {("deck", "slides")}  # lists no subject; found through the registry, erased whole
GONE = ERASED | MENTIONED
MONITOR_TABLES = {"monitor_windows", "monitor_alarms", "monitor_quality"}  # rebuilt over what is left: test_the_monitor_...


@pytest.fixture(scope="module")
def planted(lineage_run) -> dict:
    """The shared run: its OUT (left as it is), INPUT, key store, and what access lists for S."""
    out = lineage_run.out
    with LineageStore(out) as store:
        mentioned = report_of(store, MENTIONED)  # the rows of the deck, which access (no registry) does not list
    return {"out": out, "input": lineage_run.input, "keys": lineage_run.keys, "access": access(out, S),
            "mentioned": mentioned, "tables": _tables(out)}


def _tables(out: Path) -> dict[str, list[dict]]:
    output = modalign.open(out)
    return {name: output.table(name).to_table().to_pylist() for name in TABLES}


def _erased_row(table: str, r: dict, pairs: set[tuple[str, str]] = GONE) -> bool:
    """Whether a row derives from one of the (erased) sources ``pairs`` (the rule ``access`` and ``erase`` share)."""
    if table == "ctal":
        return any((r["session_id"], m.split(":", 1)[-1]) in pairs for m in r["modalities"])
    if table == "drift_alarms":
        return any((r["session_id"], s) in pairs for s in r["sources"])
    return (r["session_id"], r.get("source_id")) in pairs


def _multiset(rows: list[dict]) -> Counter:
    return Counter(json.dumps(r, sort_keys=True, default=str) for r in rows)


def _decoded(path: Path) -> bytes:
    """A file's bytes, and for Parquet its decoded non-binary values too (pages are compressed)."""
    data = path.read_bytes()
    if path.suffix == ".parquet":
        t = pq.read_table(path)
        t = t.select([f.name for f in t.schema if not pa.types.is_binary(f.type)])
        data += json.dumps(t.to_pylist(), default=str).encode()
    if path.suffix == ".faiss":
        data += " ".join(map(str, FeatureIndex.load(path).ids().tolist())).encode()
    return data


def _scan(out: Path, needles: dict[str, set]) -> dict[str, set]:
    """Which needles (per kind) occur in any file of OUT (raw bytes, decoded Parquet, FAISS ids)."""
    found: dict[str, set] = {k: set() for k in needles}
    for p in sorted(out.rglob("*")):
        if not p.is_file():
            continue
        data = _decoded(p)
        for kind, values in needles.items():
            for v in values - found[kind]:
                as_bytes = [str(v).encode()] + ([np.int64(v).tobytes()] if kind == "feature ids" else [])
                if any(b in data for b in as_bytes):
                    found[kind].add(v)
    return found


@pytest.fixture(scope="module")
def erased(planted, tmp_path_factory) -> dict:
    """A copy of the planted OUT after ``modalign lineage erase OUT --subject S --json`` (timed), with
    a subject registry naming S in (a copy of) the key store."""
    import contextlib
    import io
    import time

    from modalign.pipeline.sample import PLANTED_PII, subject_id

    root = tmp_path_factory.mktemp("erased")  # OUT and the key store (the erasure adds its keys): copies
    out, keys = root / "out", root / "keys"
    shutil.copytree(planted["out"], out)
    shutil.copytree(planted["keys"], keys)
    name = next(v for k, v, _ in PLANTED_PII if k == "person" and subject_id(v) == S)
    (keys / "subjects.yaml").write_text(f"{S}:\n  person: [{name}]\n")
    buf = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        assert main(["lineage", "erase", str(out), "--subject", S, "--key-store", str(keys), "--json"]) == 0
    report = json.loads(buf.getvalue())
    print(f"erasure of {S}: {time.perf_counter() - t0:.2f} s")
    return {"out": out, "keys": keys, "report": report, "path": Path(report["report_path"])}


def test_access_lists_what_was_planted_and_erase_removes_it_all(planted, erased):
    rep, deck = planted["access"], planted["mentioned"]["counts"]
    assert {(o["session_id"], o["source_id"]) for o in rep["sources"]} == ERASED
    before = planted["tables"]
    for table, key in (("events_video", "events"), ("records", "timeline"), ("features", "features")):
        n = sum(1 for r in before[table] if _erased_row(table, r, ERASED))
        assert n > 0
    assert rep["counts"]["events"] == sum(1 for t in ("events_video", "events_audio", "events_pdf")
                                          for r in before[t] if _erased_row(t, r, ERASED))
    assert deck["sources"] == 1 and deck["events"] == sum(1 for r in before["events_pdf"] if r["session_id"] == "deck")
    assert {p["kind"] for p in rep["pseudonyms"]} >= {"person", "email"}

    out, report = erased["out"], erased["report"]
    assert erased["path"] == out / "lineage" / "erasure" / f"{report['erasure_id']}.json" and erased["path"].is_file()
    # the counts per table are the rows access listed, and those of the deck that mentions S
    c = report["counts"]
    assert c["events_video"] + c["events_audio"] + c["events_pdf"] == rep["counts"]["events"] + deck["events"]
    assert (c["records"], c["features"], c["lineage_sources"], c["faiss_ids"]) == (
        rep["counts"]["timeline"] + deck["timeline"], rep["counts"]["features"] + deck["features"],
        rep["counts"]["sources"] + deck["sources"], rep["counts"]["faiss_ids"] + deck["faiss_ids"])
    assert c.get("ctal", 0) == rep["counts"]["ctal"] + deck["ctal"]
    assert sorted(report["sessions_dropped"]) == ["deck", "sample-meeting"]
    after = _tables(out)
    for table in set(TABLES) - MONITOR_TABLES:  # nothing of S left; every other row exactly as it was (multisets)
        assert not [r for r in after[table] if _erased_row(table, r)], table
        assert _multiset([r for r in after[table] if not _erased_row(table, r)]) == _multiset(
            [r for r in before[table] if not _erased_row(table, r)]), table
    assert {(r["session_id"], r["source_id"]) for r in after["lineage_sources"]} == {("solo", "lapel")}
    assert any(r["source_id"] == "lapel" for r in after["events_audio"]) and after["records"]
    rewritten = {f["path"]: f["replaced_by"] for f in report["removed_files"] if f["action"] == "rewritten"}
    assert any(p.startswith("records/solo/") for p in rewritten)  # solo's timeline held both recorders
    snap = modalign.open(out).snapshot
    assert set(rewritten.values()) <= snap.files() and not set(rewritten) & snap.files()
    assert "sample-meeting" not in snap.sessions and "deck" not in snap.sessions
    assert access(out, S)["counts"] == {k: 0 for k in rep["counts"]}


def test_a_byte_scan_of_out_finds_none_of_the_subjects_ids_pseudonyms_or_features(planted, erased):
    rep = planted["access"]
    needles = {"event ids": {e["event_id"] for e in rep["events"]},
               "pseudonyms": {p["pseudonym"] for p in rep["pseudonyms"]},
               "feature ids": {f["feature_id"] for f in rep["features"]}}
    assert all(needles.values())
    assert _scan(planted["out"], needles) == needles  # the scan does find them before the erasure
    assert _scan(erased["out"], needles) == {k: set() for k in needles}
    # the FAISS indexes hold none of the erased ids, and a search with an erased vector returns none
    output = modalign.open(erased["out"])
    erased_vectors = [r for r in planted["tables"]["features"] if _erased_row("features", r)]
    assert output.run["indexes"]
    for ix in output.run["indexes"]:
        index = FeatureIndex.load(erased["out"] / ix["path"])
        assert index.ntotal == ix["vectors"] and not set(index.ids().tolist()) & needles["feature ids"]
        for r in erased_vectors:
            if len(r["vector"]) == index.dim:
                _, ids = index.search(np.asarray(r["vector"], np.float32), index.ntotal)
                assert not set(ids[0].tolist()) & needles["feature ids"]
    kept = set(output.table("features").to_table(columns=["cache_key"]).column("cache_key").to_pylist())
    from modalign.operators.cache.store import FeatureCache

    cached = FeatureCache(erased["out"] / "cache").keys()
    assert not ({c["cache_key"] for c in rep["cache"]} - kept) & cached  # only entries other rows still name


def test_the_monitor_is_rebuilt_over_what_the_erasure_leaves(planted, erased, tmp_path):
    from modalign.pipeline.layout import OutputLayout
    from modalign.pipeline.monitors import monitor_embeddings
    from modalign.schemas.config import EmbeddingMonitorConfig

    before = planted["tables"]["monitor_windows"]
    assert {"sample-meeting", "solo", "deck"} <= {r["session_id"] for r in before}
    after = _tables(erased["out"])["monitor_windows"]
    assert not {r["session_id"] for r in after} & {"sample-meeting", "deck"}
    # exactly what the monitor computes afresh over the features the erasure left
    output = modalign.open(erased["out"])
    copy = tmp_path / "again"
    shutil.copytree(erased["out"], copy)
    features = sorted(f for f in output.snapshot.files() if f.startswith("features/"))
    cfg = EmbeddingMonitorConfig.model_validate(output.run["config"]["monitor"]["embedding"])
    again = monitor_embeddings(OutputLayout.of(copy), features, "check", cfg)
    rows = pq.read_table(copy / again["files"][0]).to_pylist() if again["files"] else []
    assert _multiset(after) == _multiset(rows) and output.run["monitor"]["windows"] == len(rows)
    # the quality rows too: none of an erased session, the rest as a fresh check over the events left
    from modalign.pipeline.quality import monitor_quality
    from modalign.schemas.config import QualityShiftConfig

    quality = _tables(erased["out"])["monitor_quality"]
    assert {r["session_id"] for r in planted["tables"]["monitor_quality"]} >= {"sample-meeting", "solo", "deck"}
    assert {r["session_id"] for r in quality} == {"solo"}  # one session left: no all-sessions row
    events = sorted(f for f in output.snapshot.files() if f.startswith("events/"))
    shift = QualityShiftConfig.model_validate(output.run["config"]["quality"]["shift"])
    checked = monitor_quality(OutputLayout.of(copy), events, "check", shift)
    fresh = pq.read_table(copy / checked["files"][0]).to_pylist()
    assert _multiset(quality) == _multiset(fresh) and output.run["monitor"]["quality"]["rows"] == len(fresh)
    assert {r["property"] for r in quality} == {"loudness_dbfs", "clipping_ratio", "snr_db"}
    old = erased["report"]["monitor"]["replaced"]
    assert old and all(f["sha256"].startswith("sha256:") for f in old)
    assert not {f["path"] for f in old} & output.snapshot.files()
    assert not [p for p in (erased["out"] / "monitor").rglob("*.parquet")
                if p.relative_to(erased["out"]).as_posix() not in output.snapshot.shared]


def test_verify_passes_and_a_tampered_report_fails(planted, erased, tmp_path, capsys):
    keys = ["--key-store", str(erased["keys"])]
    assert main(["lineage", "verify", str(erased["path"]), *keys, "--subject", S]) == 0
    text = capsys.readouterr().out
    assert "FAIL" not in text and "access --subject: empty" in text and "verified" in text
    doc = json.loads(erased["path"].read_text())
    for change in (lambda d: d["counts"].__setitem__("records", d["counts"]["records"] - 1),
                   lambda d: d["remaining_files"].__setitem__(next(iter(d["remaining_files"])), "sha256:" + "0" * 64),
                   lambda d: d["requested"].__setitem__("subject_key", "0" * 64)):
        bad = json.loads(json.dumps(doc))
        change(bad)
        copy = tmp_path / "tampered.json"
        copy.write_text(json.dumps(bad, indent=2, sort_keys=True))
        assert main(["lineage", "verify", str(copy), "--out", str(erased["out"]), *keys]) == 1
        assert "signature: HMAC-SHA256 does not match: the report was changed after it was signed" in \
            capsys.readouterr().out
    raw = bytearray(erased["path"].read_bytes())  # one byte of the file
    i = raw.index(b'"erased_at": "') + len(b'"erased_at": "') + 3
    raw[i] = ord("7") if raw[i] != ord("7") else ord("8")
    (tmp_path / "byte.json").write_bytes(bytes(raw))
    assert main(["lineage", "verify", str(tmp_path / "byte.json"), "--out", str(erased["out"]), *keys]) == 1
    assert "does not match" in capsys.readouterr().out
    # the access query is the proof: a report about another subject names it as such
    assert main(["lineage", "verify", str(erased["path"]), *keys, "--subject", "subject-0003"]) == 1
    assert "not about the given subject" in capsys.readouterr().out


def test_a_rerun_of_the_erased_sources_is_refused_by_the_denylist(planted, erased, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(erased["out"], out)
    summary = Runner(RunConfig(key_store=erased["keys"]), out, progress=lambda _m: None).run(planted["input"])
    q = modalign.open(out).table("quarantine").to_table().to_pylist()
    refused = {(r["session_id"], r["source_id"]) for r in q if r["reason_code"] == "erased"}
    assert refused == GONE - {("sample-meeting", "room_video.audio")}  # a video's own sound shares its row
    assert summary["counts"]["quarantined"] == len(refused) and summary["exit_code"] == 3
    for r in q:
        assert "erased from this output folder" in r["message"] and S not in r["message"] and r["source_uri"]
    assert access(out, S)["counts"]["sources"] == 0
    lapel = lambda r: r["source_id"] == "lapel" and r["session_id"] == "solo"  # noqa: E731
    got = modalign.open(out).table("events_audio").to_table().to_pylist()
    assert _multiset([r for r in got if lapel(r)]) == _multiset(
        [r for r in planted["tables"]["events_audio"] if lapel(r)]) and any(lapel(r) for r in got)
    # the denylist and the report outlive the run's commit
    snap = modalign.open(out).snapshot
    assert f"lineage/erasure/{erased['report']['erasure_id']}.json" in snap.shared
    assert any(f.startswith("lineage/denylist/") for f in snap.shared)
