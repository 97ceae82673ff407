"""Face tracks: a face seen in recent frames is covered, where it moves, until it is surely gone.

Used by ``modalign.operators.deid.faces.FaceBlurOperator`` after detection, frame by frame in
time order and across the tables of one stream. A detection that overlaps a track's
predicted box (``MATCH_OVERLAP``, or centres closer than half the box) continues that track;
its velocity (pixels per second per edge, smoothed) comes from successive detections. When a
frame has no detection for a track (motion blur, a turned head, a hand in front), the track
still yields a box there: its last box moved by its velocity over the time since, and padded
by ``GROWTH_PER_S`` of its size per second since, so the box follows the face and widens as
the guess gets less certain. A track ends only when it has been missed in at least
``MIN_MISSES`` consecutive frames *and* for longer than ``hold_s``: a face cannot vanish from
one frame to the next just because one detection failed. The cost is over-covering for up to
``hold_s`` after a face really left, which is the side to err on.

Pure Python over boxes (no pixels), so it is tested exactly, and deterministic: the output
depends on the detections and times only.
"""

from __future__ import annotations

from dataclasses import dataclass

BoxT = tuple[int, int, int, int, float]  # x0, y0, x1, y1 (pixels, end-exclusive), score

MATCH_OVERLAP = 0.1  # IoU (or intersection over the smaller box) that continues a track
GROWTH_PER_S = 0.5  # padding added per second of misses, as a fraction of the box's size, per side
MAX_SPEED = 3.0  # box sizes per second: a faster estimate is noise (a wrong match), clipped
MIN_MISSES = 3  # consecutive frames without the face before its track may end
SMOOTHING = 0.5  # weight of the newest velocity measurement


@dataclass
class _Track:
    box: tuple[float, float, float, float]
    vel: tuple[float, float, float, float]  # pixels per second, per edge
    t_ns: int  # time of the last detection
    score: float
    misses: int = 0

    def predict(self, t_ns: int) -> tuple[float, float, float, float]:
        dt = (t_ns - self.t_ns) / 1e9
        grow = GROWTH_PER_S * dt
        x0, y0, x1, y1 = (b + v * dt for b, v in zip(self.box, self.vel))
        w, h = x1 - x0, y1 - y0
        return x0 - grow * w, y0 - grow * h, x1 + grow * w, y1 + grow * h


class FaceTracks:
    """The face tracks of one stream of frames of size ``w`` x ``h``."""

    def __init__(self, w: int, h: int, hold_s: float) -> None:
        self.w, self.h, self.hold_s = w, h, hold_s
        self.tracks: list[_Track] = []
        self.last_t_ns: int | None = None

    def step(self, t_ns: int, detections: list[BoxT]) -> list[BoxT]:
        """Feed one frame's (padded) detections; returns the boxes of tracks this frame missed."""
        if self.last_t_ns is not None and t_ns <= self.last_t_ns:
            self.tracks = []  # time did not advance: frames processed again, or another stream
        self.last_t_ns = t_ns
        free = list(detections)
        carried: list[BoxT] = []
        kept: list[_Track] = []
        for track in sorted(self.tracks, key=lambda tr: -tr.score):
            guess = track.predict(t_ns)
            best = max(free, key=lambda d: overlap(guess, d), default=None)
            if best is not None and (overlap(guess, best) >= MATCH_OVERLAP or _near(guess, best)):
                free.remove(best)
                self._update(track, best, t_ns)
                kept.append(track)
                continue
            track.misses += 1
            if track.misses >= MIN_MISSES and (t_ns - track.t_ns) / 1e9 > self.hold_s:
                continue  # surely gone
            kept.append(track)
            box = self._clip(guess, track.score)
            if box is not None:
                carried.append(box)
        kept += [_Track(box=tuple(float(v) for v in d[:4]), vel=(0.0, 0.0, 0.0, 0.0), t_ns=t_ns, score=d[4])
                 for d in free]
        self.tracks = kept
        return carried

    @staticmethod
    def _update(track: _Track, det: BoxT, t_ns: int) -> None:
        dt = (t_ns - track.t_ns) / 1e9
        new = tuple(float(v) for v in det[:4])
        if dt > 0:
            size = max(new[2] - new[0], new[3] - new[1], 1.0)
            limit = MAX_SPEED * size
            measured = [max(-limit, min(limit, (n - o) / dt)) for n, o in zip(new, track.box)]
            track.vel = tuple(SMOOTHING * m + (1 - SMOOTHING) * v for m, v in zip(measured, track.vel))
        track.box, track.t_ns, track.score, track.misses = new, t_ns, det[4], 0

    def _clip(self, box: tuple[float, float, float, float], score: float) -> BoxT | None:
        x0, y0 = max(0, int(box[0] // 1)), max(0, int(box[1] // 1))
        x1, y1 = min(self.w, int(-(-box[2] // 1))), min(self.h, int(-(-box[3] // 1)))
        return (x0, y0, x1, y1, score) if x1 > x0 and y1 > y0 else None


def overlap(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    """max(IoU, intersection over the smaller box) of two boxes: nested boxes count as overlapping."""
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    if inter <= 0:
        return 0.0
    area_a = (a[2] - a[0]) * (a[3] - a[1])
    area_b = (b[2] - b[0]) * (b[3] - b[1])
    return max(inter / (area_a + area_b - inter), inter / max(min(area_a, area_b), 1e-9))


def _near(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """Centres closer than half the larger side of ``a``."""
    ca, cb = ((a[0] + a[2]) / 2, (a[1] + a[3]) / 2), ((b[0] + b[2]) / 2, (b[1] + b[3]) / 2)
    side = max(a[2] - a[0], a[3] - a[1])
    return (ca[0] - cb[0]) ** 2 + (ca[1] - cb[1]) ** 2 < (side / 2) ** 2
