"""Small media made in code for runner tests: a tone WAV, a grey-ramp clip with or without sound."""

from __future__ import annotations

import wave
from fractions import Fraction
from pathlib import Path

import numpy as np

RATE = 16_000


def write_tone(path: Path, seconds: float = 2.0, hz: float = 440.0) -> None:
    t = np.arange(int(seconds * RATE)) / RATE
    pcm = (0.3 * np.sin(2 * np.pi * hz * t) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm.tobytes())


def write_clip(path: Path, seconds: float = 2.0, sound: bool = True) -> None:
    """A 25 fps 160x120 clip, with an AAC track of voiced bursts when ``sound``."""
    import av

    with av.open(str(path), "w") as c:
        v = c.add_stream("libx264", rate=25)
        v.width, v.height, v.pix_fmt = 160, 120, "yuv420p"
        a = None
        if sound:
            a = c.add_stream("aac", rate=RATE)
            a.layout = "mono"
        for i in range(int(seconds * 25)):
            img = np.full((120, 160, 3), (i * 9) % 255, np.uint8)
            for p in v.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        if a is not None:
            t = np.arange(int(seconds * RATE)) / RATE
            x = (0.3 * np.sin(2 * np.pi * 220 * t) * (np.sin(2 * np.pi * 2 * t) > 0)).astype(np.float32)
            step = 1024
            for k in range(0, len(x), step):
                fr = av.AudioFrame.from_ndarray(x[None, k:k + step], format="fltp", layout="mono")
                fr.sample_rate, fr.pts, fr.time_base = RATE, k, Fraction(1, RATE)
                for p in a.encode(fr):
                    c.mux(p)
            for p in a.encode():
                c.mux(p)
        for p in v.encode():
            c.mux(p)
