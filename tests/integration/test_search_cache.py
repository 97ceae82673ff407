"""The real runner twice into one output folder: cache hits, identical features, search, cache gc."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pytest
from PIL import Image

from modalign.pipeline.cache_admin import cache_gc, cache_stats
from modalign.pipeline.runner import Runner
from modalign.pipeline.search import search
from modalign.schemas.config import RunConfig

pytestmark = pytest.mark.integration


def _vectors(out: Path) -> dict[int, np.ndarray]:
    t = ds.dataset(out / "features", format="parquet").to_table(columns=["feature_id", "vector"])
    return {fid: np.asarray(v, np.float32) for fid, v in
            zip(t.column("feature_id").to_pylist(), t.column("vector").to_numpy(zero_copy_only=False))}


@pytest.fixture(scope="module")
def twice(ray_local, sample_manifest, tmp_path_factory):
    """(out, first summary, second summary, feature vectors after the first run)."""
    tmp = tmp_path_factory.mktemp("twice")
    out = tmp / "out"
    runner_cfg = RunConfig(key_store=tmp / "keys")
    first = Runner(runner_cfg, out).run(sample_manifest)
    vectors = _vectors(out)
    second = Runner(runner_cfg, out).run(sample_manifest)
    return out, first, second, vectors


def test_second_run_is_served_from_the_cache_with_identical_features(twice):
    out, first, second, vectors = twice
    c1, c2 = first["counts"]["cache"], second["counts"]["cache"]
    assert set(c2["hits"]) >= {"frame", "roi", "patch"} and set(c2["misses"]) >= {"frame", "roi", "patch"}
    assert sum(c1["misses"].values()) > 0 and c1["hit_rate"] < 0.5  # the first run computed its features
    for g in ("frame", "roi"):  # the same vectors were asked for; the second run needed no patch grid
        assert c2["hits"][g] + c2["misses"][g] == c1["hits"][g] + c1["misses"][g] > 0
    assert c2["hit_rate"] >= 0.95, c2
    print(f"second run cache hit rate: {c2['hit_rate']:.3f} ({c2})")
    again = _vectors(out)
    assert again.keys() == vectors.keys() and len(vectors) > 0
    assert all(np.array_equal(again[k], vectors[k]) for k in vectors)  # bit-identical
    assert second["counts"]["features"] == first["counts"]["features"]


def test_a_frame_image_finds_its_own_frame(twice, tmp_path):
    out = twice[0]
    feats = ds.dataset(out / "features", format="parquet").to_table(
        columns=["event_id", "granularity", "modality"]).to_pylist()
    embedded = [f["event_id"] for f in feats if f["modality"] == "video" and f["granularity"] == "frame"]
    events = ds.dataset(out / "events" / "video", format="parquet").to_table(columns=["event_id", "frame_jpeg"])
    jpeg = dict(zip(events.column("event_id").to_pylist(), events.column("frame_jpeg").to_pylist()))
    assert len(embedded) >= 5
    for event_id in (embedded[0], embedded[len(embedded) // 2], embedded[-1]):
        q = tmp_path / "q.png"
        Image.open(io.BytesIO(jpeg[event_id])).save(q)  # the stored de-identified frame, decoded
        res = search(out, image=q, k=3)
        assert res[0]["event_id"] == event_id and res[0]["granularity"] == "frame", res
        assert res[0]["session_id"] == "sample-meeting" and res[0]["t_s"] == pytest.approx(res[0]["t_ns"] / 1e9)
        assert res[0]["score"] > 0.98


def test_a_slides_words_find_its_text_block(twice):
    out = twice[0]
    blocks = ds.dataset(out / "events" / "pdf", format="parquet").to_table(columns=["event_id", "text"]).to_pylist()
    plain = [b for b in blocks if "<" not in b["text"] and len(b["text"].split()) >= 4]
    assert plain
    for b in plain:
        words = re.findall(r"[A-Za-z]{4,}", b["text"])
        query = " ".join(sorted(set(words), key=words.index)[:5])
        res = search(out, text=query, k=2)
        assert res[0]["event_id"] == b["event_id"] and res[0]["text"] == b["text"], (query, res)
    own = search(out, record=plain[0]["event_id"], k=1)[0]
    assert own["event_id"] == plain[0]["event_id"] and own["score"] == pytest.approx(1.0, abs=1e-5)


def test_cache_stats_and_gc_after_the_runs(twice):
    out = twice[0]
    s = cache_stats(out)
    assert s["entries"] > 0 and s["unreferenced"] == 0  # every entry is a feature row's or its patch grid
    image = [m for m in s["by_model"] if m.startswith("efficientnet-lite0@")]
    assert len(image) == 1 and s["by_model"][image[0]]["patch"] == s["by_model"][image[0]]["frame"]  # a grid per frame
    assert s["last_run"]["hit_rate"] >= 0.95
    assert cache_gc(out)["removed"] == 0
