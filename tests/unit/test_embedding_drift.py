"""The embedding drift monitor (``operators.monitor.embedding_drift``) on planted shifts, and its
commit-level runner (``pipeline.monitors``) over real feature files of two outputs.

The vectors are synthetic on purpose: a stream of L2-normalised 64-d embeddings of a 16-d latent
(the shape of an image encoder's pooled output), so that a shift is planted exactly at a known
window. ``benchmarks/monitors.py`` runs the same shifts through the real image encoder."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from modalign.operators.monitor.embedding_drift import DriftMonitor, directions, split_windows
from modalign.pipeline.layout import OutputLayout
from modalign.pipeline.monitors import monitor_embeddings
from modalign.schemas.arrow import rows_to_table
from modalign.schemas.config import EmbeddingMonitorConfig
from modalign.schemas.tables import EmbeddingWindowRow, FeatureRow, MonitorAlarmRow

DIM, LATENT, W = 64, 16, 32
SHIFT_AT = 20  # the first shifted window of each planted stream


class Stream:
    """Unit vectors of a fixed 16-d latent basis plus a little noise; seeded. The latent has a mean
    (as pooled ReLU features have: an image encoder's vectors share a direction); noise frames and
    another encoder's basis leave it."""

    def __init__(self, seed: int = 1) -> None:
        self.rng = np.random.default_rng(seed)
        self.basis = self.rng.standard_normal((LATENT, DIM))

    def window(self, n: int = W, *, shift: float = 0.0, noise: bool = False, rotate: np.ndarray | None = None,
               scale: float = 1.0) -> np.ndarray:
        z = self.rng.standard_normal((n, LATENT)) + 1.0
        z[:, 0] += shift
        v = self.rng.standard_normal((n, DIM)) if noise else z @ self.basis + 0.1 * self.rng.standard_normal((n, DIM))
        if rotate is not None:
            v = v @ rotate
        return (v / np.linalg.norm(v, axis=1, keepdims=True) * scale).astype(np.float32)


def run(windows: list[np.ndarray], **cfg) -> list:
    m = DriftMonitor(EmbeddingMonitorConfig(**cfg), DIM)
    return [m.observe(w) for w in windows]


def alarms(results, kind: str = "drift_alarm") -> list[int]:
    return [r.index for r in results if getattr(r, kind)]


def test_stationary_input_rarely_alarms():
    s = Stream()
    res = run([s.window() for _ in range(200)])
    assert all(r.reference for r in res[:8]) and not any(r.reference for r in res[8:])
    scored = res[8:]
    rate = len(alarms(scored)) / len(scored)
    assert rate <= 0.08, f"false-alarm rate {rate:.3f} on stationary input"  # mu + 2 sigma of a skewed KL
    assert not alarms(res, "norm_alarm")


@pytest.mark.parametrize("shift", ["noise", "swapped encoder"])
def test_planted_shift_alarms_at_its_first_window(shift):
    s = Stream()
    rotation = np.linalg.qr(np.random.default_rng(5).standard_normal((DIM, DIM)))[0]  # another encoder's basis
    kw = {"noise": {"noise": True}, "swapped encoder": {"rotate": rotation}}[shift]
    res = run([s.window(**(kw if i >= SHIFT_AT else {})) for i in range(SHIFT_AT + 10)])
    after = alarms(res[SHIFT_AT:])
    assert after[0] == SHIFT_AT, f"first alarm at window {after[0]}"
    assert len(after) >= 6, after  # it goes on alarming while the shift lasts (alpha adapts after 3)
    assert len(alarms(res[:SHIFT_AT])) <= 1
    assert res[SHIFT_AT].divergence > 2 * res[SHIFT_AT].threshold


def test_norm_jump_alarm_on_a_model_that_stops_normalising():
    s = Stream()
    res = run([s.window(scale=5.3 if i >= SHIFT_AT else 1.0) for i in range(SHIFT_AT + 5)])
    assert alarms(res, "norm_alarm") == list(range(SHIFT_AT, SHIFT_AT + 5))
    assert res[SHIFT_AT].mean_norm == pytest.approx(5.3, rel=1e-4)


def test_unit_vectors_float_noise_is_no_norm_change():
    """Norms of 1 +- 1e-7 (float32 normalisation) bin as one value: no divergence from them."""
    s = Stream()
    ref = [s.window() for _ in range(8)]
    wobble = [w * np.float32(1 + 3e-7) for w in (s.window() for _ in range(20))]
    res = run(ref + wobble)
    assert not alarms(res, "norm_alarm")
    assert len(alarms(res)) <= 1


def test_alpha_adapts_after_consecutive_alarms_and_resets():
    s = Stream()
    shifted = list(range(SHIFT_AT, SHIFT_AT + 12))
    windows = [s.window(noise=i in shifted) for i in range(SHIFT_AT + 16)]
    fixed = run(windows, alpha_step=0.0)
    assert alarms(fixed[SHIFT_AT:SHIFT_AT + 12]) == shifted  # alpha fixed: every shifted window
    assert {r.alpha for r in fixed[8:]} == {2.0}
    adapted = run(windows, alpha_step=1.0, adapt_after=3, alpha_max=4.0)
    alphas = [r.alpha for r in adapted[SHIFT_AT:SHIFT_AT + 12]]
    assert alphas[:3] == [2.0, 2.0, 2.0] and alphas[3] == 3.0 and max(alphas) == 4.0  # capped
    back = next(r for r in adapted[SHIFT_AT + 12:] if not r.drift_alarm)
    later = adapted[back.index + 1]
    assert later.alpha == 2.0  # reset after a quiet window


def test_reference_from_another_stream_scores_from_the_first_window():
    s = Stream()
    m = DriftMonitor(EmbeddingMonitorConfig(), DIM)
    m.seed_reference([s.window() for _ in range(10)])
    first = m.observe(s.window(noise=True))
    assert m.ready and not first.reference and first.drift_alarm
    with pytest.raises(ValueError, match="before the first window"):
        m.seed_reference([s.window()])


def test_deterministic_and_checked():
    s1, s2 = Stream(3), Stream(3)
    a = run([s1.window() for _ in range(12)])
    b = run([s2.window() for _ in range(12)])
    assert a == b
    np.testing.assert_array_equal(directions(DIM, 4, 0), directions(DIM, 4, 0))
    assert not np.allclose(directions(DIM, 4, 0), directions(DIM, 4, 1))
    m = DriftMonitor(EmbeddingMonitorConfig(), DIM)
    with pytest.raises(ValueError, match=r"\(n >= 1, 64\)"):
        m.observe(np.zeros((3, 8), np.float32))


def test_split_windows():
    assert split_windows(10, 32) == []  # under half a window
    assert split_windows(16, 32) == [slice(0, 16)]
    assert split_windows(95, 32) == [slice(0, 48), slice(48, 95)]  # 2 windows: 32 to 63 vectors each
    sizes = [w.stop - w.start for w in split_windows(1000, 32)]
    assert sum(sizes) == 1000 and min(sizes) >= 32 and max(sizes) < 64


# -- pipeline.monitors over feature files ------------------------------------------------------

def write_features(root, session: str, vectors: np.ndarray, model: str = "enc@abc", gran: str = "frame",
                   first_id: int = 0) -> str:
    layout = OutputLayout.of(root)
    n = len(vectors)
    rows = [{"session_id": session, "source_id": "cam", "source_uri": "file:///x.mp4", "source_version": "local:1:1",
             "operators": "t@1", "policy": "p@1", "model_id": model, "feature_id": first_id + i, "cache_key": "k",
             "granularity": gran, "modality": "video", "event_id": f"e{first_id + i}", "t_ns": (n - i) * 40_000_000,
             "box": None, "dim": DIM, "vector": vectors[i].tolist()} for i in range(n)]
    path = layout.features(model, gran, session, "cam", "a1", 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    layout.write_table(path, rows_to_table(FeatureRow, rows))
    return layout.relative(path)


def test_monitor_embeddings_writes_windows_and_alarms(tmp_path):
    s = Stream()
    ok = np.concatenate([s.window() for _ in range(10)])  # 320 vectors: 10 windows
    bad = np.concatenate([s.window(noise=True) for _ in range(2)])  # 64: 2 windows
    files = [write_features(tmp_path, "s1-ok", ok), write_features(tmp_path, "s2-bad", bad, first_id=1000)]
    layout = OutputLayout.of(tmp_path)
    res = monitor_embeddings(layout, files, "c1", EmbeddingMonitorConfig())
    assert res["windows"] == 12 and res["alarms"] == {"embedding_drift": 2, "norm_jump": 0}
    assert res["streams"] == [{"model_id": "enc@abc", "granularity": "frame", "windows": 12, "ready": True,
                               "reference": "first 8 windows"}]
    win = pq.read_table(tmp_path / "monitor/embedding/c1.parquet")
    assert win.schema == EmbeddingWindowRow.schema()
    rows = win.to_pylist()
    assert [r["session_id"] for r in rows] == ["s1-ok"] * 10 + ["s2-bad"] * 2  # never spanning sessions
    assert [r["reference"] for r in rows] == [True] * 8 + [False] * 4
    assert [r["drift_alarm"] for r in rows[8:]] == [False, False, True, True]
    assert rows[0]["start_t_ns"] == 40_000_000 and rows[0]["end_t_ns"] < rows[1]["start_t_ns"]  # time order
    al = pq.read_table(tmp_path / "monitor/alarms/c1.parquet")
    assert al.schema == MonitorAlarmRow.schema()
    assert [(a["kind"], a["session_id"], a["window_index"]) for a in al.to_pylist()] == [
        ("embedding_drift", "s2-bad", 10), ("embedding_drift", "s2-bad", 11)]
    assert res["files"] == ["monitor/embedding/c1.parquet", "monitor/alarms/c1.parquet"]


def test_monitor_embeddings_reference_from_out0_and_disabled(tmp_path):
    s = Stream()
    out0, out1 = tmp_path / "out0", tmp_path / "out1"
    ref_files = [write_features(out0, "base", np.concatenate([s.window() for _ in range(8)]))]
    files = [write_features(out1, "new", np.concatenate([s.window() for _ in range(3)] + [s.window(noise=True)]))]
    res = monitor_embeddings(OutputLayout.of(out1), files, "c2", EmbeddingMonitorConfig(),
                             OutputLayout.of(out0), ref_files)
    assert res["streams"][0]["reference"] == f"8 windows of {OutputLayout.of(out0).uri}"
    rows = pq.read_table(out1 / "monitor/embedding/c2.parquet").to_pylist()
    assert [r["reference"] for r in rows] == [False] * 4
    # t_ns runs backwards in the file: the noise vectors, written last, are the session's first window
    assert [r["drift_alarm"] for r in rows] == [True, False, False, False]
    off = monitor_embeddings(OutputLayout.of(out1), files, "c3", EmbeddingMonitorConfig(enabled=False))
    assert off["files"] == [] and not (out1 / "monitor/embedding/c3.parquet").exists()
