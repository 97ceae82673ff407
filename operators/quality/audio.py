"""Properties of the MFCC frames of an audio source (``schemas.tables.AudioQuality``), measured by the
audio ingest operator on the 16 kHz mono signal before voice anonymisation; frame k's window is the
MFCC's, samples ``[k*hop, k*hop + win)``. Only these scalars leave: the waveform is never stored.

- ``loudness_dbfs``: ``10 log10(mean(x^2))`` of the window, full scale 1.0 (a full-scale square wave is
  0 dBFS, a full-scale sine -3.01), floored at -120 (digital silence).
- ``clipping_ratio``: the fraction of the window's samples with ``|x| >= CLIP_LEVEL``, that is at or
  within 1 LSB of 16-bit full scale (32766/32768 or more). Measured after resampling to 16 kHz: a
  clipped plateau of another rate stays at full scale, its edges may not.
- ``snr_db``: the frame's loudness over the source's noise floor. The floor is a running estimate
  that depends on the source alone, never on how its audio is cut into chunks: the
  ``FLOOR_PERCENTILE`` (10th) percentile of the loudness of the ``FLOOR_FRAMES`` (10 s) of frames before
  the frame's second (frames grouped in whole seconds, ``BLOCK_FRAMES``, from the source's first);
  during the source's first second, of its frames so far, the frame included.
"""

from __future__ import annotations

import numpy as np

SILENCE_DBFS = -120.0
MAX_DBFS = 10.0
CLIP_LEVEL = 1.0 - 2.0 / 32768  # 32766/32768: 1 LSB below 16-bit positive full scale (32767/32768)
BLOCK_FRAMES = 100  # frames per second at a 10 ms hop: the floor is updated once a second
FLOOR_FRAMES = 1000  # 10 s of frames
FLOOR_PERCENTILE = 10.0


def frame_windows(x: np.ndarray, n: int, win: int, hop: int) -> np.ndarray:
    """(n, win) read-only view of the windows ``x[k*hop : k*hop + win]``, k < n."""
    if n <= 0:
        return np.zeros((0, win), x.dtype)
    return np.lib.stride_tricks.sliding_window_view(x[:(n - 1) * hop + win], win)[::hop][:n]


def loudness_dbfs(x: np.ndarray, n: int, win: int, hop: int) -> np.ndarray:
    """(n,) float64 RMS level in dBFS of each frame window of mono float ``x``."""
    w = frame_windows(np.asarray(x, np.float64), n, win, hop)
    power = np.einsum("ij,ij->i", w, w) / win
    return np.clip(10.0 * np.log10(np.maximum(power, 1e-12)), SILENCE_DBFS, MAX_DBFS)


def clipping_ratio(x: np.ndarray, n: int, win: int, hop: int) -> np.ndarray:
    """(n,) float64 fraction of each window's samples at or within 1 LSB of full scale."""
    if n <= 0:
        return np.zeros(0, np.float64)
    hit = np.abs(x[:(n - 1) * hop + win]) >= CLIP_LEVEL
    cs = np.concatenate(([0], np.cumsum(hit, dtype=np.int64)))
    starts = np.arange(n, dtype=np.int64) * hop
    return (cs[starts + win] - cs[starts]) / win


class AudioQualityMeter:
    """The properties of one source's frames, chunk after chunk (state: the levels the noise floor
    needs). ``measure`` gets each chunk's frames in order; the result is the same for any chunking."""

    def __init__(self, win: int, hop: int, *, block: int = BLOCK_FRAMES, floor_frames: int = FLOOR_FRAMES,
                 percentile: float = FLOOR_PERCENTILE) -> None:
        self.win, self.hop, self.block, self.floor_frames, self.percentile = win, hop, block, floor_frames, percentile
        self._levels = np.zeros(0, np.float64)  # loudness of frames [self._first, self.frames)
        self._first = 0
        self.frames = 0  # frames measured so far

    def history_from(self, frame: int) -> int:
        """The first frame whose loudness the floors of ``frame`` and every later frame need."""
        return max(0, (frame // self.block) * self.block - self.floor_frames)

    def start_at(self, frame: int) -> None:
        """Measure from global frame ``frame`` on (a range of a stream, ``ingest.audio.AudioRange``):
        the floors are exact from the frame whose ``history_from`` is ``frame`` or later."""
        self._levels, self._first, self.frames = np.zeros(0, np.float64), int(frame), int(frame)

    def noise_floor(self, levels: np.ndarray, first: int, k: int) -> float:
        """The floor of global frame ``k``; ``levels`` holds frames from global index ``first``."""
        start = (k // self.block) * self.block
        if start <= first:  # the first second (or a range's first, while it warms up): the frames so far
            return float(np.percentile(levels[:k - first + 1], self.percentile))
        lo = max(first, start - self.floor_frames)  # (> the rule's start only while a range warms up)
        return float(np.percentile(levels[lo - first:start - first], self.percentile))

    def measure(self, x: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(loudness_dbfs, clipping_ratio, snr_db), float32 (n,), of the next ``n`` frames, whose
        windows start at ``x[0]``, ``x[hop]``, ... (``x`` holds at least ``(n-1)*hop + win`` samples)."""
        loud = loudness_dbfs(x, n, self.win, self.hop)
        clip = clipping_ratio(x, n, self.win, self.hop)
        levels = np.concatenate([self._levels, loud])
        first, k0 = self._first, self.frames
        floor = np.empty(n, np.float64)
        i = 0
        while i < n:
            k = k0 + i
            block_end = min(n, (k // self.block + 1) * self.block - k0)  # this frame's second, within the chunk
            if k < self.block:
                floor[i] = self.noise_floor(levels, first, k)
                i += 1
                continue
            floor[i:block_end] = self.noise_floor(levels, first, k)
            i = block_end
        self.frames = k0 + n
        keep_from = max(first, self.history_from(self.frames))
        self._levels, self._first = levels[keep_from - first:].copy(), keep_from
        return loud.astype(np.float32), clip.astype(np.float32), (loud - floor).astype(np.float32)
