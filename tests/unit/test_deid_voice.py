"""VoicePolicyOperator (keep_mfcc / anonymise / drop) and the McAdams waveform transform.

Speaker linkability before/after (resemblyzer) is measured in test_deid_eval.py."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from modalign.operators.deid.voice import (McAdamsTransform, VoicePolicyConfig, VoicePolicyOperator, mark_transformed,
                                  voice_transform)
from modalign.schemas.errors import ComplianceError
from modalign.schemas.policy import DEFAULT_POLICY_TAG, VoicePolicy

pytestmark = pytest.mark.unit

N_MFCC = 40


def mfcc_table(n: int = 5, with_waveform: bool = False) -> pa.Table:
    rng = np.random.default_rng(1)
    mfcc = rng.standard_normal((n, N_MFCC)).astype(np.float32)
    cols = {
        "event_id": [f"s1/lapel/audio/{i}" for i in range(n)],
        "t_ns": pa.array([i * 10_000_000 for i in range(n)], pa.int64()),
        "frame_index": pa.array(range(n), pa.int64()),
        "mfcc": pa.FixedSizeListArray.from_arrays(pa.array(mfcc.reshape(-1)), N_MFCC),
    }
    if with_waveform:
        cols["samples"] = pa.array([rng.standard_normal(160).astype(np.float32).tolist() for _ in range(n)])
    return pa.table(cols)


def test_keep_mfcc_passes_frames_and_adds_header():
    table = mfcc_table()
    out = VoicePolicyOperator().process(table)
    assert out.num_rows == 5
    assert out.drop_columns(["deid"]).equals(table)
    assert out.column("deid").to_pylist() == [
        {"policy": DEFAULT_POLICY_TAG, "method": "waveform_dropped", "detector": "none", "count": 0, "threshold": 0.0}
    ] * 5
    # the MFCC values are the input's buffer, not a copy
    a = table.column("mfcc").chunk(0).values.to_numpy()
    b = out.column("mfcc").chunk(0).values.to_numpy()
    assert np.shares_memory(a, b)


def test_drop_gives_zero_rows_with_schema_kept():
    table = mfcc_table()
    op = VoicePolicyOperator(VoicePolicyConfig(voice=VoicePolicy(action="drop"), policy_tag="strict@2"))
    out = op.process(table)
    assert out.num_rows == 0
    assert out.schema == op.output_schema(table.schema)
    assert out.schema.names == ["event_id", "t_ns", "frame_index", "mfcc", "deid"]
    assert out.schema.field("mfcc").type == table.schema.field("mfcc").type
    assert table.num_rows == 5  # input untouched


def test_raw_waveform_column_never_passes():
    out = VoicePolicyOperator().process(mfcc_table(3, with_waveform=True))
    assert "samples" not in out.column_names
    assert out.num_rows == 3 and out.column("mfcc").type.list_size == N_MFCC


# -- McAdams anonymisation ---------------------------------------------------------------------
RATE = 16000


def vowel_like(seconds: float = 1.0, f0: float = 120.0, formants=(700.0, 1200.0, 2600.0)) -> np.ndarray:
    """A glottal pulse train through three resonators: speech-like, with known formants."""
    from scipy.signal import lfilter

    n = int(seconds * RATE)
    x = np.zeros(n)
    x[:: int(RATE / f0)] = 1.0
    for f in formants:
        r, theta = 0.97, 2 * np.pi * f / RATE
        x = lfilter([1.0], [1.0, -2 * r * np.cos(theta), r * r], x)
    return (0.3 * x / np.abs(x).max()).astype(np.float32)


def lpc_peak_hz(x: np.ndarray) -> float:
    """Frequency of the strongest spectral peak below 1.5 kHz (first formant region)."""
    spec = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    freqs = np.fft.rfftfreq(len(x), 1 / RATE)
    band = (freqs > 300) & (freqs < 1500)
    smooth = np.convolve(spec, np.ones(60) / 60, mode="same")
    return float(freqs[band][np.argmax(smooth[band])])


def test_mcadams_alpha_one_reconstructs_input_and_keeps_length():
    x = vowel_like(0.73)
    y = McAdamsTransform(alpha=1.0)(x)
    assert y.dtype == np.float32 and y.shape == x.shape
    assert np.abs(y - x).max() < 1e-3 * np.abs(x).max()
    assert McAdamsTransform(0.8)(np.zeros(0, np.float32)).shape == (0,)
    assert np.array_equal(McAdamsTransform(0.8)(np.zeros(800, np.float32)), np.zeros(800, np.float32))


def test_mcadams_moves_formants_and_keeps_energy_contour():
    x = vowel_like(1.0)
    y = McAdamsTransform(alpha=0.8)(x)
    assert np.isfinite(y).all()
    # F1 at 700 Hz (0.27 rad) moves up: 0.27 ** 0.8 rad = 1.1 kHz
    assert lpc_peak_hz(x) == pytest.approx(700, abs=60)
    assert lpc_peak_hz(y) > 900
    # 20 ms frame energies are kept (so an energy VAD gives the same decisions)
    fx, fy = (np.sqrt((s[: len(s) // 320 * 320].reshape(-1, 320) ** 2).mean(axis=1)) for s in (x, y))
    assert np.allclose(fx, fy, rtol=0.25, atol=1e-4)
    assert not np.allclose(x, y, atol=0.02)


def test_mcadams_is_deterministic_and_chunk_seams_are_local():
    x = np.concatenate([vowel_like(0.5, f0=110), vowel_like(0.5, f0=140, formants=(500, 1500, 2500))])
    tf = McAdamsTransform(alpha=0.8)
    whole = tf(x)
    assert np.array_equal(whole, tf(x))
    cut = 8000
    chunked = np.concatenate([tf(x[:cut]), tf(x[cut:])])
    far = np.ones(len(x), bool)
    far[cut - 320: cut + 320] = False  # one 20 ms frame either side of the seam
    assert np.allclose(whole[far], chunked[far], atol=1e-5)


def test_voice_transform_hook_only_for_anonymise():
    assert voice_transform(VoicePolicy()) is None
    assert voice_transform(VoicePolicy(action="drop")) is None
    tf = voice_transform(VoicePolicy(action="anonymise", mcadams_alpha=0.75))
    assert isinstance(tf, McAdamsTransform) and tf.alpha == 0.75 and tf.name.startswith("mcadams@1/alpha=0.750")
    import pickle

    assert pickle.loads(pickle.dumps(tf)).name == tf.name  # travels to Ray workers


def test_anonymise_policy_requires_the_transform_marker():
    pol = VoicePolicy(action="anonymise")
    op = VoicePolicyOperator(VoicePolicyConfig(voice=pol))
    table = mfcc_table()
    with pytest.raises(ComplianceError) as exc:
        op.process(table)  # MFCCs of the original voice must never be labelled anonymised
    assert "s1/lapel/audio/0" in str(exc.value)
    wrong = mark_transformed(table, McAdamsTransform(alpha=0.9))
    with pytest.raises(ComplianceError):
        op.process(wrong)
    out = op.process(mark_transformed(table, voice_transform(pol)))
    assert out.num_rows == 5
    h = out.column("deid")[0].as_py()
    assert h["method"] == voice_transform(pol).name and h["policy"] == DEFAULT_POLICY_TAG
    assert out.schema == op.output_schema(table.schema)


def test_mfcc_of_anonymised_speech_keeps_timing_and_energy():
    """What the pipeline stores under ``anonymise``: MFCCs of the transformed waveform."""
    from modalign.operators.ingest.audio import AudioMfccOperator
    from modalign.pipeline.deid_eval import espeak_16k

    x = espeak_16k("Storage and network upgrades start next month.", "en-us+m3")
    y = McAdamsTransform(0.8)(x)
    op = AudioMfccOperator()
    op.setup()
    mx, my = op.mfcc(x), op.mfcc(y)
    assert mx.shape == my.shape  # same frames, same times
    # energy per MFCC frame (25 ms window, 10 ms hop): what an energy VAD decides on
    idx = np.arange(400)[None, :] + 160 * np.arange(mx.shape[0])[:, None]
    ex, ey = (10 * np.log10((s[idx] ** 2).mean(axis=1) + 1e-10) for s in (x, y))
    speech = ex > ex.max() - 35
    assert np.abs(ex - ey)[speech].mean() < 1.5  # dB
    assert (speech == (ey > ex.max() - 35)).mean() > 0.95
    timbre = np.abs(mx[speech, 1:13] - my[speech, 1:13]).mean()
    assert timbre > 1.0  # the spectral envelope (the voice) changed
