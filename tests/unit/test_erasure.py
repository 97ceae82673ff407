"""``pipeline.erasure`` over a committed OUT written by ``benchmarks/lineage.py``'s generator (the
project's writers and commit protocol, no Ray): what an erasure removes and keeps, the report
and its verification, the dry run, the denylist, and a SIGKILL at points inside an erasure.

Generator subjects: session ``bench-NNNN`` lists ``subject-{NNNN // 3}``; its lapel recorder alone
lists ``speaker-{NNNN % 50}``."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import modalign
from modalign.pipeline.erasure import (DENYLIST, Denylist, ErasureKeys, erase, keyed, renamed, verify,
                                       _denylist_entries)
from modalign.pipeline.layout import TABLES
from modalign.pipeline.lineage import access
from modalign.schemas.errors import ConfigError, QuarantineReason
from test_lineage_store import _bench

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def gen(tmp_path_factory) -> Path:
    """A committed OUT of 6 generated sessions (left as it is: tests erase copies)."""
    out = tmp_path_factory.mktemp("erasure-gen") / "out"
    _bench().generate(out, 6)
    return out


@pytest.fixture
def out(gen, tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MODALIGN_KEY_STORE", str(tmp_path / "keys"))
    dst = tmp_path / "out"
    shutil.copytree(gen, dst)
    return dst


def _tables(out: Path) -> dict[str, Counter]:
    """Every committed table as a multiset of rows, the FAISS ids per index, the denylist entries."""
    output = modalign.open(out)
    got = {name: Counter(json.dumps(r, sort_keys=True, default=str) for r in output.table(name).to_table().to_pylist())
           for name in TABLES}
    from modalign.operators.cache.index import FeatureIndex

    got["faiss"] = Counter(f"{ix['model_id']}/{ix['granularity']}:{i}" for ix in output.run["indexes"]
                           for i in FeatureIndex.load(out / ix["path"]).ids().tolist())
    got["denylist"] = Counter(json.dumps({k: v for k, v in e.items() if k not in ("erasure_id", "erased_at")},
                                         sort_keys=True)
                              for f in output.snapshot.shared if f.startswith(DENYLIST + "/")
                              for e in json.loads((out / f).read_text())["entries"])
    return got


def _files(out: Path) -> dict[str, str]:
    return {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file()}


def _on_disk_is_committed(out: Path) -> None:
    snap = modalign.open(out).snapshot
    folders = [*modalign.open(out).layout.data_folders(), "lineage/erasure", DENYLIST]
    on_disk = {p.relative_to(out).as_posix() for f in folders if (out / f).is_dir()
               for p in (out / f).rglob("*") if p.is_file()}
    assert on_disk == snap.files()


def test_a_source_level_subject_goes_from_every_table_and_every_other_row_stays(out):
    before = _tables(out)
    acc = access(out, "speaker-01")
    assert {(o["session_id"], o["source_id"]) for o in acc["sources"]} == {("bench-0001", "lapel")}
    old = modalign.open(out).snapshot.files()
    rep = erase(out, subject="speaker-01")
    after = _tables(out)

    def mine(table: str, row: str) -> bool:
        r = json.loads(row)
        if table == "ctal":
            return r["session_id"] == "bench-0001" and "audio:lapel" in r["modalities"]
        return r.get("session_id") == "bench-0001" and r.get("source_id") == "lapel"

    for table in TABLES:
        gone = Counter({k: n for k, n in before[table].items() if mine(table, k)})
        assert after[table] == before[table] - gone, table  # exactly the subject's rows left, nothing else
    c = rep["counts"]
    assert (c["events_audio"], c["records"], c["features"], c["ctal"], c["lineage_sources"]) == (
        acc["counts"]["events"], acc["counts"]["timeline"], acc["counts"]["features"], acc["counts"]["ctal"], 1)
    erased_ids = {f["feature_id"] for f in acc["features"]}
    assert {int(x.rsplit(":", 1)[1]) for x in before["faiss"]} - {int(x.rsplit(":", 1)[1]) for x in after["faiss"]} \
        == erased_ids
    assert c["ctal_jsonl"] == c["ctal"] and c["ctal_summary"] == 1 and c["cache_entries"] == len(acc["cache"])
    from modalign.operators.cache.store import FeatureCache

    assert not {e["cache_key"] for e in acc["cache"]} & FeatureCache(out / "cache").keys()
    # the session's shared files were rewritten under the erasure's attempt, the per-source ones dropped
    actions = {f["path"].split("/")[0] + "/" + f["table"]: f["action"] for f in rep["removed_files"]}
    assert actions["records/records"] == actions["lineage/lineage_sources"] == "rewritten"
    assert actions["events/events_audio"] == "dropped"
    new = modalign.open(out).snapshot.files()
    for f in rep["removed_files"]:
        assert f["path"] in old and f["path"] not in new and not (out / f["path"]).exists()
        if f["replaced_by"]:
            assert f["replaced_by"] in new and rep["erasure_id"][:12] in f["replaced_by"]
    assert rep["remaining_files"] == {p: "sha256:" + h for p, h in _files(out).items() if p in new
                                      and p != f"lineage/erasure/{rep['erasure_id']}.json"}
    _on_disk_is_committed(out)
    assert modalign.open(out).run["erasure"]["erasure_id"] == rep["erasure_id"]
    assert access(out, "speaker-01")["counts"]["sources"] == 0


def test_session_scope_takes_the_whole_session_and_a_source_erasure_takes_one_source(out):
    rep = erase(out, subject="speaker-02", scope="session")
    assert {(s["session_id"], s["source_id"]) for s in rep["sources"]} == {
        ("bench-0002", s) for s in ("room_video", "room_video.audio", "lapel", "slides")}
    assert rep["sessions_dropped"] == ["bench-0002"] and "bench-0002" not in modalign.open(out).snapshot.sessions
    rep = erase(out, source="file:///rec/bench-0004/room.mp4")  # a video and its own audio track: one file
    assert {s["source_id"] for s in rep["sources"]} == {"room_video", "room_video.audio"}
    lineage = modalign.open(out).table("lineage_sources").to_table().to_pylist()
    assert {r["source_id"] for r in lineage if r["session_id"] == "bench-0004"} == {"lapel", "slides"}
    assert verify(rep["report_path"])["ok"]
    with pytest.raises(ConfigError, match="no committed source"):
        erase(out, source="file:///rec/nowhere.mp4")
    with pytest.raises(ConfigError, match="not a data-subject id"):
        erase(out, subject="Jane Doe")
    with pytest.raises(ConfigError, match="does not exist"):  # refused before any lease record is written
        erase(out.parent / "no-such-out", subject="speaker-02")
    assert not (out.parent / "no-such-out").exists()


def test_verify_passes_fails_on_tampering_and_says_what_changed_since(out, tmp_path):
    rep = erase(out, subject="speaker-03")
    res = verify(rep["report_path"])
    assert res["ok"] and [c["check"] for c in res["checks"]] == [
        "signature", "committed", "files", "removed", "access sources", "access subject"]
    doc = json.loads(Path(rep["report_path"]).read_text())
    for field, value in (("erased_at", "2020-01-01T00:00:00Z"), ("counts", {**doc["counts"], "records": 1}),
                         ("sessions_dropped", ["bench-0000"])):
        bad = tmp_path / f"bad-{field}.json"
        bad.write_text(json.dumps({**doc, field: value}))
        res = verify(bad, out=out)
        assert not res["ok"] and res["checks"][-1]["check"] == "signature" and "changed after it was signed" in \
            res["checks"][-1]["detail"], field
    bad.write_text(Path(rep["report_path"]).read_text()[:-20])
    assert not verify(bad, out=out)["ok"]
    # a removed file put back fails; later commits are reported, not failed
    back = next(f for f in rep["removed_files"] if f["action"] == "dropped")
    (out / back["path"]).parent.mkdir(parents=True, exist_ok=True)
    (out / back["path"]).write_bytes(b"PAR1 restored from a backup")
    res = verify(rep["report_path"])
    assert not res["ok"] and next(c for c in res["checks"] if c["check"] == "removed")["ok"] is False
    (out / back["path"]).unlink()
    erase(out, subject="speaker-04")
    res = verify(rep["report_path"])
    assert res["ok"] and res["commit"] == res["erasure_commit"] + 1 and res["changed_since"]["replaced"]
    # verify needs the key that signed it
    res = verify(rep["report_path"], key_store=tmp_path / "other-keys")
    assert not res["ok"] and "holds no report-signing key" in res["checks"][0]["detail"]


def test_a_dry_run_changes_nothing_and_lists_what_the_erasure_removes(out, tmp_path):
    files = _files(out)
    dry = erase(out, subject="subject-0001", dry_run=True)
    assert _files(out) == files and not (tmp_path / "keys").exists()  # no lease record, no key, no file
    real = erase(out, subject="subject-0001")
    assert dry["counts"] == real["counts"] and dry["sessions_dropped"] == real["sessions_dropped"] == [
        "bench-0003", "bench-0004", "bench-0005"]
    assert [f["path"] for f in dry["removed_files"]] == [f["path"] for f in real["removed_files"]]


def test_the_denylist_refuses_erased_subjects_versions_and_contents(out, tmp_path):
    erase(out, subject="speaker-05")
    erase(out, source="file:///rec/bench-0000/slides.pdf")
    keys = tmp_path / "keys"
    deny = Denylist.load(out, modalign.open(out).snapshot, keys)
    assert "a data subject of this source was erased" in deny.refusal("file:///x.wav", "local:1:1", None,
                                                                      ["subject-0009", "speaker-05"])
    assert deny.refusal("file:///rec/bench-0000/slides.pdf", "local:1000:0", None, []).startswith(
        "this source version was erased")
    assert deny.refusal("file:///rec/bench-0000/slides.pdf", "local:1000:1", None, []) is None  # a new version
    assert deny.refusal("file:///x.wav", "local:1:1", None, ["speaker-06"]) is None
    raw = json.dumps(json.loads((out / next(f for f in modalign.open(out).snapshot.shared
                                            if f.startswith(DENYLIST))).read_text()))
    assert "speaker-05" not in raw and "bench-0000/slides.pdf" not in raw  # keyed, never in clear
    # content: the same bytes under another name and time
    src = tmp_path / "a.wav"
    src.write_bytes(b"RIFF" + bytes(range(200)))
    key = ErasureKeys(keys).get("denylist", create=False)
    sha = hashlib.sha256(src.read_bytes()).hexdigest()
    entries = _denylist_entries(key, "e" * 32, "now", None, [
        {"source_uri": src.as_uri(), "source_version": "local:204:5", "source_sha256": "sha256:" + sha}])
    copy = tmp_path / "b.wav"
    shutil.copy(src, copy)
    assert Denylist(tuple(entries), key).refusal(copy.as_uri(), "local:204:9", copy, []).startswith(
        "a source with these exact bytes")
    assert entries[0]["key"] == keyed(key, "content", hashlib.sha256(src.read_bytes()).hexdigest())
    with pytest.raises(ConfigError, match="does not hold"):  # a run with another key store must not ingest them
        Denylist.load(out, modalign.open(out).snapshot, tmp_path / "elsewhere")
    assert QuarantineReason("erased") is QuarantineReason.ERASED


def test_a_cache_entry_a_remaining_row_shares_goes_too_and_that_row_keeps_its_vector(out):
    """Content-addressed: the same bytes in another session's source share one entry. It goes with
    the erased row (the cache only saves work); the other row keeps its vector in features/."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from modalign.operators.cache.store import FeatureCache

    acc = access(out, "speaker-01")
    mine, erased_keys = acc["features"][0], {c["cache_key"] for c in acc["cache"]}
    other = next(out / f for f in modalign.open(out).snapshot.files()
                 if f.startswith("features/") and "/bench-0000/lapel-" in f)
    t = pq.read_table(other)
    keys = t.column("cache_key").to_pylist()
    t = t.set_column(t.schema.get_field_index("cache_key"), "cache_key",
                     pa.array([mine["cache_key"]] + keys[1:], t.schema.field("cache_key").type))
    pq.write_table(t, other)
    sharer = t.slice(0, 1).to_pylist()[0]
    assert erased_keys and erased_keys <= FeatureCache(out / "cache").keys()
    rep = erase(out, subject="speaker-01")
    assert rep["cache"] == {"entries_removed": len(erased_keys)}
    assert not erased_keys & FeatureCache(out / "cache").keys()
    kept = pq.read_table(other).slice(0, 1).to_pylist()[0]
    assert kept["feature_id"] == sharer["feature_id"] and kept["cache_key"] == mine["cache_key"]
    assert np.array_equal(kept["vector"], sharer["vector"])


