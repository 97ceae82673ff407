"""The watch's view of a folder, without Ray: the sessions ``run`` would find, and when each is ready."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from modalign.pipeline.discovery import discover, session_id_for
from modalign.pipeline.listing import LocalListing
from modalign.pipeline.watch import Watch, local_listing
from modalign.schemas.config import RunConfig
from modalign.schemas.errors import ConfigError
from modalign.schemas.files import stat_version

SETTLE_S = 30.0


def _old(path: Path, age_s: float = 3600.0) -> None:
    t = time.time() - age_s
    os.utime(path, (t, t))


def _watch(inp: Path, tmp_path: Path, settle_s: float = SETTLE_S) -> Watch:
    return Watch(RunConfig(key_store=tmp_path / "keys"), LocalListing(inp), tmp_path / "out", settle_s=settle_s)


def _ready(watch: Watch) -> dict[str, frozenset]:
    return {c.session_id: c.version for c, _at in watch._poll()}


@pytest.fixture
def folder(tmp_path) -> Path:
    d = tmp_path / "in"
    (d / "meeting").mkdir(parents=True)
    (d / "meeting" / "manifest.yaml").write_text(
        "session_id: meeting\nsources:\n  - {id: talk, uri: talk.mp4, modality: video}\n"
        "  - {id: lapel, uri: lapel.wav, modality: audio}\n")
    for name in ("meeting/talk.mp4", "meeting/lapel.wav", "lone.wav", "Straße 1.mp4"):
        (d / name).write_bytes(b"bytes of " + name.encode())
    for p in d.rglob("*"):
        _old(p)
    return d


def test_sessions_are_the_ones_run_finds(folder, tmp_path):
    found = LocalListing(folder).sessions(LocalListing(folder).list())
    assert not found.problems
    got = {c.session_id: c for c in found.candidates}
    assert set(got) == {s.manifest.session_id for s in discover(folder)}  # the same names as `run`
    meeting = got["meeting"]
    assert meeting.origin == "meeting/manifest.yaml" and not meeting.waiting_for
    # Its version is what lineage rows will record: source URI and stat version, per source.
    assert meeting.version == {((folder / "meeting" / f).resolve().as_uri(), stat_version(folder / "meeting" / f))
                               for f in ("talk.mp4", "lapel.wav")}
    assert set(_ready(_watch(folder, tmp_path))) == set(got)  # files older than the settle time: ready at once


def test_a_file_being_written_is_not_ready_until_it_settles(folder, tmp_path):
    watch = _watch(folder, tmp_path, settle_s=0.6)
    growing = folder / "growing.wav"
    started = time.time()
    with open(growing, "wb") as f:
        for i in range(6):  # written over ~0.9 s: its version changes at every poll
            f.write(b"x" * 1000)
            f.flush()
            os.utime(growing)
            last_write = time.time()
            assert "growing" not in _ready(watch)
            time.sleep(0.15)
    finished = time.time()
    while "growing" not in (ready := _ready(watch)):
        assert time.time() - finished < 5
        time.sleep(0.05)
    assert time.time() - last_write >= 0.6 - 0.02  # the settle time after its last change (mtime resolution)
    assert ready["growing"] == {(growing.resolve().as_uri(), stat_version(growing))}  # the final version
    assert time.time() - started >= 0.9


def test_sessions_wait_for_missing_sources_and_unsettled_manifests(folder, tmp_path):
    (folder / "meeting" / "lapel.wav").unlink()
    watch = _watch(folder, tmp_path)
    assert "meeting" not in _ready(watch)
    assert "lapel.wav" in watch.view["problems"]["meeting/manifest.yaml"] and watch.view["waiting"] == 1
    (folder / "meeting" / "lapel.wav").write_bytes(b"late")  # fresh: it must settle first
    assert "meeting" not in _ready(watch) and watch.view["settling"] >= 1
    _old(folder / "meeting" / "lapel.wav")
    assert "meeting" in _ready(watch)

    # A manifest being written next to lone files holds them back (it may be about to claim them).
    (folder / "new.yaml").write_text("session_id: new\nsources:\n  - {id: a, uri: lone.wav, modality: audio}\n")
    assert "lone" not in _ready(watch) and "new" not in _ready(watch)
    _old(folder / "new.yaml")
    assert "new" in _ready(watch) and "lone" not in _ready(watch)  # claimed: no lone session any more


def test_invalid_manifests_and_duplicate_ids_are_reported_not_run(folder, tmp_path):
    (folder / "meeting" / "manifest.yaml").write_text("session_id: meeting\nsources:\n  - {id: talk}\n")
    (folder / "sub").mkdir()
    (folder / "sub" / "lone.wav").write_bytes(b"same id as ../lone.wav")
    for p in folder.rglob("*"):
        _old(p)
    watch = _watch(folder, tmp_path)
    ready = _ready(watch)
    problems = watch.view["problems"]
    assert "sources.0" in problems["meeting/manifest.yaml"]  # names the field
    assert "lone" not in ready and "duplicate session id lone" in problems["sub/lone.wav"]
    # The media of the invalid manifest's folder wait for it instead of becoming lone sessions.
    assert not {"talk", "lapel"} & set(ready) and "invalid manifest" in problems["meeting/talk.mp4"]
    assert set(ready) == {session_id_for(Path("Straße 1.mp4"))}  # the one good lone file, named as run names it


def test_watch_refuses_a_file_or_an_out_inside_its_input(folder, tmp_path):
    with pytest.raises(ConfigError, match="not a folder"):
        local_listing(folder / "lone.wav", tmp_path / "out")
    with pytest.raises(ConfigError, match="inside the watched folder"):
        local_listing(folder, folder / "out")


def test_a_session_cut_short_by_a_dying_worker_is_pending_again(tmp_path):
    """A committed ``worker_failed`` row means the machine failed, not the input: the watch redoes
    the session (``committed_versions`` leaves it out); its other sessions stay committed."""
    from modalign.pipeline.commits import CommitLog
    from modalign.pipeline.layout import OutputLayout, write_table
    from modalign.pipeline.watch import committed_versions
    from modalign.schemas.arrow import rows_to_table
    from modalign.schemas.tables import QuarantineRow, SourceLineageRow

    layout, sessions = OutputLayout(tmp_path), {}
    for sid, status in (("whole", "ingested"), ("cut", "partial")):
        lineage = SourceLineageRow(run_id="r" * 32, session_id=sid, source_id="mic", source_uri=f"file:///in/{sid}.wav",
                                   source_version="local:10:1", modality="audio", status=status, events=3,
                                   operators="", policy="p", deid=[], subjects=[])
        files = [write_table(layout.lineage_sources(sid, "a" * 12), rows_to_table(SourceLineageRow, [lineage.model_dump()]))]
        if status == "partial":
            row = QuarantineRow(session_id=sid, source_id="mic", source_uri=lineage.source_uri,
                                source_version=lineage.source_version, stage="ingest/audio",
                                reason_code="worker_failed", message="ingest worker died", start_t_ns=5)
            files.append(write_table(layout.quarantine(sid, "a" * 12), rows_to_table(QuarantineRow, [row.model_dump()])))
        sessions[sid] = {"run_id": "r" * 32, "files": [layout.relative(f) for f in files]}
    CommitLog.of(tmp_path).commit(None, run_id="r" * 32, sessions=sessions, shared=[], summary={})
    assert committed_versions(tmp_path) == {"whole": frozenset({("file:///in/whole.wav", "local:10:1")})}
