"""Log-mel MFCCs in numpy: the cepstrum the audio path stores, without torch in the ingest worker.

The same transform as ``torchaudio.transforms.MFCC(log_mels=True, melkwargs={n_fft: win,
win_length: win, hop_length: hop, center: False, power: 2})``, which the audio path used
before (``tests/unit/test_mfcc.py`` holds the two within 1e-4 on speech, tones, silence
and clipping), written out so that an ingest worker need not import torch (1.4 CPU s per
actor start) for it:

- frame k is ``samples[k*hop : k*hop + win]`` (no centring, no padding), times a periodic
  Hann window;
- its power spectrum ``|rfft|^2`` (``n_fft = win`` bins);
- ``n_mels`` triangular filters, equally spaced on the HTK mel scale
  (``2595 log10(1 + f/700)``) from 0 Hz to Nyquist, unnormalised;
- ``log(mel + 1e-6)`` (frame-local, unlike a dB scale clipped against a chunk's maximum: see
  ``modalign.operators.ingest.audio``);
- an orthonormal DCT-II, keeping the first ``n_mfcc`` coefficients.

Computed in float64 and returned as float32; a frame's values do not depend on how the signal was
chunked (byte-identical output for any ``chunk_s``).
"""

from __future__ import annotations

import numpy as np

LOG_OFFSET = 1e-6


def hz_to_mel(f: np.ndarray | float) -> np.ndarray:
    return 2595.0 * np.log10(1.0 + np.asarray(f, np.float64) / 700.0)


def mel_to_hz(m: np.ndarray | float) -> np.ndarray:
    return 700.0 * (10.0 ** (np.asarray(m, np.float64) / 2595.0) - 1.0)


def mel_filterbank(n_fft: int, n_mels: int, sample_rate: int) -> np.ndarray:
    """``(n_fft // 2 + 1, n_mels)`` triangular filters on the HTK mel scale, 0 Hz to Nyquist."""
    freqs = np.linspace(0.0, sample_rate // 2, n_fft // 2 + 1)
    edges = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(sample_rate / 2), n_mels + 2))
    widths = np.diff(edges)
    slopes = edges[None, :] - freqs[:, None]
    rising = -slopes[:, :-2] / widths[:-1]
    falling = slopes[:, 2:] / widths[1:]
    return np.maximum(0.0, np.minimum(rising, falling))


def dct_ortho(n_mfcc: int, n_mels: int) -> np.ndarray:
    """``(n_mels, n_mfcc)`` orthonormal DCT-II matrix."""
    n = np.arange(n_mels, dtype=np.float64)
    k = np.arange(n_mfcc, dtype=np.float64)[:, None]
    dct = np.cos(np.pi / n_mels * (n + 0.5) * k)
    dct[0] *= 1.0 / np.sqrt(2.0)
    return (dct * np.sqrt(2.0 / n_mels)).T


class LogMelMfcc:
    """``(frames, n_mfcc)`` float32 MFCCs of a mono signal; frame k starts at sample ``k * hop``."""

    def __init__(self, sample_rate: int, n_mfcc: int, n_mels: int, win: int, hop: int) -> None:
        if not 0 < n_mfcc <= n_mels or win <= 0 or hop <= 0:
            raise ValueError(f"MFCC needs 0 < n_mfcc <= n_mels and positive win, hop (got n_mfcc={n_mfcc}, "
                             f"n_mels={n_mels}, win={win}, hop={hop})")
        self.n_mfcc, self.win, self.hop = n_mfcc, win, hop
        self._window = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(win) / win)  # periodic Hann
        fb = mel_filterbank(win, n_mels, sample_rate)
        # Each filter is a run of bins (a triangle): the mel energies are sums over those runs, a
        # gather and ``np.add.reduceat`` (~4x faster than a dense product with the mostly-zero bank)
        runs = []
        for m in range(n_mels):
            nz = np.flatnonzero(fb[:, m])
            lo, hi = (nz[0], nz[-1] + 1) if nz.size else (int(fb[:, m].argmax()), int(fb[:, m].argmax()) + 1)
            runs.append(np.arange(lo, hi))
        self._bins = np.concatenate(runs)
        self._weights = np.concatenate([fb[r, m] for m, r in enumerate(runs)])
        self._starts = np.cumsum([0] + [len(r) for r in runs[:-1]])
        self._dct = dct_ortho(n_mfcc, n_mels)

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        x = np.asarray(samples, np.float64).reshape(-1)
        if x.size < self.win:
            return np.zeros((0, self.n_mfcc), np.float32)
        frames = np.lib.stride_tricks.sliding_window_view(x, self.win)[:: self.hop] * self._window
        spec = np.fft.rfft(frames, axis=1)
        power = np.square(spec.real)
        power += np.square(spec.imag)
        # Row by row, never a BLAS product: BLAS picks its kernel (and so the order of each sum) by
        # the number of rows, which would make a frame's last bits depend on where its chunk began
        runs = power.take(self._bins, axis=1)
        runs *= self._weights
        mel = np.add.reduceat(runs, self._starts, axis=1)
        mel += LOG_OFFSET
        return np.einsum("fm,mc->fc", np.log(mel, out=mel), self._dct).astype(np.float32)
