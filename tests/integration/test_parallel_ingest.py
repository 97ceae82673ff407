"""Every core: a session's sources, and the ranges of its video and sound, go to whichever ingest actor is
free, each ingest actor's payloads to its embed actor, and two actors of each kind commit exactly
what one does; run.json reports start-up apart from processing."""

from __future__ import annotations

import json
from collections import Counter

import pyarrow.dataset as ds
import pytest

from modalign.pipeline.runner import Runner
from modalign.schemas.config import RunConfig

pytestmark = pytest.mark.integration

TABLES = ("events/video", "events/audio", "events/pdf", "records", "features")


def _rows(out, folder: str) -> Counter:
    """Multiset of a committed table's rows, lineage columns that name the run left out."""
    t = ds.dataset(out / folder, format="parquet").to_table()
    keep = [c for c in ("event_id", "session_id", "source_id", "tick", "t_ns", "decision", "feature_id",
                        "granularity", "face_boxes", "text_boxes", "frame_jpeg", "vector") if c in t.column_names]
    return Counter(repr(tuple(r.values())) for r in t.select(keep).to_pylist())


def test_two_ingest_actors_share_the_sources_and_commit_what_one_does(ray_local, sample_manifest, tmp_path):
    """1 ingest actor and 1 embed actor, then 2 and 2: the same rows."""
    outs, runners = {}, {}
    for n in (1, 2):  # the 6 s video cut at its keyframes 2 and 4 s in: three ranges; its sound in two on 2 actors
        cfg = RunConfig(key_store=tmp_path / "keys", runtime={"ingest_actors": n, "embed_actors": n},
                        ingest={"video": {"range_s": 2.0}, "audio": {"range_min_s": 2.0, "chunk_s": 1.0}})
        runners[n] = Runner(cfg, tmp_path / f"out{n}")
        runners[n].run(sample_manifest)
        outs[n] = tmp_path / f"out{n}"
    assert set(runners[1].ingested_by.values()) == {0}
    assert set(runners[2].ingested_by.values()) == {0, 1}  # the sources of one session on two actors
    # the video's three ranges, its sound's two (the lapel's clock is estimated from it: whole), the slides
    assert sorted((src, part) for _s, src, part in runners[2].ingested_by) == \
           [("lapel", 0), ("room_video", 0), ("room_video", 1), ("room_video", 2), ("room_video.audio", 0),
            ("room_video.audio", 1), ("slides", 0)]
    assert {runners[2].ingested_by[("sample-meeting", "room_video", k)] for k in (0, 1)} == {0, 1}  # at once
    for folder in TABLES:  # ids, times, decisions, boxes, pixels and vectors: any number of actors, one output
        one, two = _rows(outs[1], folder), _rows(outs[2], folder)
        assert one and one == two, folder  # 0 lost, 0 duplicated
    lineage = ds.dataset(outs[2] / "lineage" / "sources", format="parquet").to_table().to_pylist()
    (room,) = [r for r in lineage if r["source_id"] == "room_video"]  # one row for the three ranges
    assert room["status"] == "ingested" and room["events"] == 150 and room["source_sha256"].startswith("sha256:")
    (sound,) = [r for r in lineage if r["source_id"] == "room_video.audio"]  # and one for the two
    assert sound["status"] == "ingested" and sound["events"] > 590 and sound["source_sha256"] == room["source_sha256"]
    one_row = {r["source_id"]: r for r in ds.dataset(outs[1] / "lineage" / "sources", format="parquet").to_table()
               .to_pylist()}["room_video"]
    assert [(h["method"], h["count"]) for h in room["deid"]] == [(h["method"], h["count"]) for h in one_row["deid"]]

    run = json.loads((outs[2] / "run.json").read_text())
    # each ingest actor handed its payloads to its own embed actor, and both embedded some
    (a, b) = run["actors"]["embed_batches"]
    assert run["actors"]["ingest"] == run["actors"]["embed"] == 2 and a >= b > 0
    one_run = json.loads((outs[1] / "run.json").read_text())["actors"]
    assert one_run["embed"] == 1 and one_run["embed_batches"] == [a + b]  # the same batches, on one actor
    timing = run["timing"]
    assert set(timing) == {"ray_start_s", "actors_ready_s", "processing_s", "commit_s"}
    assert all(v >= 0 for v in timing.values()) and timing["actors_ready_s"] > 0 and timing["processing_s"] > 0
    assert timing["processing_s"] < run["elapsed_s"]