def test_renamed_replaces_the_attempt_token_only():
    assert renamed("records/s-1/0123456789ab.parquet", "fedcba987654") == "records/s-1/fedcba987654.parquet"
    assert renamed("events/audio/s/lapel-x-0123456789ab-00003.parquet", "fedcba987654") == \
        "events/audio/s/lapel-x-fedcba987654-00003.parquet"
    assert renamed("ctal/jsonl/s/0123456789ab.jsonl", "fedcba987654") == "ctal/jsonl/s/fedcba987654.jsonl"
    with pytest.raises(ConfigError):
        renamed("records/s/notes.txt", "fedcba987654")


# A SIGKILL inside an erasure: the erasure runs in a process of its own, which stops (and says so
# in a marker file) at one point of its work; the test kills it there with SIGKILL.
_PAUSED = r'''
import sys, time
from pathlib import Path
from modalign.pipeline import erasure, commits
out, point, marker = sys.argv[1], sys.argv[2], Path(sys.argv[3])
def pause():
    marker.write_text("paused")
    time.sleep(600)
if point.startswith("rewrite"):  # after the n-th rewritten file
    n, real, seen = int(point.split(":")[1]), erasure._rewrite, []
    def rewrite(*a):
        rows = real(*a)
        seen.append(1)
        if len(seen) == n:
            pause()
        return rows
    erasure._rewrite = rewrite
elif point == "index":  # an index re-saved under its new name
    from modalign.operators.cache import index
    real_save = index.FeatureIndex.save
    def save(self, path):
        real_save(self, path)
        pause()
    index.FeatureIndex.save = save
elif point == "cache":  # the cache entries removed, nothing committed yet
    from modalign.operators.cache import store
    real_remove = store.FeatureCache.remove
    def remove(self, keys):
        real_remove(self, keys)
        pause()
    store.FeatureCache.remove = remove
elif point == "committed":  # the commit record created, the old files not yet removed
    real_commit = commits.CommitLog.commit
    def commit(self, *a, **k):
        snap = real_commit(self, *a, **k)
        pause()
        return snap
    commits.CommitLog.commit = commit
erasure.erase(out, subject="speaker-01")
'''


