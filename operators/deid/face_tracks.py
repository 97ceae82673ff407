"""Face tracks: a face seen in recent frames is covered, where it moves, until it is surely gone.

Used by ``modalign.operators.deid.faces.FaceBlurOperator`` after detection, frame by frame in
time order and across the tables of one stream. A detection that overlaps a track's
predicted box (``MATCH_OVERLAP``, or centres closer than half the box) continues that track;
its velocity (pixels per second per edge) comes from successive detections (the second
detection sets it, later ones are smoothed in). When a frame has no detection for a track
(motion blur, a turned head, a hand in front), the track still yields a box there: its last
box moved by its velocity over the time since, and padded by ``GROWTH_PER_S`` of its size per
second since, so the box follows the face and widens as the guess gets less certain.

A track is *confirmed* by a second detection or one scoring at least ``CONFIRM_SCORE``. A
confirmed track ends only when it has been missed in at least ``MIN_MISSES`` consecutive
*confident* frames (frames the detector scanned in full, see ``update``) *and* for longer
than ``hold_s``: a face cannot vanish from one frame to the next because one detection
failed. A tentative track (one weak detection, the typical false box on a hand or a texture)
is kept for ``MIN_MISSES - 1`` frames only, like a temporal window. The cost is
over-covering for up to ``hold_s`` after a face really left, which is the side to err on.

Within one table the operator refines the boxes with hindsight (``interpolate``): a miss
between two detections of the same track gets the box interpolated between them, and the
frames just before a track's first detection get its box extrapolated backwards.

Pure Python over boxes (no pixels), so it is tested exactly, and deterministic: the output
depends on the detections and times only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BoxT = tuple[int, int, int, int, float]  # x0, y0, x1, y1 (pixels, end-exclusive), score
FBox = tuple[float, float, float, float]

MATCH_OVERLAP = 0.1  # IoU (or intersection over the smaller box) that continues a track
GROWTH_PER_S = 0.5  # padding added per second of misses, as a fraction of the box's size, per side
MAX_SPEED = 10.0  # box sizes per second: a faster estimate is noise (a wrong match), clipped
MIN_MISSES = 3  # consecutive confident frames without the face before a confirmed track may end
SMOOTHING = 0.5  # weight of the newest velocity measurement
MAX_RESIZE = 1.0  # a guessed box grows with the face by at most this fraction of its size per second
CONFIRM_SCORE = 0.75  # one detection this sure confirms a track at once
DUPLICATE_OVERLAP = 0.6  # a younger track this much inside an older one is the same face: dropped
JUMP_SPEED = 5.0  # box sizes per second: two detections of a track further apart give the frames between their union


@dataclass
class _Track:
    id: int
    box: FBox
    vel: FBox  # pixels per second, per edge
    t_ns: int  # time of the last detection
    score: float
    hits: int = 1
    misses: int = 0  # consecutive confident frames without a detection

    @property
    def confirmed(self) -> bool:
        return self.hits >= 2 or self.score >= CONFIRM_SCORE

    def predict(self, t_ns: int) -> FBox:
        return moved(self.box, self.vel, (t_ns - self.t_ns) / 1e9)


@dataclass(frozen=True)
class Seen:
    """One track's box in one frame: ``detected`` (a detection) or carried (a prediction)."""

    track: int
    box: BoxT
    detected: bool


