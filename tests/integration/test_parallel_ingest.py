"""Every core: a session's sources go to whichever ingest actor is free, and two actors commit
exactly what one does; run.json reports start-up apart from processing."""

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
                        "granularity") if c in t.column_names]
    return Counter(tuple(r.values()) for r in t.select(keep).to_pylist())


def test_two_ingest_actors_share_the_sources_and_commit_what_one_does(ray_local, sample_manifest, tmp_path):
    outs, runners = {}, {}
    for n in (1, 2):
        cfg = RunConfig(key_store=tmp_path / "keys", runtime={"ingest_actors": n})
        runners[n] = Runner(cfg, tmp_path / f"out{n}")
        runners[n].run(sample_manifest)
        outs[n] = tmp_path / f"out{n}"
    assert set(runners[1].ingested_by.values()) == {0}
    assert set(runners[2].ingested_by.values()) == {0, 1}  # the sources of one session on two actors
    assert len(runners[2].ingested_by) == 4  # video, its sound, the lapel, the slides
    for folder in TABLES:
        one, two = _rows(outs[1], folder), _rows(outs[2], folder)
        assert one and one == two, folder  # 0 lost, 0 duplicated

    run = json.loads((outs[2] / "run.json").read_text())
    timing = run["timing"]
    assert set(timing) == {"ray_start_s", "actors_ready_s", "processing_s", "commit_s"}
    assert all(v >= 0 for v in timing.values()) and timing["actors_ready_s"] > 0 and timing["processing_s"] > 0
    assert timing["processing_s"] < run["elapsed_s"]