def test_a_sigkill_inside_an_erasure_leaves_the_before_or_the_after_state(gen, tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    monkeypatch.setenv("MODALIGN_KEY_STORE", str(keys))
    before = _tables(gen)
    clean = tmp_path / "clean"
    shutil.copytree(gen, clean)
    erase(clean, subject="speaker-01")  # one source: three of its session's files rewritten, four dropped
    after = _tables(clean)
    assert after != before
    script = tmp_path / "paused.py"
    script.write_text(_PAUSED)
    for point, expect in (("rewrite:1", before), ("rewrite:3", before), ("index", before), ("cache", before),
                          ("committed", after)):
        out = tmp_path / point.replace(":", "-")
        shutil.copytree(gen, out)
        marker = tmp_path / f"{out.name}.paused"
        proc = subprocess.Popen([sys.executable, str(script), str(out), point, str(marker)],
                                env=dict(os.environ, MODALIGN_KEY_STORE=str(keys)), stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, f"the erasure never reached {point}"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stderr.close()
        assert _tables(out) == expect, point  # every committed table: the whole before, or the whole after
        if expect is before:
            assert modalign.open(out).version == modalign.open(gen).version
            assert access(out, "speaker-01")["counts"]["sources"] == 1
        # the next erasure sweeps what the dead one left (its lease is taken over at once: same host)
        erase(out, subject="speaker-01")
        assert _tables(out) == after, point
        _on_disk_is_committed(out)
