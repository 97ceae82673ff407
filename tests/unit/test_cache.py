"""Feature cache: content-addressed keys, the two-tier store, and its use by the embed operators."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from skimage import data

from modalign.operators.cache.keys import BOX_TYPE, cache_key, feature_id
from modalign.operators.cache.store import FeatureCache
from modalign.operators.embed.audio import AudioEmbedOperator
from modalign.operators.embed.image import FrameEmbedConfig, FrameEmbedOperator

pytestmark = pytest.mark.unit

# -- keys --------------------------------------------------------------------------------------

FIELDS = ("content", "model_id", "granularity", "resolution", "crop_box", "normalisation")
coords = st.integers(min_value=0, max_value=4096)
param_values = {
    "content": st.binary(min_size=0, max_size=64),
    "model_id": st.text(min_size=1, max_size=30),
    "granularity": st.sampled_from(["frame", "roi", "patch"]),
    "resolution": st.none() | st.tuples(st.integers(1, 4096), st.integers(1, 4096)),
    "crop_box": st.none() | st.tuples(coords, coords, coords, coords),
    "normalisation": st.sampled_from(["imagenet", "l2", "none", "tf"]) | st.text(max_size=12),
}
params = st.fixed_dictionaries(param_values)


def key_of(p: dict) -> str:
    return cache_key(p["content"], model_id=p["model_id"], granularity=p["granularity"],
                     resolution=p["resolution"], crop_box=p["crop_box"], normalisation=p["normalisation"])


@settings(max_examples=300, deadline=None)
@given(base=params, field=st.sampled_from(FIELDS), data=st.data())
def test_any_change_of_one_field_changes_the_key(base, field, data):
    new = data.draw(param_values[field].filter(lambda v: v != base[field]), label=field)
    changed = {**base, field: new}
    assert key_of(changed) != key_of(base)
    assert key_of(dict(base)) == key_of(base)


@settings(max_examples=100, deadline=None)
@given(content=st.binary(min_size=1, max_size=64), pos=st.integers(0, 63), bit=st.integers(0, 7))
def test_flipping_one_bit_of_content_changes_the_key(content, pos, bit):
    flipped = bytearray(content)
    flipped[pos % len(content)] ^= 1 << bit
    common = dict(model_id="m@1", granularity="frame", resolution=224, crop_box=None, normalisation="imagenet")
    assert cache_key(bytes(flipped), **common) != cache_key(content, **common)


def test_arrays_key_on_dtype_and_shape_and_equal_numbers_agree():
    common = dict(model_id="m@1", granularity="patch", crop_box=None, normalisation="imagenet")
    a = np.arange(24, dtype=np.uint8)
    keys = {cache_key(x, resolution=224, **common) for x in (a, a.reshape(4, 6), a.reshape(6, 4), a.astype(np.int16))}
    assert len(keys) == 4
    assert cache_key(a, resolution=224, **common) != cache_key(a.tobytes(), resolution=224, **common)
    # documented canonical forms: an int resolution is square; numbers compare by value
    assert cache_key(a, resolution=224, **common) == cache_key(a, resolution=(224, 224), **common)
    roi = dict(model_id="m@1", granularity="roi", resolution=224, normalisation="imagenet")
    assert cache_key(a, crop_box=(1, 2, 3, 4), **roi) == cache_key(a, crop_box=(1.0, 2.0, np.int32(3), 4.0), **roi)
    # a non-contiguous view hashes like its contiguous copy
    b = np.arange(48, dtype=np.uint8).reshape(8, 6)[:, ::2]
    assert cache_key(b, resolution=224, **common) == cache_key(b.copy(), resolution=224, **common)
    with pytest.raises(ValueError):
        cache_key(a, resolution=224, model_id="m@1", granularity="page", crop_box=None, normalisation="x")


@settings(max_examples=200, deadline=None)
@given(key=st.text(max_size=64), event=st.text(max_size=16), g=st.sampled_from(["frame", "roi", "patch"]),
       box=st.none() | st.tuples(coords, coords, coords, coords))
def test_feature_id_is_a_positive_63_bit_int(key, event, g, box):
    fid = feature_id(key, event, g, box)
    assert 0 < fid < 2**63
    assert fid == feature_id(key, event, g, box)
    assert fid != feature_id(key, event + "x", g, box)


KEY_SCRIPT = """
import json, numpy as np
from modalign.operators.cache.keys import cache_key, feature_id
frame = (np.arange(4 * 5 * 3) % 251).astype(np.uint8).reshape(4, 5, 3)
k1 = cache_key(frame, model_id="efficientnet-lite0@abc", granularity="roi", resolution=224,
               crop_box=(1, 2, 3, 4), normalisation="imagenet")