class FaceTracks:
    """The face tracks of one stream of frames of size ``w`` x ``h``."""

    def __init__(self, w: int, h: int, hold_s: float) -> None:
        self.w, self.h, self.hold_s = w, h, hold_s
        self.tracks: list[_Track] = []
        self.last_t_ns: int | None = None
        self._next_id = 0

    def live(self) -> set[int]:
        """Ids of the tracks alive now."""
        return {track.id for track in self.tracks}

    def step(self, t_ns: int, detections: list[BoxT], confident: bool = True) -> list[BoxT]:
        """Feed one frame's (padded) detections; returns the boxes of tracks this frame missed."""
        return [s.box for s in self.update(t_ns, detections, confident) if not s.detected]

    def missed(self, t_ns: int, detections: list[BoxT]) -> list[BoxT]:
        """Predicted boxes of the tracks that ``detections`` would not continue (no state change):
        where a second, closer look is worth its cost."""
        if self.last_t_ns is not None and t_ns <= self.last_t_ns:
            return []
        out = []
        for track in self.tracks:
            guess = track.predict(t_ns)
            if not any(_matches(guess, d) for d in detections):
                box = self._clip(guess, track.score)
                if box is not None:
                    out.append(box)
        return out

    def continuing(self, t_ns: int, detections: list[BoxT]) -> list[BoxT]:
        """The ``detections`` that would continue a live track (no state change): each track takes
        its best match among them, as ``update`` assigns them, so a detection beside a tracked face
        that the face's own detection outmatches continues nothing (a weak box on a body below a
        face reaches into the face's padded box)."""
        if self.last_t_ns is not None and t_ns <= self.last_t_ns:
            return []
        return [d for _track, _guess, d in self._assign(t_ns, detections) if d is not None]

    def _assign(self, t_ns: int, detections: list[BoxT]) -> list[tuple[_Track, FBox, BoxT | None]]:
        """Each track, most certain first, with its predicted box and the free detection it
        continues (None: missed)."""
        free = list(detections)
        out: list[tuple[_Track, FBox, BoxT | None]] = []
        for track in sorted(self.tracks, key=lambda tr: (-tr.confirmed, -tr.score, tr.id)):
            guess = track.predict(t_ns)
            best = max(free, key=lambda d: overlap(guess, d), default=None)
            if best is not None and _matches(guess, best):
                free.remove(best)
                out.append((track, guess, best))
            else:
                out.append((track, guess, None))
        return out

    def update(self, t_ns: int, detections: list[BoxT], confident: bool = True) -> list[Seen]:
        """Feed one frame's detections; returns every live track's box in this frame.

        ``confident``: the frame was scanned in full (all detector passes), so a miss there
        counts towards ending a track; a frame that got only the cheap pass never ends one.
        """
        if self.last_t_ns is not None and t_ns <= self.last_t_ns:
            self.tracks = []  # time did not advance: frames processed again, or another stream
        self.last_t_ns = t_ns
        free = list(detections)
        seen: list[Seen] = []
        kept: list[_Track] = []
        for track, guess, best in self._assign(t_ns, detections):
            if best is not None:
                free.remove(best)
                self._update(track, best, t_ns)
                kept.append(track)
                seen.append(Seen(track.id, best, True))
                continue
            if confident:
                track.misses += 1
            if track.confirmed:
                if track.misses >= MIN_MISSES and (t_ns - track.t_ns) / 1e9 > self.hold_s:
                    continue  # surely gone
            elif track.misses >= MIN_MISSES - 1:
                continue  # one weak detection never seen again: most likely not a face
            kept.append(track)
            box = self._clip(guess, track.score)
            if box is not None:
                seen.append(Seen(track.id, box, False))
        for d in free:
            if any(overlap(d, s.box) >= DUPLICATE_OVERLAP for s in seen if s.detected):
                continue  # a second box on a face already matched this frame
            track = _Track(id=self._next_id, box=_f(d), vel=(0.0, 0.0, 0.0, 0.0), t_ns=t_ns, score=d[4])
            self._next_id += 1
            kept.append(track)
            seen.append(Seen(track.id, d, True))
        self.tracks = kept
        return seen

    @staticmethod
    def _update(track: _Track, det: BoxT, t_ns: int) -> None:
        dt = (t_ns - track.t_ns) / 1e9
        new = _f(det)
        if dt > 0:
            size = max(new[2] - new[0], new[3] - new[1], 1.0)
            limit = MAX_SPEED * size
            measured = [max(-limit, min(limit, (n - o) / dt)) for n, o in zip(new, track.box)]
            w = 1.0 if track.hits == 1 else SMOOTHING  # the first measurement is all there is
            track.vel = tuple(w * m + (1 - w) * v for m, v in zip(measured, track.vel))
        track.box, track.t_ns, track.score, track.misses = new, t_ns, max(track.score, det[4]), 0
        track.hits += 1

    def _clip(self, box: FBox, score: float) -> BoxT | None:
        return clip(box, score, self.w, self.h)


def interpolate(frames: list[list[Seen]], times: list[int], w: int, h: int, back: int,
                hold_s: float = 0.0) -> list[list[BoxT]]:
    """Boxes per frame of a whole stream (``FaceTracks.update``'s output from its first frame
    on), refined with hindsight: ``Hindsight`` fed every frame, then finished."""
    hs = Hindsight(w, h, back, hold_s)
    for seen, t in zip(frames, times):
        hs.add(t, seen, set())
    return hs.pop(end=True)


