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

from operators.cache.keys import BOX_TYPE, cache_key, feature_id
from operators.cache.store import FeatureCache
from operators.embed.audio import AudioEmbedOperator
from operators.embed.image import FrameEmbedConfig, FrameEmbedOperator, ImageEmbedConfig, ImageEncoder

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
from operators.cache.keys import cache_key, feature_id
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
    assert len(files) == 1 and files[0].startswith("cache-") and files[0].endswith(".parquet")

    reopened = FeatureCache(tmp_path / "cache")
    got = reopened.get("k-patch", "patch")
    assert got.shape == (7, 7, 8) and np.array_equal(got, grid)
    assert np.array_equal(reopened.get("k-frame", "frame"), vec(0))
    assert reopened.get("k-none", "roi") is None
    s = reopened.stats()
    assert s["hits"]["patch"] == 1 and s["hits"]["frame"] == 1 and s["misses"]["roi"] == 1
    assert s["persisted_items"] == 2 and s["segments"] == 1
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
def image_encoder() -> ImageEncoder:
    enc = ImageEncoder(ImageEmbedConfig(device="cpu"))
    enc.setup()
    return enc


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
