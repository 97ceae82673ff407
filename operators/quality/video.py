"""Properties of a decoded video frame (``schemas.tables.VideoQuality``), measured by the video
ingest operator on the RGB frame it decoded, before any de-identification.

- ``brightness_mean``: mean BT.601 luma (OpenCV's ``RGB2GRAY``: 0.299 R + 0.587 G + 0.114 B in fixed
  point, rounded to 0-255 integers), so a grey (v, v, v) frame has brightness v.
- ``contrast``: the standard deviation of that luma.
- ``sharpness``: the variance of the 4-neighbour Laplacian (``4c - up - down - left - right``) over
  the interior of the luma, downscaled first by the integer factor that brings the longer side to at
  most ``SHARPNESS_SIDE`` px (block means, ``INTER_AREA``): the cost stays flat in the resolution,
  and a frame and its 2x upscale (pixel repetition) read the same.

About 0.1 ms per 640x360 frame on one core (README "Quality gates"). Deterministic for a given
frame (OpenCV's fixed-point luma, float32 Laplacian; OpenCV threads are not used for frames this small).
"""

from __future__ import annotations

from typing import Any

import numpy as np

SHARPNESS_SIDE = 320  # px: the longer side the luma is block-averaged down to before the Laplacian


def luma(rgb: np.ndarray) -> np.ndarray:
    """(H, W) uint8 BT.601 luma of an (H, W, 3) uint8 RGB frame."""
    import cv2

    return cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2GRAY)


def sharpness(y: np.ndarray, side: int = SHARPNESS_SIDE) -> float:
    """Variance of the 4-neighbour Laplacian of luma ``y`` (interior pixels), after block-averaging
    by ``ceil(max(H, W) / side)``; 0 for a frame under 3 px on a side."""
    import cv2

    h, w = y.shape
    f = max(1, -(-max(h, w) // side))
    s = y.astype(np.float32)
    if f > 1:  # whole blocks only: a partial edge block would be a different average
        h2, w2 = h // f, w // f
        if h2 == 0 or w2 == 0:
            return 0.0
        s = cv2.resize(s[:h2 * f, :w2 * f], (w2, h2), interpolation=cv2.INTER_AREA)
    if s.shape[0] < 3 or s.shape[1] < 3:
        return 0.0
    lap = cv2.Laplacian(s, cv2.CV_32F, ksize=1)[1:-1, 1:-1]  # ksize 1: the 4-neighbour kernel
    _mean, sd = cv2.meanStdDev(lap)
    return float(sd[0, 0]) ** 2


def frame_quality(rgb: np.ndarray) -> tuple[float, float, float]:
    """(brightness_mean, contrast, sharpness) of one (H, W, 3) uint8 RGB frame."""
    import cv2

    y = luma(rgb)
    mean, sd = cv2.meanStdDev(y)
    return float(mean[0, 0]), float(sd[0, 0]), sharpness(y)


def pixel_channels(fmt: Any) -> int:
    """Channels of a PyAV ``VideoFormat`` (the decoded stream's): 1 for gray, 3 for YUV or RGB, 4 with
    alpha; a palette format (pal8) decodes to 3 colour channels."""
    if getattr(fmt, "has_palette", False):
        return 3
    return max(1, len(getattr(fmt, "components", ()) or ()))