k2 = cache_key(b"hello", model_id="all-minilm-l6-v2@def", granularity="roi", resolution=256,
               crop_box=None, normalisation="l2")
print(json.dumps([k1, k2, feature_id(k1, "v-7", "roi", {"x0": 1, "y0": 2, "x1": 3, "y1": 4, "score": 0.5})]))
"""


def test_keys_are_identical_across_processes():
    runs = [json.loads(subprocess.run([sys.executable, "-c", KEY_SCRIPT], capture_output=True, text=True,
                                      check=True, env={**os.environ, "PYTHONHASHSEED": str(seed)},
                                      cwd=Path(__file__).resolve().parents[2]).stdout)
            for seed in (1, 2)]
    ns: dict = {}
    exec(compile(KEY_SCRIPT.replace("print(", "result = ("), "<keys>", "exec"), ns)
    here = json.loads(ns["result"])
    assert runs[0] == runs[1] == here
    # golden values: a change here invalidates every cache on disk (bump KEY_VERSION on purpose)
    assert here == ["b7091919e31d1e1c2e5aae65b02336b8561939965446db6222c0e6f95b29ac88",
                    "cc8c979421482a95fcd97d101c958ceade5d78f395f1a2db1b9eb11268b3d36d", 1512719441608575768]


# -- store -------------------------------------------------------------------------------------


def vec(seed: int, shape=(16,)) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def test_store_persists_across_instances(tmp_path):
    cache = FeatureCache(tmp_path / "cache")
    grid = vec(1, (7, 7, 8))
    cache.put("k-frame", "frame", vec(0), model_id="m@1")
    cache.put("k-patch", "patch", grid, model_id="m@1")
    assert FeatureCache(tmp_path / "cache").get("k-frame") is None  # not flushed yet
    assert cache.flush() == 2 and cache.flush() == 0
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(files) == 2  # grids apart from pooled vectors: a frame lookup never decodes grids
    assert all(f.startswith("cache-") and f.endswith(".parquet") for f in files)

    reopened = FeatureCache(tmp_path / "cache")
    got = reopened.get("k-patch", "patch")
    assert got.shape == (7, 7, 8) and np.array_equal(got, grid)
    assert np.array_equal(reopened.get("k-frame", "frame"), vec(0))
    assert reopened.get("k-none", "roi") is None
    s = reopened.stats()
    assert s["hits"]["patch"] == 1 and s["hits"]["frame"] == 1 and s["misses"]["roi"] == 1
    assert s["persisted_items"] == 2 and s["segments"] == 2
    assert reopened.keys() == {"k-frame", "k-patch"} and reopened.keys("patch") == {"k-patch"}
    # a second writer adds its own segment; refresh() makes it visible to the first
    other = FeatureCache(tmp_path / "cache")
    other.put("k-roi", "roi", vec(2))
    other.flush()
    assert reopened.get("k-roi") is None
    reopened.refresh()
    assert np.array_equal(reopened.get("k-roi"), vec(2))


def test_lru_evicts_least_recently_used(tmp_path):
    mem = FeatureCache(None, lru_items=2)
    mem.put("a", "frame", vec(0))
    mem.put("b", "frame", vec(1))
    assert mem.get("a") is not None  # a is now more recent than b
    mem.put("c", "frame", vec(2))
    assert mem.get("b") is None and mem.get("a") is not None and mem.get("c") is not None
    assert mem.stats()["memory_items"] == 2
    # with a path, an entry evicted from memory is still on disk
    disk = FeatureCache(tmp_path / "c", lru_items=1)
    disk.put("a", "roi", vec(0))
    disk.put("b", "roi", vec(1))
    disk.flush()
    assert disk.stats()["memory_items"] == 1
    assert np.array_equal(disk.get("a"), vec(0)) and np.array_equal(disk.get("b"), vec(1))


def test_gc_removes_unreferenced_entries(tmp_path):
    cache = FeatureCache(tmp_path / "c")
    for i, k in enumerate("abcd"):
        cache.put(k, "frame", vec(i))
    cache.flush()
    cache.put("e", "roi", vec(9))  # pending, unreferenced
    assert cache.gc({"a", "c"}) == 3
    reopened = FeatureCache(tmp_path / "c")
    assert reopened.keys() == {"a", "c"}
    assert np.array_equal(reopened.get("c"), vec(2))
    assert cache.get("b") is None and cache.get("e") is None
    assert cache.remove(["a"]) == 1 and FeatureCache(tmp_path / "c").keys() == {"c"}
    assert not [p for p in (tmp_path / "c").iterdir() if p.name.endswith(".tmp")]


def test_returned_vectors_are_read_only_copies():
    cache = FeatureCache(None)
    v = vec(0)
    cache.put("a", "frame", v)
    v[0] = 123.0
    got = cache.get("a")
    assert got[0] != 123.0 and not got.flags.writeable


# -- operators with a cache --------------------------------------------------------------------


@pytest.fixture(scope="module")
def frames() -> tuple[pa.Table, int]:
    astro = data.astronaut()[::2, ::2]  # 256 x 256
    rng = np.random.default_rng(3)
    stack = np.stack([astro, astro[:, ::-1], rng.integers(0, 256, astro.shape, dtype=np.uint8)])
    boxes = [[(87, 34, 139, 86)], [(117, 34, 169, 86), (0, 0, 40, 120)], []]
    table = pa.table({
        "event_id": [f"v-{i}" for i in range(3)],
        "t_ns": pa.array([i * 1_000_000_000 for i in range(3)], pa.int64()),
        "frame": pa.FixedShapeTensorArray.from_numpy_ndarray(np.array(stack, copy=True)),
        "face_boxes": pa.array([[dict(zip(("x0", "y0", "x1", "y1"), b)) for b in bs] for bs in boxes],
                               pa.list_(BOX_TYPE)),
    })
    return table, 3


def test_second_frame_embed_run_is_all_hits_with_identical_vectors(image_encoder, frames, tmp_path):
    table, n_roi = frames
    cache = FeatureCache(tmp_path / "c")
    cfg = FrameEmbedConfig(encoder=image_encoder.config)
    calls = image_encoder.forward_calls
    first = FrameEmbedOperator(cfg, encoder=image_encoder, cache=cache).process(table)
    assert image_encoder.forward_calls == calls + 1  # one batched pass for 3 frames
    s = cache.stats()
    assert s["misses"] == {"frame": 3, "roi": n_roi, "patch": 3} and sum(s["hits"].values()) == 0
    cache.flush()

    for reopened in (cache, FeatureCache(tmp_path / "c")):  # same process, then from disk
        reopened.reset_stats()
        again = FrameEmbedOperator(cfg, encoder=image_encoder, cache=reopened).process(table)
        s = reopened.stats()
        assert s["hits"]["frame"] == 3 and s["hits"]["roi"] == n_roi and sum(s["misses"].values()) == 0
        assert s["hit_rate"] == 1.0
        assert image_encoder.forward_calls == calls + 1
        assert again.equals(first)  # bit-identical vectors, same ids and keys


def test_frame_and_roi_pooled_from_cached_patches_without_forward_pass(image_encoder, frames, tmp_path):
    table, n_roi = frames
    cache = FeatureCache(tmp_path / "c")
    cfg = FrameEmbedConfig(encoder=image_encoder.config)
    first = FrameEmbedOperator(cfg, encoder=image_encoder, cache=cache).process(table)
    cache.flush()
    patch_keys = cache.keys("patch")
    assert len(patch_keys) == 3
    assert cache.gc(patch_keys) == 3 + n_roi  # only the patch grids remain

    only_patches = FeatureCache(tmp_path / "c")
    assert only_patches.keys() == patch_keys
    calls = image_encoder.forward_calls
    again = FrameEmbedOperator(cfg, encoder=image_encoder, cache=only_patches).process(table)
    assert image_encoder.forward_calls == calls  # no forward pass
    s = only_patches.stats()
    assert s["hits"] == {"frame": 3, "roi": n_roi, "patch": 3} and sum(s["misses"].values()) == 0
    assert again.equals(first)
    # the pooled vectors were put back: the frame and roi keys are cached again
    assert len(only_patches.keys("frame")) == 3 and len(only_patches.keys("roi")) == n_roi


def test_audio_embed_uses_the_cache():
    rng = np.random.default_rng(0)
    mfcc = rng.normal(size=(200, 13)).astype(np.float32)
    table = pa.table({
        "event_id": [f"a-{i}" for i in range(200)],
        "t_ns": pa.array(np.arange(200, dtype=np.int64) * 10_000_000),
        "mfcc": pa.FixedSizeListArray.from_arrays(pa.array(mfcc.reshape(-1)), 13),
    })
    cache = FeatureCache(None)
    first = AudioEmbedOperator(cache=cache).process(table)
    second = AudioEmbedOperator(cache=cache).process(table)
    s = cache.stats()
    assert s["misses"]["frame"] == 2 and s["hits"]["frame"] == 2
    assert second.equals(first)


# -- parent links, byte bounds, old segments ---------------------------------------------------


def test_gc_keeps_the_patch_grids_referenced_entries_were_pooled_from(tmp_path):
    cache = FeatureCache(tmp_path / "c")
    cache.put("g1", "patch", vec(1, (7, 7, 4)))
    cache.put("g2", "patch", vec(2, (7, 7, 4)))
    cache.put("f1", "frame", vec(3), parent="g1")
    cache.put("r1", "roi", vec(4), parent="g1")
    cache.put("f2", "frame", vec(5), parent="g2")
    cache.flush()
    cat = cache.catalog()
    assert dict(zip(cat.column("cache_key").to_pylist(), cat.column("parent_key").to_pylist())) == {
        "g1": None, "g2": None, "f1": "g1", "r1": "g1", "f2": "g2"}
    assert cache.gc({"f1"}) == 3  # r1, f2, g2 go; g1 stays as f1's parent
    assert FeatureCache(tmp_path / "c").keys() == {"f1", "g1"}
    assert cache.gc({"f1"}, keep_parents=False) == 1
    assert FeatureCache(tmp_path / "c").keys() == {"f1"}


def test_memory_tiers_are_bounded_in_bytes(tmp_path):
    grid = vec(0, (7, 7, 1280))  # 245 KiB
    mem = FeatureCache(None, lru_bytes=3 * grid.nbytes)
    for i in range(5):
        mem.put(f"g{i}", "patch", grid)
    s = mem.stats()
    assert s["memory_items"] == 3 and mem.get("g0") is None and mem.get("g4") is not None
    disk = FeatureCache(tmp_path / "c", flush_bytes=2 * grid.nbytes)
    disk.put("a", "patch", grid)
    assert disk.stats()["pending_items"] == 1 and disk.stats()["segments"] == 0
    disk.put("b", "patch", grid)  # the byte bound flushes both
    assert disk.stats()["pending_items"] == 0 and disk.stats()["segments"] == 1


def test_segments_written_before_parent_keys_still_read(tmp_path):
    import pyarrow.parquet as pq

    (tmp_path / "c").mkdir()
    old = pa.table({
        "cache_key": ["a"], "granularity": ["frame"], "model_id": ["m@1"], "dim": pa.array([4], pa.int32()),
        "shape": pa.array([[4]], pa.list_(pa.int32())), "vector": pa.array([vec(0, (4,))], pa.list_(pa.float32())),
    })
    pq.write_table(old, tmp_path / "c" / "cache-00000000000000000001-abcdef12.parquet")
    cache = FeatureCache(tmp_path / "c")
    assert np.array_equal(cache.get("a"), vec(0, (4,)))
    assert cache.catalog().column("parent_key").to_pylist() == [None]
    cache.put("b", "roi", vec(1, (4,)), parent="a")
    cache.flush()
    assert cache.gc({"b"}) == 0 and FeatureCache(tmp_path / "c").keys() == {"a", "b"}


def test_lookups_decode_one_row_group_not_the_segment(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    from modalign.operators.cache import store

    monkeypatch.setattr(store, "ROW_GROUP_BYTES", 3 * 7 * 7 * 8 * 4)  # 3 grids per row group
    grids = {f"g{i}": vec(i, (7, 7, 8)) for i in range(8)}
    (tmp_path / "c").mkdir()
    seg = tmp_path / "c" / "cache-00000000000000000001-00000000.parquet"  # as earlier versions wrote them
    store._write_segment(seg, list(grids), [store._Entry("patch", "m@1", g) for g in grids.values()])
    assert [pq.read_metadata(seg).row_group(i).num_rows for i in range(3)] == [3, 3, 2]
    reopened = FeatureCache(tmp_path / "c", decoded_segments=1)
    for k in ["g7", "g0", "g4", "g5"]:
        assert np.array_equal(reopened.get(k), grids[k])
    assert len(reopened._decoded) == 1 and next(iter(reopened._decoded))[1] == 1  # g5's row group only


def test_a_flush_writes_one_model_per_segment_and_one_row_group_each(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    from modalign.operators.cache import store

    monkeypatch.setattr(store, "ROW_GROUP_BYTES", 3 * 16 * 4)  # 3 vectors of 16 values per row group
    cache = FeatureCache(tmp_path / "c")
    for i in range(7):
        cache.put(f"img{i}", "frame", vec(i), model_id="image@1")
    cache.put("txt0", "frame", vec(9), model_id="text@1")
    cache.flush()
    segments = sorted((tmp_path / "c").glob("cache-*.parquet"))
    models = [set(pq.read_table(s, columns=["model_id"]).column(0).to_pylist()) for s in segments]
    assert sorted(map(sorted, models)) == [["image@1"]] * 3 + [["text@1"]]
    assert all(pq.read_metadata(s).num_row_groups == 1 for s in segments)
    sizes = sorted(pq.read_metadata(s).num_rows for s, m in zip(segments, models) if m == {"image@1"})
    assert sizes == [1, 3, 3]
    # an erasure of one image entry rewrites the one segment that holds it; the others stay as they are
    before = {s.name: s.stat().st_mtime_ns for s in segments}
    assert FeatureCache(tmp_path / "c").remove(["img0"]) == 1
    after = {s.name for s in (tmp_path / "c").glob("cache-*.parquet")}
    assert len(set(before) - after) == 1 and len(after - set(before)) == 1
    reopened = FeatureCache(tmp_path / "c")
    assert reopened.get("img0") is None and all(np.array_equal(reopened.get(f"img{i}"), vec(i)) for i in range(1, 7))


def test_catalog_counts_a_key_written_by_two_writers_once(tmp_path):
    writers = [FeatureCache(tmp_path / "c") for _ in range(2)]  # two actors, concurrently
    for w in writers:
        w.put("same", "frame", vec(0))
    for w in writers:
        w.flush()
    cache = FeatureCache(tmp_path / "c")
    assert cache.stats()["segments"] == 2 and cache.catalog().num_rows == 1 and cache.get("same") is not None


# -- modalign cache stats|gc (pipeline/cache_admin.py) -------------------------------------------


def _write_features(out: Path, table: pa.Table, name: str) -> list[str]:
    """Feature files as a run writes them; returns their names relative to OUT (for the commit)."""
    import pyarrow.parquet as pq

    model = table.column("model_id")[0].as_py()
    files = []
    for gran in set(table.column("granularity").to_pylist()):
        d = out / "features" / model / gran / "s"
        d.mkdir(parents=True, exist_ok=True)
        sub = table.filter(pa.compute.equal(table.column("granularity"), gran))
        pq.write_table(sub, d / f"{name}.parquet")
        files.append((d / f"{name}.parquet").relative_to(out).as_posix())
    return files


def test_cache_stats_and_gc_of_an_output_folder(image_encoder, frames, tmp_path):
    import pyarrow.compute  # noqa: F401  (pa.compute)

    from modalign.pipeline.cache_admin import cache_gc, cache_stats, render_stats
    from modalign.pipeline.commits import CommitLog
    from modalign.schemas.errors import ConfigError

    table, n_roi = frames
    out = tmp_path / "out"
    cache = FeatureCache(out / "cache")
    cfg = FrameEmbedConfig(encoder=image_encoder.config)
    feats = FrameEmbedOperator(cfg, encoder=image_encoder, cache=cache).process(table)
    cache.flush()
    with pytest.raises(ConfigError, match="no committed feature files"):
        cache_gc(out)  # an empty features folder is a wrong path, not a wish to drop everything
    # the output keeps the rows of frames 0 and 1 only (frame 2's were deleted)
    keep = pa.compute.is_in(feats.column("event_id"), pa.array(["v-0", "v-1"]))
    files = _write_features(out, feats.filter(keep), "part0")
    _write_features(out, feats, "uncommitted")  # a crashed run's parts: no reader counts them
    CommitLog.of(out).commit(None, run_id="abc123", sessions={"s": {"run_id": "abc123", "files": files}}, shared=[],
                             summary={"run_id": "abc123", "counts": {"cache": {
                                 "hits": {"frame": 3, "roi": 3, "patch": 0},
                                 "misses": {"frame": 0, "roi": 0, "patch": 0}, "hit_rate": 1.0}}})

    s = cache_stats(out)
    assert s["entries"] == 3 + n_roi + 3 and s["segments"] == 2 and s["bytes"] > 0
    assert {g: v["entries"] for g, v in s["by_granularity"].items()} == {"frame": 3, "roi": n_roi, "patch": 3}
    assert s["by_model"] == {image_encoder.model_id: {"frame": 3, "patch": 3, "roi": n_roi}}
    # kept: frames 0 and 1 (frame + 3 roi entries) and their 2 patch grids; frame 2's frame + grid go
    assert s["referenced"] == 2 + n_roi + 2 and s["unreferenced"] == 2
    assert s["unreferenced_by_granularity"] == {"frame": 1, "roi": 0, "patch": 1}
    assert s["last_run"]["hit_rate"] == 1.0
    text = render_stats(s)
    assert "gc would remove 2" in text and "hit rate 100.0%" in text and image_encoder.model_id in text

    dry = cache_gc(out, dry_run=True)
    assert dry["removed"] == 2 and FeatureCache(out / "cache").catalog().num_rows == 3 + n_roi + 3
    res = cache_gc(out)
    assert res["removed"] == 2 and res["removed_by_granularity"] == {"frame": 1, "roi": 0, "patch": 1}
    assert res["kept"] == 2 + n_roi + 2 and res["bytes_after"] < res["bytes_before"]
    assert "removed 2 entries" in render_stats(res)
    assert cache_stats(out)["unreferenced"] == 0 and cache_gc(out)["removed"] == 0

    # the kept grids still serve new boxes on frames 0 and 1 without a forward pass
    boxes = [[{"x0": 0, "y0": 0, "x1": 128, "y1": 128}], [{"x0": 100, "y0": 100, "x1": 256, "y1": 256}]]
    again = table.slice(0, 2).set_column(3, "face_boxes", pa.array(boxes, pa.list_(BOX_TYPE)))
    warm = FeatureCache(out / "cache")
    calls = image_encoder.forward_calls
    FrameEmbedOperator(cfg, encoder=image_encoder, cache=warm).process(again)
    assert image_encoder.forward_calls == calls and warm.stats()["hit_rate"] == 1.0


def test_patch_cached_workload_asking_frame_and_roi_is_served_without_forward_passes(image_encoder, frames,
                                                                                      tmp_path):
    """Patches cached, frame/roi entries not: every frame and roi vector (faces + a 3 x 3 grid of areas) is pooled."""
    table, n_roi = frames
    cache = FeatureCache(tmp_path / "c")
    cfg = FrameEmbedConfig(encoder=image_encoder.config)
    FrameEmbedOperator(cfg, encoder=image_encoder, cache=cache).process(table)
    cache.flush()
    cache.gc(cache.keys("patch"), keep_parents=False)
    areas = [{"x0": x, "y0": y, "x1": x + 85, "y1": y + 85} for x in (0, 85, 170) for y in (0, 85, 170)]
    boxes = [list(b) + areas for b in table.column("face_boxes").to_pylist()]
    workload = table.set_column(3, "face_boxes", pa.array(boxes, pa.list_(BOX_TYPE)))
    warm = FeatureCache(tmp_path / "c")
    calls = image_encoder.forward_calls
    rows = FrameEmbedOperator(cfg, encoder=image_encoder, cache=warm).process(workload)
    s = warm.stats()
    assert image_encoder.forward_calls == calls
    assert rows.num_rows == 3 + n_roi + 27 and s["hits"]["roi"] == n_roi + 27 and s["hits"]["frame"] == 3
    assert s["hit_rate"] >= 0.8  # measured: 1.0 (every vector pooled from a cached grid)
