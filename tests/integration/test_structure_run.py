"""Defects of the structure review, through the real runner on a local Ray.

A folder of a tone, a tone whose name has a non-ASCII letter, a video with its own sound
and a silent video; each test checks what the run wrote.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.dataset as ds
import pytest

import modalign

from modalign.pipeline.runner import EXIT_OK, Runner
from modalign.schemas.config import RunConfig
from clips import write_clip, write_tone

pytestmark = pytest.mark.integration



@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("structure")
    write_tone(d / "tone.wav")
    write_tone(d / "dotdot name ü.wav", hz=330.0)
    write_clip(d / "talk.mp4", sound=True)
    write_clip(d / "silent.mp4", sound=False)
    return d


@pytest.fixture(scope="module")
def run(ray_local, folder, tmp_path_factory):
    """(out, summary) of one run; the driver's file hashes are booby-trapped: only workers read sources."""
    import modalign.pipeline.worker as worker
    import modalign.schemas.files as files

    tmp = tmp_path_factory.mktemp("structure-out")
    out = tmp / "out"

    def trap(*_a, **_k):
        pytest.fail("the driver read a source to hash it")

    with pytest.MonkeyPatch.context() as mp:
        for mod, name in [(files, "sha256_file"), (files, "SeekableHashingReader"),
                          (worker, "sha256_file"), (worker, "SeekableHashingReader")]:
            mp.setattr(mod, name, trap)
        summary = Runner(RunConfig(key_store=tmp / "keys"), out, progress=lambda _m: None).run(folder)
    return out, summary


def _lineage(out: Path) -> list[dict]:
    return ds.dataset(out / "lineage" / "sources", format="parquet").to_table().to_pylist()


def test_each_source_is_hashed_by_its_worker_while_it_is_read(run, folder):
    """Defect: the driver hashed every source serially before any work, then the worker read it again."""
    import hashlib
    import os
    from urllib.parse import unquote, urlparse

    out, _ = run
    for r in _lineage(out):
        path = Path(unquote(urlparse(r["source_uri"]).path))
        st = os.stat(path)
        assert r["source_version"] == f"local:{st.st_size}:{st.st_mtime_ns}"  # known without a read
        if r["status"] != "no_stream":
            assert r["source_sha256"] == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest(), r["source_id"]


def test_run_json_names_every_operator_and_package(run):
    out, summary = run
    ops = summary["versions"]["operators"]
    assert {"video_frames", "audio_mfcc", "pdf_text", "face_blur", "frame_text", "text_pii", "voice_policy",
            "tick_aligner", "frame_embed"} <= set(ops)
    assert all(isinstance(v, str) and v for v in ops.values())
    assert summary["versions"]["faiss"] and summary["versions"]["ray"] == "2.60.0"
    assert json.loads((out / "run.json").read_text())["versions"]["operators"] == ops


def test_a_video_s_own_sound_is_an_audio_source(run):
    out, summary = run
    assert summary["exit_code"] == EXIT_OK  # a silent video is not bad input
    rows = {(r["session_id"], r["source_id"]): r for r in _lineage(out)}
    track = rows[("talk", "source.audio")]
    assert track["modality"] == "audio" and track["track_of"] == "source" and track["status"] == "ingested"
    assert track["source_uri"] == rows[("talk", "source")]["source_uri"]
    assert track["source_version"] == rows[("talk", "source")]["source_version"] != ""
    mfcc = ds.dataset(out / "events" / "audio" / "talk", format="parquet").to_table()
    assert 190 <= mfcc.num_rows <= 206 and set(mfcc.column("source_id").to_pylist()) == {"source.audio"}
    voiced = mfcc.column("voiced").to_numpy(zero_copy_only=False)
    assert 0.3 < voiced.mean() < 0.97 and not voiced.all()  # the bursts (plus VAD hangover), not silence
    timeline = ds.dataset(out / "records" / "talk", format="parquet").to_table()
    audio = timeline.filter(ds.field("modality") == "audio")
    assert 50 <= audio.num_rows <= 52 and audio.filter(ds.field("decision") == "matched").num_rows >= 48
    # The silent video: no audio source in the timeline, no quarantine row, a lineage row saying why.
    assert rows[("silent", "source.audio")]["status"] == "no_stream"
    silent = ds.dataset(out / "records" / "silent", format="parquet").to_table()
    assert set(silent.column("modality").to_pylist()) == {"video"}
    assert modalign.open(out).table("quarantine").count_rows() == 0  # no file at all: no rows


def test_voice_and_face_counters_reach_run_json(run):
    out, summary = run
    c = summary["counts"]
    audio_events = ds.dataset(out / "events" / "audio", format="parquet").count_rows()
    # the default voice policy anonymises the waveform before MFCC: every stored frame says which way
    from modalign.operators.deid.voice import voice_transform
    from modalign.schemas.policy import VoicePolicy

    method = voice_transform(VoicePolicy()).name
    assert method.startswith("voiceanon@3/")
    assert c["voice_frames"] == {method: audio_events} and audio_events == c["events"]["audio"] > 0
    assert c["faces_blurred"] == 0 and c["frame_text_blurred"] == 0  # grey frames: nothing to remove


def test_a_non_ascii_file_name_is_a_session(run):
    out, _ = run
    sessions = {r["session_id"] for r in _lineage(out)}
    ids = [s for s in sessions if s.startswith("dotdot_name_u-")]
    assert len(ids) == 1
    records = ds.dataset(out / "records" / ids[0], format="parquet").to_table()
    assert records.num_rows == 50


def test_stale_feature_parts_are_removed_on_a_rerun(run, folder, tmp_path):
    """Defect: feature parts of an earlier run survived a re-run and got indexed."""
    import faiss

    import modalign

    out, _ = run
    out2 = tmp_path / "out"
    shutil.copytree(out, out2)
    parts = [p for p in modalign.open(out2).files("features") if p.parent.name == "talk"
             and p.parent.parent.name == "frame" and p.parts[-4].startswith("efficientnet")]
    stale = parts[0].with_name("source-0123456789ab-00099.parquet")  # a crashed attempt's part: not committed
    shutil.copy(parts[0], stale)
    Runner(RunConfig(key_store=tmp_path / "keys"), out2, progress=lambda _m: None).run(folder)
    assert not stale.exists() and not any(p.exists() for p in parts)  # the old commit's parts went too
    committed = modalign.open(out2)
    frame_rows = committed.table("features").to_table().filter(ds.field("granularity") == "frame")
    model = frame_rows.column("model_id")[0].as_py()
    on_disk = ds.dataset(out2 / "features", format="parquet").to_table()  # between runs: only committed files
    assert on_disk.num_rows == committed.table("features").count_rows()
    index = faiss.read_index(str(committed.index_file(model, "frame")))
    assert index.ntotal == frame_rows.filter(ds.field("model_id") == model).num_rows


def test_actors_are_killed_when_a_run_fails(ray_local, folder, tmp_path, monkeypatch):
    import ray

    made, killed = [], []
    real_kill = ray.kill
    monkeypatch.setattr(ray, "kill", lambda a, **kw: (killed.append(a), real_kill(a, **kw)))

    def boom(self, st):
        made.append(st)
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(Runner, "_write_session_tables", boom)
    with pytest.raises(RuntimeError, match="disk on fire"):
        Runner(RunConfig(key_store=tmp_path / "keys", runtime={"ingest_actors": 1}), tmp_path / "out",
               progress=lambda _m: None).run(folder)
    assert made and len(killed) == 1 + 1 + 4  # ingest, embed, one aligner per session
