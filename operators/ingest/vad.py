"""Energy-based voice-activity detection on the MFCC frame grid (a streaming flag per frame).

Used by ``modalign.operators.ingest.audio`` while the waveform still exists (it never leaves that
operator): each MFCC frame k (samples ``[k*hop, k*hop + win)`` of the 16 kHz mono signal)
gets ``voiced`` from three steps:

1. Frame log-energy ``E_k = 10*log10(mean(x^2) + 1e-12)`` in dBFS (a full-scale sine is
   -3 dBFS; digital silence is floored at -120).
2. Adaptive noise floor ``N_k = min(E_{k-F+1} .. E_k)``: the quietest frame of the last
   ``F`` frames (``floor_s``, 3 s by default; "minimum statistics"). It follows the noise
   down at once and up within ``floor_s``, so a steady hum or fan becomes the floor.
   Before the stream has ``F`` frames, the missing history counts as ``min_dbfs`` (an
   assumed quiet floor), so speech in the very first frames is not taken for the floor.
3. A frame is *active* when ``E_k > N_k + threshold_db`` and ``E_k > min_dbfs``; it is
   *voiced* when some frame in ``[k - H, k]`` is active (hangover ``H``, 200 ms: the weak
   ends of words and short pauses stay voiced).

The detector is causal and carries its state across chunks, so chunked output equals a
one-shot run. It detects sound over the noise floor, not speech specifically: music or a
door slam are "voiced" too. A sound steadier than ``floor_s`` becomes the floor.
"""

from __future__ import annotations

import math

import numpy as np

SILENCE_DB = -120.0


def frame_energy_db(x: np.ndarray, n_frames: int, win: int, hop: int) -> np.ndarray:
    """Log-energy (dBFS) of frames ``[k*hop, k*hop+win)``, k < n_frames, of mono float ``x``.

    Sums of squares over blocks of ``gcd(win, hop)`` samples (80 at 16 kHz / 25 ms / 10 ms),
    then a running sum of ``win / g`` blocks: no per-sample cumulative sum."""
    if n_frames <= 0:
        return np.zeros(0, np.float64)
    g = math.gcd(win, hop)
    span = (n_frames - 1) * hop + win
    blocks = np.einsum("ij,ij->i", *(x[:span].reshape(-1, g),) * 2, dtype=np.float64)
    cs = np.concatenate(([0.0], np.cumsum(blocks)))
    starts = np.arange(n_frames) * (hop // g)
    power = np.maximum(cs[starts + win // g] - cs[starts], 0.0) / win
    return np.maximum(10.0 * np.log10(power + 1e-12), SILENCE_DB)


def sliding_min(a: np.ndarray, w: int) -> np.ndarray:
    """``min(a[i:i+w])`` for every i (van Herk / Gil-Werman: O(len(a)), any ``w``)."""
    n = a.size - w + 1
    if n <= 0:
        return np.zeros(0, a.dtype)
    blocks = -(-a.size // w)
    padded = np.full(blocks * w, np.inf)
    padded[:a.size] = a
    b = padded.reshape(blocks, w)
    prefix = np.minimum.accumulate(b, axis=1).ravel()
    suffix = np.minimum.accumulate(b[:, ::-1], axis=1)[:, ::-1].ravel()
    return np.minimum(suffix[:n], prefix[w - 1:w - 1 + n])


class EnergyVad:
    """Streaming voiced/unvoiced decision per frame (see the module docstring)."""

    def __init__(self, floor_frames: int = 300, threshold_db: float = 10.0, min_dbfs: float = -55.0,
                 hangover_frames: int = 20):
        self.floor_frames = max(1, int(floor_frames))
        self.threshold_db = float(threshold_db)
        self.min_dbfs = float(min_dbfs)
        self.hangover = max(0, int(hangover_frames))
        self._history = np.zeros(0, np.float64)  # last floor_frames-1 energies
        self._seen = 0  # frames processed so far
        self._last_active = -(1 << 62)  # global index of the last active frame

    def __call__(self, energy_db: np.ndarray) -> np.ndarray:
        """``voiced`` (bool) for the next ``len(energy_db)`` frames of the stream."""
        e = np.asarray(energy_db, np.float64)
        n = e.size
        if n == 0:
            return np.zeros(0, bool)
        w = self.floor_frames
        pad = np.full(max(0, w - 1 - self._history.size), self.min_dbfs)  # the assumed floor at the start
        joined = np.concatenate((pad, self._history, e))
        floor = sliding_min(joined, w)
        active = (e > floor + self.threshold_db) & (e > self.min_dbfs)
        idx = np.arange(self._seen, self._seen + n, dtype=np.int64)
        last = np.maximum.accumulate(np.where(active, idx, np.int64(self._last_active)))
        voiced = (idx - last) <= self.hangover
        self._last_active = int(last[-1])
        self._history = joined[-(w - 1):] if w > 1 else joined[:0]
        self._seen += n
        return voiced
