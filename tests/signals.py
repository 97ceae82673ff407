"""Synthetic recordings for clock tests: a sound on the session clock, heard by skewed recorders."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np

SR = 16_000
HI = 64_000  # the "continuous" sound is held at 64 kHz and read at any time by interpolation


def noise_bursts(seconds: float, seed: int) -> np.ndarray:
    """Coloured (low-passed) noise bursts of 0.15-0.9 s with 0.1-0.7 s pauses, at HI Hz."""
    rng = np.random.default_rng(seed)
    x = np.zeros(int(seconds * HI))
    t = int(0.3 * HI)
    while t < len(x):
        n = int(rng.uniform(0.15, 0.9) * HI)
        burst = rng.normal(0, 1, n)
        burst = np.convolve(burst, np.ones(8) / 8, mode="same")  # coloured: most energy under 8 kHz
        x[t:t + n] = (burst * rng.uniform(0.1, 0.4) * np.hanning(n))[: len(x) - t]
        t += n + int(rng.uniform(0.1, 0.7) * HI)
    return x


def record(sound: np.ndarray, seconds: float, offset_ns: int, skew_ppm: float, noise: float, seed: int) -> np.ndarray:
    """What a recorder hears: local sample j at t = j/SR is the sound at session time
    offset + t * (1 + skew) (the ClockMapping convention), plus its own noise. The sound
    is zero before session time 0 and after its end."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SR)) / SR
    session = offset_ns / 1e9 + t * (1 + skew_ppm * 1e-6)
    x = np.interp(session * HI, np.arange(len(sound)), sound, left=0.0, right=0.0)
    return (x + rng.normal(0, noise, len(x))).astype(np.float32)


def write_wav(path: Path, x: np.ndarray, rate: int = SR) -> Path:
    pcm = (np.clip(x, -1, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return path



def mux_black_video(container, frames: int) -> None:
    """Add a black 64x48 10 fps H.264 stream of ``frames`` frames to an open PyAV output ``container``."""
    import av

    v = container.add_stream("libx264", rate=10)
    v.width, v.height, v.pix_fmt = 64, 48, "yuv420p"
    for i in range(frames):
        f = av.VideoFrame.from_ndarray(np.zeros((48, 64, 3), np.uint8), format="rgb24")
        f.pts = i
        for pk in v.encode(f):
            container.mux(pk)
    for pk in v.encode(None):
        container.mux(pk)


def encode_audio(path: Path, x: np.ndarray, rate: int, *, codec: str = "aac", fmt: str = "flt",
                 video: bool = False) -> Path:
    """Mono float samples in ``[-1, 1]`` encoded with ``codec`` from sample format ``fmt`` (``s16``:
    scaled to 16 bits) at ``rate``, in the container the name says; ``video``: with a black 64x48
    10 fps video stream as long as the sound."""
    from fractions import Fraction

    import av

    with av.open(str(path), "w") as c:
        s = c.add_stream(codec, rate=rate, layout="mono")
        s.format = fmt
        if video:  # every stream is added before the first packet is muxed
            mux_black_video(c, int(10 * x.size / rate))
        for i in range(0, x.size, 1024):
            chunk = np.asarray(x[i:i + 1024], np.float32)
            arr = (chunk * 32767).astype(np.int16)[None] if fmt == "s16" else chunk[None]
            f = av.AudioFrame.from_ndarray(arr, format=fmt, layout="mono")
            f.sample_rate, f.pts, f.time_base = rate, i, Fraction(1, rate)
            for pk in s.encode(f):
                c.mux(pk)
        for pk in s.encode(None):
            c.mux(pk)
    return path
