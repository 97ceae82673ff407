"""The numpy MFCC (``modalign.operators.ingest.mfcc``) against torchaudio's, which it replaced.

torchaudio is a dev dependency for this comparison only: the pipeline no longer imports it.
"""

from __future__ import annotations

import numpy as np
import pytest

from modalign.operators.ingest.mfcc import LogMelMfcc, mel_filterbank
from modalign.pipeline.sample import _espeak

SR, WIN, HOP = 16_000, 400, 160


def torchaudio_mfcc(x: np.ndarray, n_mfcc: int = 40, n_mels: int = 64, sr: int = SR, win: int = WIN,
                    hop: int = HOP) -> np.ndarray:
    torch = pytest.importorskip("torch")
    torchaudio = pytest.importorskip("torchaudio")
    t = torchaudio.transforms.MFCC(sample_rate=sr, n_mfcc=n_mfcc, log_mels=True,
                                   melkwargs={"n_fft": win, "win_length": win, "hop_length": hop,
                                              "n_mels": n_mels, "center": False, "power": 2.0})
    with torch.inference_mode():
        return t(torch.from_numpy(np.ascontiguousarray(x, np.float32))).T.numpy()


def signals() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    t = np.arange(SR * 4) / SR
    speech, rate = _espeak("Storage and network upgrades start next month.")
    speech = np.interp(np.arange(int(len(speech) * SR / rate)) * rate / SR, np.arange(len(speech)), speech)
    return {
        "speech": speech,
        "noise": rng.normal(0, 0.1, SR * 4),
        "tone": 0.5 * np.sin(2 * np.pi * 440 * t),
        "clipped": np.clip(3 * np.sin(2 * np.pi * 200 * t), -1, 1),
        "silence": np.zeros(SR),
        "one window": rng.normal(0, 0.1, WIN + HOP - 1),
    }


@pytest.mark.parametrize("name", list(signals()))
def test_equals_torchaudio_within_1e_4(name):
    x = signals()[name].astype(np.float32)
    ours = LogMelMfcc(SR, 40, 64, WIN, HOP)(x)
    ref = torchaudio_mfcc(x)
    assert ours.dtype == np.float32 and ours.shape == ref.shape == (1 + (len(x) - WIN) // HOP, 40)
    assert np.abs(ours - ref).max() < 1e-4


def test_other_rates_and_sizes_equal_torchaudio():
    x = np.random.default_rng(4).normal(0, 0.2, 22_050 * 2).astype(np.float32)
    ours = LogMelMfcc(22_050, 13, 40, 551, 220)(x)
    assert np.abs(ours - torchaudio_mfcc(x, 13, 40, 22_050, 551, 220)).max() < 1e-4


def test_shorter_than_a_window_is_no_frame():
    assert LogMelMfcc(SR, 40, 64, WIN, HOP)(np.zeros(WIN - 1, np.float32)).shape == (0, 40)


def test_filters_are_triangles_on_the_mel_scale():
    fb = mel_filterbank(WIN, 64, SR)
    assert fb.shape == (WIN // 2 + 1, 64)
    assert fb.min() >= 0 and fb.max() <= 1
    peaks = fb.argmax(axis=0)
    assert (np.diff(peaks) >= 0).all() and np.diff(peaks)[-1] > np.diff(peaks)[0]  # wider apart up high


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="n_mfcc"):
        LogMelMfcc(SR, 65, 64, WIN, HOP)


def test_a_frame_is_byte_identical_however_the_signal_is_chunked():
    # silence makes every coefficient but the first a rounding residue (~1e-15): a BLAS product
    # whose summation order follows the chunk's row count changed those bits
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.normal(0, 0.1, SR), np.zeros(SR), rng.normal(0, 0.3, SR)]).astype(np.float32)
    mfcc = LogMelMfcc(SR, 40, 64, WIN, HOP)
    whole = mfcc(x)
    for frames in (1, 37, 64, 129):
        parts, k = [], 0
        while k < len(whole):
            part = mfcc(x[k * HOP: (k + frames - 1) * HOP + WIN])
            parts.append(part)
            k += len(part)
        assert np.array_equal(np.concatenate(parts), whole)