@dataclass
class _Held:
    pos: int  # frame's position in the stream
    t_ns: int
    seen: dict[int, BoxT]  # track id -> its box here, as ``FaceTracks.update`` gave it
    open: frozenset[int]  # tracks alive here and not detected here: their next detection decides


class Hindsight:
    """``FaceTracks.update``'s boxes refined with hindsight, over a stream fed frame by frame.

    A carried box between two detections of its track is replaced by the box interpolated
    between them (padded by ``GROWTH_PER_S`` per second to the nearer detection), or by their
    union where the face would have moved faster than ``JUMP_SPEED`` (a cut or a swing, where a
    straight line between them is no guess: in Megamind.avi a face 190 px (0.6 of its box) to
    the side two frames later, where the box halfway covered 81 % of the face); up to
    ``back`` frames before a track's first detection, or all frames up to ``hold_s`` before
    it for a confirmed track (two detections, or one of ``CONFIRM_SCORE``), get its box moved
    back in time with its first measured velocity (a face found late).

    Look-ahead: ``pop`` returns the boxes of the oldest frames that no later frame can change
    any more: every track alive and undetected there has been detected again or has ended,
    ``back`` later frames and ``hold_s`` of later time have been seen, and each track born in
    that span has its second detection or has ended. So the boxes of a frame are the same
    however the stream is cut into calls (times must increase). ``pop(end=True)`` at the end
    of the stream returns the rest.
    """

    def __init__(self, w: int, h: int, back: int, hold_s: float) -> None:
        self.w, self.h, self.back, self.hold_s = w, h, back, hold_s
        self.rows: list[_Held] = []  # frames fed and not popped, oldest first
        self.dets: dict[int, list[tuple[int, int, BoxT]]] = {}  # track -> its detections (pos, t_ns, box)
        self.live: set[int] = set()  # tracks alive after the last frame fed
        self.pos = 0  # frames fed so far
        self.last_t: int | None = None

    def add(self, t_ns: int, seen: list[Seen], live: set[int]) -> None:
        """One frame, in stream order: ``seen`` from ``FaceTracks.update`` (empty for a frame
        that was not scanned), ``live`` the ids of the tracks alive after it."""
        for s in seen:
            if s.detected:
                self.dets.setdefault(s.track, []).append((self.pos, t_ns, s.box))
        detected = {s.track for s in seen if s.detected}
        self.rows.append(_Held(self.pos, t_ns, {s.track: s.box for s in seen}, frozenset(live - detected)))
        self.live = set(live)
        self.pos += 1
        self.last_t = t_ns

    def pop(self, end: bool = False) -> list[list[BoxT]]:
        """Boxes of the oldest frames whose boxes are final (every frame left with ``end``)."""
        out = []
        while self.rows and (end or self._final(self.rows[0])):
            out.append(self._boxes(self.rows.pop(0)))
        self._prune()
        return out

    def _final(self, row: _Held) -> bool:
        p, t = row.pos, row.t_ns
        for tid in row.open:  # a miss between two detections: the next one must be known (or none come)
            if tid in self.live and self.dets[tid][-1][0] < p:
                return False
        if self.pos - 1 - p < self.back or self.last_t - t <= self.hold_s * 1e9:
            return False  # a face first found in a later frame could still look back to this one
        for tid, d in self.dets.items():  # a track born since: its velocity and confirmation
            f, tf = d[0][0], d[0][1]
            if f > p and len(d) < 2 and tid in self.live and (f - p <= self.back or tf - t <= self.hold_s * 1e9):
                return False
        return True

    def _boxes(self, row: _Held) -> list[BoxT]:
        p, t = row.pos, row.t_ns
        out = dict(row.seen)
        for tid, d in self.dets.items():
            k = next((k for k, x in enumerate(d) if x[0] > p), len(d))
            if 0 < k < len(d) and d[k - 1][0] < p:  # between two detections: interpolated
                (_, ta, a), (_, tb, b) = d[k - 1], d[k]
                ba, bb = _f(a), _f(b)
                span = (tb - ta) / 1e9
                f = (t - ta) / 1e9 / span if span > 0 else 0.5
                if _jump(ba, bb, span):  # a cut or a swing: the face is anywhere on the way, not on a line
                    mid = (min(ba[0], bb[0]), min(ba[1], bb[1]), max(ba[2], bb[2]), max(ba[3], bb[3]))
                else:
                    mid = tuple(x + f * (y - x) for x, y in zip(ba, bb))
                near = min(t - ta, tb - t) / 1e9
                box = clip(moved(mid, (0.0,) * 4, near), min(a[4], b[4]), self.w, self.h)
                out.pop(tid, None)
                if box is not None:
                    out[tid] = box
            elif k == 0:  # before the track's first detection: moved back in time
                first, tf, fb = d[0]
                base = _f(fb)
                vel = (0.0,) * 4
                if len(d) > 1 and d[1][1] > tf:
                    dt = (d[1][1] - tf) / 1e9
                    size = max(base[2] - base[0], base[3] - base[1], 1.0)
                    vel = tuple(max(-MAX_SPEED * size, min(MAX_SPEED * size, (y - x) / dt))
                                for x, y in zip(base, _f(d[1][2])))
                confirmed = len(d) > 1 or fb[4] >= CONFIRM_SCORE
                if first - p > self.back and not (confirmed and tf - t <= self.hold_s * 1e9):
                    continue
                box = clip(moved(base, vel, (t - tf) / 1e9), fb[4], self.w, self.h)
                if box is not None:
                    out[tid] = box
        return list(out.values())

    def _prune(self) -> None:
        """Forget what no frame still held can need: ended tracks with no detection after the
        oldest held frame, and a live track's detections before its last one before it."""
        oldest = self.rows[0].pos if self.rows else self.pos
        for tid in list(self.dets):
            d = self.dets[tid]
            if tid not in self.live and d[-1][0] < oldest:
                del self.dets[tid]
                continue
            before = [k for k, x in enumerate(d) if x[0] < oldest]
            if len(before) > 3:  # keep the first two (velocity, birth) and the last one before
                self.dets[tid] = d[:2] + d[before[-1]:]


