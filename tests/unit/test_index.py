"""FAISS feature index: search, replace, remove (erasure), save/load (operators/cache/index.py)."""

from __future__ import annotations

import numpy as np
import pytest

from modalign.operators.cache.index import FeatureIndex

pytestmark = pytest.mark.unit


def unit_vectors(n: int, dim: int, seed: int = 0) -> np.ndarray:
    v = np.random.default_rng(seed).normal(size=(n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


@pytest.fixture
def filled() -> tuple[FeatureIndex, np.ndarray, np.ndarray]:
    vecs = unit_vectors(200, 64)
    ids = np.random.default_rng(1).choice(2**62, size=200, replace=False).astype(np.int64)
    index = FeatureIndex(64)
    index.add(ids, vecs)
    return index, ids, vecs


def test_search_returns_each_vector_first_with_cosine_one(filled):
    index, ids, vecs = filled
    assert index.ntotal == 200 and index.device == "cpu"
    scores, found = index.search(vecs, k=3)
    assert found.shape == (200, 3) and found.dtype == np.int64
    assert np.array_equal(found[:, 0], ids)
    assert np.allclose(scores[:, 0], 1.0, atol=1e-5) and np.all(scores[:, 1] < scores[:, 0])
    s1, f1 = index.search(vecs[7], k=1)  # a single vector is a batch of one
    assert f1[0, 0] == ids[7]


def test_remove_then_search_no_longer_returns_them(filled):
    index, ids, vecs = filled
    gone = ids[:10]
    assert index.remove(gone) == 10
    assert index.remove(gone) == 0
    assert index.ntotal == 190
    _, found = index.search(vecs[:10], k=5)
    assert not np.isin(found, gone).any()
    _, found = index.search(vecs[10:], k=1)
    assert np.array_equal(found[:, 0], ids[10:])
    assert ids[0] not in index and ids[10] in index


def test_add_replaces_an_existing_id(filled):
    index, ids, vecs = filled
    new = unit_vectors(1, 64, seed=99)
    index.add(ids[:1], new)
    assert index.ntotal == 200
    assert np.allclose(index.reconstruct(int(ids[0])), new[0])
    _, found = index.search(new, k=1)
    assert found[0, 0] == ids[0]
    with pytest.raises(ValueError):
        index.add(np.array([5, 5]), unit_vectors(2, 64))
    with pytest.raises(ValueError):
        index.add(np.array([6]), unit_vectors(1, 32))


def test_save_load_roundtrip(filled, tmp_path):
    index, ids, vecs = filled
    path = index.save(tmp_path / "idx" / "efficientnet-lite0.frame.faiss")
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    loaded = FeatureIndex.load(path)
    assert loaded.ntotal == 200 and loaded.dim == 64 and loaded.metric == "ip"
    assert np.array_equal(np.sort(loaded.ids()), np.sort(ids))
    s0, f0 = index.search(vecs[:20], k=4)
    s1, f1 = loaded.search(vecs[:20], k=4)
    assert np.array_equal(f0, f1) and np.allclose(s0, s1)
    assert loaded.remove(ids[:3]) == 3 and loaded.ntotal == 197  # deletes work after loading


def test_l2_metric_and_empty_index():
    index = FeatureIndex(8, metric="l2")
    _, found = index.search(np.zeros(8, np.float32), k=2)
    assert (found == -1).all()
    index.add(np.array([11, 12], np.int64), np.array([[0] * 8, [1] * 8], np.float32))
    scores, found = index.search(np.full(8, 0.9, np.float32), k=2)
    assert found[0].tolist() == [12, 11] and scores[0, 0] == pytest.approx(8 * 0.01, abs=1e-5)
    with pytest.raises(ValueError):
        FeatureIndex(8, metric="cosine")