def moved(box: FBox, vel: FBox, dt_s: float) -> FBox:
    """``box`` moved by ``vel`` over ``dt_s`` seconds (either sign): its centre moves with the
    edges' mean velocity, its size changes only where that makes it larger (a guess never
    shrinks; by at most ``MAX_RESIZE`` per second), and it is padded by ``GROWTH_PER_S`` of
    its size per second of ``|dt_s|``."""
    grow = GROWTH_PER_S * abs(dt_s)
    cx = (box[0] + box[2]) / 2 + (vel[0] + vel[2]) / 2 * dt_s
    cy = (box[1] + box[3]) / 2 + (vel[1] + vel[3]) / 2 * dt_s
    bw, bh = box[2] - box[0], box[3] - box[1]
    bw += min(max(0.0, (vel[2] - vel[0]) * dt_s), MAX_RESIZE * bw * abs(dt_s))
    bh += min(max(0.0, (vel[3] - vel[1]) * dt_s), MAX_RESIZE * bh * abs(dt_s))
    hw, hh = bw * (0.5 + grow), bh * (0.5 + grow)
    return cx - hw, cy - hh, cx + hw, cy + hh


def clip(box: FBox, score: float, w: int, h: int) -> BoxT | None:
    """Integer pixel box covering ``box``, clipped to the frame (None when nothing is left)."""
    x0, y0 = max(0, int(box[0] // 1)), max(0, int(box[1] // 1))
    x1, y1 = min(w, int(-(-box[2] // 1))), min(h, int(-(-box[3] // 1)))
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


def _jump(a: FBox, b: FBox, dt_s: float) -> bool:
    """Would a face at ``a``, then at ``b`` ``dt_s`` later, have moved its centre faster than
    ``JUMP_SPEED`` box sizes (the larger box's longer side) per second?"""
    size = max(a[2] - a[0], a[3] - a[1], b[2] - b[0], b[3] - b[1], 1.0)
    move = math.hypot((a[0] + a[2] - b[0] - b[2]) / 2, (a[1] + a[3] - b[1] - b[3]) / 2)
    return move > JUMP_SPEED * size * max(dt_s, 1e-9)


def _matches(guess: FBox, det: tuple[float, ...]) -> bool:
    return overlap(guess, det) >= MATCH_OVERLAP or _near(guess, det)


def _f(b: tuple[float, ...]) -> FBox:
    return (float(b[0]), float(b[1]), float(b[2]), float(b[3]))


def _near(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """Centres closer than half the larger side of ``a``."""
    ca, cb = ((a[0] + a[2]) / 2, (a[1] + a[3]) / 2), ((b[0] + b[2]) / 2, (b[1] + b[3]) / 2)
    side = max(a[2] - a[0], a[3] - a[1])
    return (ca[0] - cb[0]) ** 2 + (ca[1] - cb[1]) ** 2 < (side / 2) ** 2
