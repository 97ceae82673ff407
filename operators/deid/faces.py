"""Face de-identification of decoded video frames, inside the ingest worker.

Data flow: ``modalign.operators.ingest`` video decode -> **FaceBlurOperator** -> JPEG encode and the
aligner. Raw frames never leave the ingest process: this operator runs right after decode
and every frame it returns has each detected face replaced by a strong Gaussian blur, pulled
towards the box's mean colour (``RESIDUAL_CONTRAST``), then a keyed pixel permutation. Pixels outside the boxes are
bit-identical to the input; only the box coordinates (``face_boxes``) are kept. Policy
action ``mask`` fills each box with its mean colour instead (nothing of the face is left).

Small faces: MediaPipe's full-range model sees the frame letterboxed to 192x192, so faces
under ~110 px in 720p are missed whole-frame; ``FacePolicy.tiles`` (default 2) adds a pass
over a 2x2 grid of overlapping tiles. ``tile_every = 2`` scans the frames at even
positions of a dense stream; with tracking the frames between are not detected at all (the
face tracks cover them, interpolated between the scans around them: a tenth less CPU per 720p
frame, every real-footage figure unchanged); with tracking,
every other scan gets the tiles and the second model's 3x3 grid and the scans between the
whole frame and a closer look at each tracked face it missed (a face found on a full scan
is tracked and covered back in time, ``track_hold_s``); the static window gets the tiles on
each scan and the grid on every other one. Sparse or sampled frames and the stream's last
frame always get both passes. The grid is the stream's (a frame's position in it), not the
table's.

Close grid: faces of a few pixels upscaled (100-130 px, all detail low-frequency, filling
their crop) come out at 25-32 px of the short-range model's input on its 3x3 grid and are
missed; on ``close_regions`` (15 square tiles of half the frame's height in 720p) they are
seen at 36-46 px and found, and on a second close grid of 0.4 of the frame's height
(``CLOSE_SIDES``, 28 tiles in 720p: 45-58 px) those the first cut off at a tile's edge or sees
too small (LFW faces x4-6 on vtest.avi frames: uncovered 3 -> 1 of 100; boxes on the 100
non-face stills 1 -> 4, on the background video's pedestrians and grass). It runs on every frame
that is no part of a dense run (stills, sampled frames, a stream's last frame; 43 more
short-range calls each), not in dense video,
where it would cost ~2 ms a frame on every 6th full scan (``CLOSE_EVERY``, 0: off) against
the 30 ms budget and gave false boxes on vtest.avi's pedestrians.

Zoom-out: a face that fills the frame (a close-up) has no context around it on any grid; on
every frame that gets the close grid, and on each full scan that found nothing, both models
also see the frame padded to ``ZOOM_OUT`` (1.5) times its longer side, edges repeated
(``detect_wide``); a box both find is kept (LFW faces filling a 640x360 frame: 51 -> 85 of 100
covered, 0 boxes on 100 non-face close-ups).

Still model: on the same frames as the close grids (stills, sampled frames, a stream's last frame)
a third detector of another family runs on the whole frame (``FacePolicy.still_model``, MTCNN with
the weights facenet-pytorch ships, run in NumPy by ``deid.mtcnn``, so no torch in an ingest
actor; ``_MtcnnDetector``): a cascade over an image pyramid, which
finds turned and low-detail faces that neither MediaPipe model scores on any grid (an LFW face
upscaled x5 that the full-range model saw at 0.59 and no closer look confirmed). Its boxes are
kept when its own last stage scores them ``STILL_SCORE`` (0.9), without a MediaPipe closer look,
which would refuse exactly those faces; a weak MediaPipe box it agrees with is confirmed by it
(two families agree). About 120-145 ms per 720p frame on one core: dense video
never gets it, except its last frame.

Unchanged regions: the whole frame and each tile of a scan are compared, as grayscale means
of 8x8 px cells (``change_cells``), with what they were the last time that model ran on them
in this stream; when no cell moved by ``FacePolicy.reuse_threshold`` (12 grey levels;
re-encoding noise moves a cell by 2-6, a face entering or moving by far more), the model's
detections of that time are used again instead of running it (the same pixels give the same
answer). In a fixed camera's view only the tiles around what moves are detected again. The
comparison is with the last run, not the last frame, so slow drift cannot add up unseen;
the record belongs to the stream (``forget`` on a new stream or frame shape), so output stays
byte-identical for any batching. The closer looks (``detect_near``, verification) always run.

Second pass: with ``FacePolicy.second_pass`` the short-range model (another network) also
runs on the tiles, and on an upscaled crop around each tracked face the first pass missed
in a frame, so a face is re-found (and its box stays tight) rather than guessed. A weak
detection (score under ``face_tracks.CONFIRM_SCORE``) that continues no track is kept only
when both models, looking at upscaled crops of 1.5 and 2 face sides around it
(``VERIFY_REACH``, measured on the detected face, not on its padded box), score it
``VERIFY_SCORE``: hands, hair and textures fire weakly and are not confirmed; weak real
faces mostly are.

Padding: each detection grows to the head, ``FacePolicy.pad_ratio`` (0.35) of its width to
each side and ``pad_above_ratio`` / ``pad_below_ratio`` (0.6) of its height above and below:
the detector's box spans brows to mouth, the head reaches the hair above it and the chin and
neck below, and dlib's descriptor links a face by what lies around it too (Megamind.avi: 3
frames linked at 0.25, none at 0.35; with 0.35 above and below, the independent detectors'
regions reaching the hair or the neck were left partly bare, in 2 of 89 frames). A closer
look at a detection is measured on the detected face, not on its (clipped) padded box.

Temporal consistency (faces fail closed): detections feed face tracks
(``modalign.operators.deid.face_tracks``, kept across the tables of one stream, same
``event_id`` prefix, later ``t_ns``). Each face gets one box per frame: its detection, the
box interpolated between two detections around a miss, its box moved back in time for up
to ``track_hold_s`` before it was first found (``temporal_window`` frames for a single weak
detection), or, forward in time, its last box moved with its velocity and widened until
the track has been missed for ``FacePolicy.track_hold_s`` and in 3 fully scanned frames in
a row (a weak detection never seen again is dropped after 2 frames: hands and textures).
With ``track_hold_s = 0`` the older static window applies instead: a detection in frame
``i`` is copied to frames ``i - temporal_window .. i + temporal_window``.

Look-ahead across tables: a frame's boxes can depend on later frames (the next detection of
a track missed there, a face found up to ``track_hold_s`` later, the window; its own tiling
on the gap to the next frame), which may lie in a later table. So the operator holds back
the frames whose boxes could still change (raw, in this process: about ``track_hold_s``
plus one frame while a face is tracked, a frame or two otherwise) and emits them, anonymised,
with the output of a later table of the same stream. ``process`` returns the frames that are
final so far, in stream order, which may be fewer rows than it was given (or none); the
same frames give byte-identical output (pixels and boxes) for any batching, in every run
(the permutation key is the tenant secret, the salt the frame's event id). At the end of a
stream ``flush()`` returns the rest (the worker calls it after the source's last batch); a
new frame shape, or time going back, ends a segment the same way (its frames come out with
the next call). A table of another stream before a flush drops what was held (withheld,
with a warning); ``reset()`` drops it too.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import numpy as np
import pyarrow as pa
from pydantic import Field

from modalign.operators.base import OperatorConfig, TableOperator
from modalign.operators.deid.face_tracks import CONFIRM_SCORE, FaceTracks, Hindsight, overlap
from modalign.operators.dependencies import require
from modalign.schemas.errors import ComplianceError, InputError
from modalign.schemas.arrow import arrow_type
from modalign.schemas.policy import DEFAULT_POLICY_TAG, FacePolicy
from modalign.schemas.tables import Box, DeidHeader

log = logging.getLogger(__name__)

FRAME = "frame"
FACE_BOXES = "face_boxes"
DEID = "deid"
BOX_TYPE = arrow_type(Box)
DEID_TYPE = arrow_type(DeidHeader)
METHOD = "blur_permute"
MERGE_IOU = 0.3
VERIFY_SCORE = 0.7  # a weak new detection is kept when a closer look scores this (LFW faces: 34 of 38 weak ones)
VERIFY_REACH = (1.5, 2.0)  # the closer looks' crop sides, in detected face sides
SAME_FACE_IOU = 0.5  # tracked path: boxes this similar are one face
NESTED = 0.9  # tracked path: a box this much inside another adds nothing
TILE_OVERLAP = 0.25  # fraction of a tile shared with its neighbour
MIN_TILED_SIDE = 400  # frames whose longer side is below this are only detected whole
SECOND_TILES = 3  # the second (short-range, 128x128 input) model's grid: faces of ~60-250 px in 720p
CLOSE_SIDE = 0.5  # the close grid's square tiles: this fraction of the frame's shorter side (360 px in 720p)
CLOSE_SIDES = (CLOSE_SIDE, 0.4)  # the close grids' tile sides (two scales; 0.4: 288 px in 720p)
CLOSE_OVERLAP = 0.35  # fraction of a close tile shared with its neighbour (a 126 px face fits one whole)
CLOSE_EVERY = 0  # dense streams: every this many full scans get the close grid (0: none; sparse frames: each)
ZOOM_OUT = 1.5  # the zoom-out pass: the frame padded (edges repeated) to a square of this many longer sides (0: off)
ZOOM_SIDE = 384  # ... seen at this many pixels a side (both models' inputs are 128-192 px)
REUSE_CELL = 8  # px side of the cells the unchanged-region test compares
RESIDUAL_CONTRAST = 0.1  # blur_permute keeps this fraction of the blurred box's spread around its mean
DENSE_GAP_NS = 100_000_000  # frames closer than this count as consecutive for tile_every
STILL_SCORE = 0.9  # the still model (MTCNN): its last stage's probability a box needs (its default 0.7)
STILL_MIN_FACE = 40  # px: the smallest face the still model looks for (its image pyramid starts there)

BoxT = tuple[int, int, int, int, float]  # x0, y0, x1, y1 (pixels, end-exclusive), score


class FaceBlurConfig(OperatorConfig):
    face: FacePolicy = FacePolicy()
    policy_tag: str = DEFAULT_POLICY_TAG
    model_selection: Literal[0, 1] = Field(1, description="mediapipe model: 0 short-range (<2 m), 1 full-range")
    secret: bytes | None = Field(
        None,
        repr=False,
        exclude=True,
        description="permutation key; None: a random one per operator instance (setup)",
    )


def anonymise_region(
    img: np.ndarray,
    box: Box | Sequence[float],
    secret: bytes,
    salt: bytes | str,
    sigma_ratio: float = 0.15,
) -> np.ndarray:
    """Blur then key-permute the pixels of ``box`` in ``img``, in place; return ``img``.

    ``img`` is a writable HxW or HxWxC uint8 array (a copy of any Arrow/read-only buffer);
    ``box`` is (x0, y0, x1, y1) in pixels, end-exclusive, clipped to the image. The
    Gaussian sigma is ``sigma_ratio * max(box w, h)``; the blurred box keeps
    ``RESIDUAL_CONTRAST`` of its spread around its mean colour; the permutation is drawn from a
    generator seeded by HMAC-SHA256(secret, salt + box), so it is reproducible with the
    secret and unpredictable without it. Even with the secret, undoing the permutation only
    gives back the strongly blurred box. Pixels outside the box are not touched.
    """
    if not img.flags.writeable:
        raise ValueError("anonymise_region writes in place: pass a writable copy of the image")
    if isinstance(box, Box):
        coords = (box.x0, box.y0, box.x1, box.y1)
    else:
        coords = tuple(box[:4])
    h_img, w_img = img.shape[:2]
    x0 = min(max(int(math.floor(coords[0])), 0), w_img)
    y0 = min(max(int(math.floor(coords[1])), 0), h_img)
    x1 = min(max(int(math.ceil(coords[2])), 0), w_img)
    y1 = min(max(int(math.ceil(coords[3])), 0), h_img)
    if x1 <= x0 or y1 <= y0:
        return img
    roi = np.ascontiguousarray(img[y0:y1, x0:x1])
    bw, bh = x1 - x0, y1 - y0
    sigma = sigma_ratio * max(bw, bh)
    if sigma > 0:
        roi = _strong_blur(roi, sigma, RESIDUAL_CONTRAST).reshape(bh, bw, -1)
    salt_b = salt.encode() if isinstance(salt, str) else bytes(salt)
    msg = b"modalign-face-permute\x1f" + salt_b + f"\x1f{x0},{y0},{x1},{y1}".encode()
    seed = int.from_bytes(hmac.new(secret, msg, hashlib.sha256).digest(), "big")
    rng = np.random.Generator(np.random.PCG64(seed))
    flat = roi.reshape(bh * bw, -1)
    permuted = np.take(flat, rng.permutation(bh * bw), axis=0)
    img[y0:y1, x0:x1] = permuted.reshape(img[y0:y1, x0:x1].shape)
    return img


def _flatten(roi: np.ndarray, contrast: float) -> np.ndarray:
    """``roi`` (HxWxC uint8) pulled towards its mean colour: each pixel keeps ``contrast`` of
    its difference from it. The permutation destroys where tones lie but keeps their spread
    (how much hair, skin, shadow a box holds); a face upscaled from a few pixels, whose detail
    is all low-frequency, stayed linkable by that spread alone (dlib, LFW subset: 9 of 88
    covered faces under 0.6 at 0.15 sigma, 2 at a quarter of the spread, 1 filled flat; with
    the head-sized padding of ``FacePolicy.pad_ratio`` 0.35 a quarter left 3 covered faces
    linked, a tenth 1, as many as the flat fill)."""
    shape = roi.shape
    roi = roi.reshape(shape[0], shape[1], -1)
    mean = roi.reshape(-1, roi.shape[-1]).mean(axis=0)
    out = (mean + (roi.astype(np.float32) - mean) * contrast).reshape(shape)
    return np.clip(np.round(out), 0, 255).astype(np.uint8)


def _strong_blur(roi: np.ndarray, sigma: float, contrast: float = 1.0) -> np.ndarray:
    """Gaussian blur of standard deviation ``sigma`` (pixels), computed at reduced resolution,
    with ``contrast`` of its spread around the mean kept (``_flatten``, on the small copy).

    A direct blur with sigma ~ 50 px costs ~200 ms for a 300x350 box; blurring a copy
    downscaled by ``k = sigma / 2`` (area averaging, itself a low-pass) with sigma 2 and
    scaling back gives the same loss of detail (nothing finer than ~sigma survives) in
    well under a millisecond.
    """
    cv2 = require("cv2")
    bh, bw = roi.shape[:2]
    k = max(1.0, sigma / 2.0)
    if k <= 1.5:
        out = cv2.GaussianBlur(roi, (0, 0), sigmaX=sigma, sigmaY=sigma, borderType=cv2.BORDER_REFLECT)
        return _flatten(out, contrast) if contrast != 1.0 else out
    sw, sh = max(1, int(round(bw / k))), max(1, int(round(bh / k)))
    small = cv2.resize(roi, (sw, sh), interpolation=cv2.INTER_AREA)
    small = cv2.GaussianBlur(small, (0, 0), sigmaX=sigma / k, sigmaY=sigma / k, borderType=cv2.BORDER_REFLECT)
    if contrast != 1.0:  # the upscale is linear: flattening the small copy flattens the box
        small = _flatten(small, contrast)
    return cv2.resize(small, (bw, bh), interpolation=cv2.INTER_LINEAR)


def mask_region(img: np.ndarray, box: Box | Sequence[float]) -> np.ndarray:
    """Fill ``box`` of ``img`` with the box's mean colour, in place (policy action ``mask``)."""
    if not img.flags.writeable:
        raise ValueError("mask_region writes in place: pass a writable copy of the image")
    coords = (box.x0, box.y0, box.x1, box.y1) if isinstance(box, Box) else tuple(box[:4])
    h_img, w_img = img.shape[:2]
    x0 = min(max(int(math.floor(coords[0])), 0), w_img)
    y0 = min(max(int(math.floor(coords[1])), 0), h_img)
    x1 = min(max(int(math.ceil(coords[2])), 0), w_img)
    y1 = min(max(int(math.ceil(coords[3])), 0), h_img)
    if x1 > x0 and y1 > y0:
        roi = img[y0:y1, x0:x1]
        roi[...] = roi.reshape(-1, *img.shape[2:]).mean(axis=0).round().astype(img.dtype)
    return img


def tile_regions(w: int, h: int, n: int, overlap: float = TILE_OVERLAP) -> list[tuple[int, int, int, int]]:
    """The whole frame, then an ``n x n`` grid of tiles overlapping by ``overlap`` of a tile."""
    regions = [(0, 0, w, h)]
    if n <= 1 or max(w, h) < MIN_TILED_SIDE:
        return regions
    tw = int(math.ceil(w / (n - (n - 1) * overlap)))
    th = int(math.ceil(h / (n - (n - 1) * overlap)))
    xs = np.linspace(0, w - tw, n).round().astype(int)
    ys = np.linspace(0, h - th, n).round().astype(int)
    return regions + [(int(x), int(y), int(x) + tw, int(y) + th) for y in ys for x in xs]


def close_regions(w: int, h: int, side: float = CLOSE_SIDE, overlap: float = CLOSE_OVERLAP) -> list[tuple[int, int, int, int]]:
    """Square tiles of ``side`` x the shorter side, overlapping by ``overlap`` of a tile, over
    the frame (15 in 720p): the short-range model sees a 100-130 px face there at 36-46 px of
    its 128 px input, where it finds low-resolution faces its 3x3 grid (non-square tiles,
    letterboxed: 25-32 px) misses. Frames whose longer side is under ``MIN_TILED_SIDE``: none."""
    if max(w, h) < MIN_TILED_SIDE:
        return []
    s = max(8, int(round(side * min(w, h))))
    step = s * (1 - overlap)
    nx, ny = (1 + max(0, int(math.ceil((d - s) / step))) for d in (w, h))
    xs = np.linspace(0, w - s, nx).round().astype(int) if nx > 1 else [0]
    ys = np.linspace(0, h - s, ny).round().astype(int) if ny > 1 else [0]
    return [(int(x), int(y), min(w, int(x) + s), min(h, int(y) + s)) for y in ys for x in xs]


class _MediapipeDetector:
    """mediapipe face detection (bundled BlazeFace .tflite models); pixel boxes with scores.

    The full-range model sees the image letterboxed to 192x192, so in a 1280x720 frame a
    face narrower than ~110 px is often missed; running it also on overlapping tiles
    (``tiles`` x ``tiles``) brings faces down to ~50 px wide into range. ``second``: the
    short-range model (a different network, 128x128 input) also runs on a finer grid of
    ``SECOND_TILES`` x ``SECOND_TILES`` tiles (it finds faces the full-range model misses:
    low resolution, tight crops; LFW faces upscaled to 100-160 px: 57 % -> 94 %) and, through
    ``detect_near``, on an upscaled crop around each tracked face the first pass missed.
    """

    def __init__(self, model_selection: int, min_score: float, tiles: int = 1, second: bool = False,
                 reuse_levels: int = 0) -> None:
        mp = require("mediapipe", lazy=("matplotlib.pyplot",))  # for drawing helpers only
        fd = mp.solutions.face_detection
        self._fd = fd.FaceDetection(model_selection=model_selection, min_detection_confidence=min_score)
        self._fd2 = fd.FaceDetection(model_selection=1 - model_selection, min_detection_confidence=min_score) if second else None
        self.tiles = tiles
        self.reuse_levels = reuse_levels  # FacePolicy.reuse_threshold; 0: every region detected every time
        # (model, region) -> (the region's cells when it was last detected, its detections then)
        self._seen: dict[tuple[int, tuple[int, int, int, int]], tuple[np.ndarray, list]] = {}
        self.reused = self.detected = 0  # region calls answered from ``_seen`` / run
        names = ("short-range", "full-range")
        self.name = f"mediapipe-face-detection@{mp.__version__}/{names[model_selection]}" + (f"/tiles{tiles}" if tiles > 1 else "")
        if second:
            self.name += f"+{names[1 - model_selection]}"

    def detect(self, rgb: np.ndarray, tiled: bool = True, fine: bool = True) -> list[tuple[float, float, float, float, float]]:
        """Detections of the whole frame; with ``tiled`` also of the tiles and, with ``fine``,
        of the second model's finer grid (also without ``tiled``)."""
        h, w = rgb.shape[:2]
        cells = change_cells(rgb) if self.reuse_levels else None
        out = []
        for region in tile_regions(w, h, self.tiles if tiled else 1):
            out += self._region(self._fd, rgb, region, cells)
        if fine and self._fd2 is not None and self.tiles > 1:
            for region in tile_regions(w, h, SECOND_TILES)[1:]:
                out += self._region(self._fd2, rgb, region, cells)
        return out

    def _region(self, fd: Any, rgb: np.ndarray, region: tuple[int, int, int, int],
                cells: np.ndarray | None) -> list[tuple[float, float, float, float, float]]:
        """``_run``, or the detections of the last time this model ran on ``region`` when none of
        its cells changed by ``reuse_levels`` since (the same pixels give the same answer: see
        "Unchanged regions")."""
        if cells is None:
            return _run(fd, rgb, region)
        key = (0 if fd is self._fd else 1, region)
        mine = cells[region[1] // REUSE_CELL: -(-region[3] // REUSE_CELL), region[0] // REUSE_CELL: -(-region[2] // REUSE_CELL)]
        seen = self._seen.get(key)
        if seen is not None and seen[0].shape == mine.shape and not (np.abs(seen[0] - mine) >= self.reuse_levels).any():
            self.reused += 1
            return list(seen[1])
        found = _run(fd, rgb, region)
        self._seen[key] = (mine.copy(), found)
        self.detected += 1
        return found

    def forget(self) -> None:
        """A new stream or segment: no region's earlier answer is reused."""
        self._seen.clear()

    def detect_close(self, rgb: np.ndarray) -> list[tuple[float, float, float, float, float]]:
        """Detections of the second model on the close grids (``close_regions`` of each of
        ``CLOSE_SIDES``); none without it or without tiles (``tiles = 1``: the whole frame only)."""
        if self._fd2 is None or self.tiles <= 1:
            return []
        h, w = rgb.shape[:2]
        cells = change_cells(rgb) if self.reuse_levels else None
        regions = list(dict.fromkeys(r for side in CLOSE_SIDES for r in close_regions(w, h, side)))
        return [b for region in regions for b in self._region(self._fd2, rgb, region, cells)]

    def detect_wide(self, rgb: np.ndarray) -> list[tuple[float, float, float, float, float]]:
        """The zoom-out pass: faces that fill the frame (close-ups), found by both models in the
        frame padded to a square of ``ZOOM_OUT`` times its longer side, edge pixels repeated
        (a face touching the frame's edges gets a border; the models see it at 1/3-2/3 of
        their input instead of filling it). A box counts when the other model finds it too
        (overlap > 0.3), with the higher score; clipped to the frame. None without the second
        model or with ``ZOOM_OUT`` 0."""
        if self._fd2 is None or ZOOM_OUT <= 0:
            return []
        cv2 = require("cv2")
        h, w = rgb.shape[:2]
        k = ZOOM_SIDE / (ZOOM_OUT * max(h, w))
        sw, sh = max(1, int(round(w * k))), max(1, int(round(h * k)))
        small = cv2.resize(rgb, (sw, sh), interpolation=cv2.INTER_AREA)
        px, py = (ZOOM_SIDE - sw) // 2, (ZOOM_SIDE - sh) // 2
        wide = cv2.copyMakeBorder(small, py, ZOOM_SIDE - sh - py, px, ZOOM_SIDE - sw - px, cv2.BORDER_REPLICATE)
        whole = (0, 0, ZOOM_SIDE, ZOOM_SIDE)
        a, b = _run(self._fd, wide, whole), _run(self._fd2, wide, whole)
        out = []
        for d in a:
            s = max((e[4] for e in b if overlap(d, e) > 0.3), default=None)
            if s is None:
                continue
            box = ((d[0] - px) / k, (d[1] - py) / k, (d[2] - px) / k, (d[3] - py) / k)
            box = (max(0.0, box[0]), max(0.0, box[1]), min(float(w), box[2]), min(float(h), box[3]))
            if box[2] > box[0] and box[3] > box[1]:
                out.append(box + (max(d[4], s),))
        return out

    def detect_near(self, rgb: np.ndarray, boxes: Sequence[Sequence[float]], both: bool = False,
                    reach: float = 2.0) -> list[tuple[float, float, float, float, float]]:
        """Faces in a square crop of ``reach`` times the side of each box (a tracked face's
        predicted, padded box), by the second model (the first where there is none; ``both``:
        by both)."""
        h, w = rgb.shape[:2]
        out = []
        for b in boxes:
            side = reach * max(b[2] - b[0], b[3] - b[1])
            cx, cy = (b[0] + b[2]) / 2, (b[1] + b[3]) / 2
            region = (max(0, int(cx - side / 2)), max(0, int(cy - side / 2)),
                      min(w, int(math.ceil(cx + side / 2))), min(h, int(math.ceil(cy + side / 2))))
            if region[2] - region[0] < 8 or region[3] - region[1] < 8:
                continue
            out += _run(self._fd2 if self._fd2 is not None else self._fd, rgb, region)
            if both and self._fd2 is not None:
                out += _run(self._fd, rgb, region)
        return out

    def close(self) -> None:
        self._fd.close()
        if self._fd2 is not None:
            self._fd2.close()


class _MtcnnDetector:
    """MTCNN (a cascade of three small CNNs over an image pyramid; the weights facenet-pytorch ships),
    the still model: another family than MediaPipe's single-shot BlazeFace, trained on other data,
    so it finds faces both MediaPipe models miss (turned, low-detail: an LFW face upscaled x5 that
    neither scores above 0.59 on any grid, MTCNN at 0.99). It costs about 120-145 ms per 720p frame on
    one core, so it runs only where the close grids run (frames that are no part of a dense run). A
    box counts when the last stage (O-Net) scores it ``STILL_SCORE``: that stage is the closer look
    (on the LFW subset's 100 non-face stills over street video: 2 boxes at its default 0.7, none at
    0.9; its finds are recall the MediaPipe verification would refuse, so it is not applied to them)."""

    def __init__(self) -> None:
        from modalign.operators.deid.mtcnn import Mtcnn

        self._m = Mtcnn(min_face=STILL_MIN_FACE, thresholds=(0.6, 0.7, STILL_SCORE))  # NumPy: no torch import
        self.name = self.model_name()

    @staticmethod
    def model_name() -> str:
        """The name lineage records (known before the model is loaded)."""
        from importlib.metadata import version

        return f"mtcnn@facenet-pytorch-{version('facenet-pytorch')}/{STILL_SCORE}"

    def detect(self, rgb: np.ndarray) -> list[tuple[float, float, float, float, float]]:
        h, w = rgb.shape[:2]
        boxes, probs = self._m.detect(rgb)
        out = []
        for b, p in zip(boxes, probs):
            x0, y0, x1, y1 = max(0.0, float(b[0])), max(0.0, float(b[1])), min(float(w), float(b[2])), min(float(h), float(b[3]))
            if x1 > x0 and y1 > y0:  # (its last stage kept only boxes over STILL_SCORE)
                out.append((x0, y0, x1, y1, float(p)))
        return out


def change_cells(rgb: np.ndarray) -> np.ndarray:
    """Grayscale means of ``REUSE_CELL`` px cells (float32): what "unchanged" is measured on."""
    cv2 = require("cv2")
    gray = cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2GRAY)
    h, w = gray.shape
    return cv2.resize(gray, (-(-w // REUSE_CELL), -(-h // REUSE_CELL)), interpolation=cv2.INTER_AREA).astype(np.float32)


def _run(fd: Any, rgb: np.ndarray, region: tuple[int, int, int, int]) -> list[tuple[float, float, float, float, float]]:
    """One mediapipe call on ``region`` of ``rgb``; boxes in frame pixels."""
    x0, y0, x1, y1 = region
    h, w = rgb.shape[:2]
    crop = rgb if (x0, y0, x1, y1) == (0, 0, w, h) else rgb[y0:y1, x0:x1]
    res = fd.process(np.ascontiguousarray(crop))
    cw, ch = x1 - x0, y1 - y0
    out = []
    for d in res.detections or []:
        bb = d.location_data.relative_bounding_box
        out.append((x0 + bb.xmin * cw, y0 + bb.ymin * ch, x0 + (bb.xmin + bb.width) * cw,
                    y0 + (bb.ymin + bb.height) * ch, float(d.score[0])))
    return out


@dataclass
class _Row:
    """One frame of a stream on its way through the operator (raw pixels, in this process)."""

    src: pa.Table  # the input table it came in
    i: int  # its row there
    img: np.ndarray  # read-only view of its pixels
    valid: bool
    event_id: str
    pos: int  # position in the stream (segment): the tiling grid
    t_ns: int


class _Spread:
    """The static window (``track_hold_s = 0``) over a stream: a frame gets its own and its
    ``win`` neighbours' detections on each side, final once ``win`` later frames are scanned."""

    def __init__(self, win: int) -> None:
        self.win = win
        self.past: list[list[BoxT]] = []  # detections of the last ``win`` frames popped
        self.rows: list[list[BoxT]] = []  # detections of the frames not popped

    def add(self, detected: list[BoxT]) -> None:
        self.rows.append(detected)

    def pop(self, end: bool = False) -> list[list[BoxT]]:
        out = []
        while self.rows and (end or len(self.rows) > self.win):
            pool = [b for d in self.past + self.rows[: self.win + 1] for b in d]
            out.append(_merge(pool))
            done = self.rows.pop(0)
            self.past = (self.past + [done])[-self.win:] if self.win else []
        return out


@dataclass
class _Segment:
    """What one stream (one frame shape of it) carries from a table to the next."""

    stream: str | None  # event_id prefix
    schema: pa.Schema  # of its tables (frame shape included)
    shape: tuple[int, int]
    resolver: Hindsight | _Spread
    tracks: FaceTracks | None
    last_order: int | None = None  # t_ns (else frame_index) of the last row of the last table
    pos: int = 0  # rows of the segment received
    waiting: _Row | None = None  # the newest row: scanned once the next one (or the end) is known
    scanned_t: int | None = None  # time of the last scanned row
    flags: list[tuple[bool, bool, bool] | None] = field(default_factory=lambda: [None, None])  # (scanned, tiles, fine) of the last two
    full_scans: int = 0  # scans with the tiles and the fine grid so far (the close grid's schedule)
    light_scans: int = 0  # scans since the last one with the tiles and the fine grid (``FacePolicy.full_every``)
    rows: list[_Row] = field(default_factory=list)  # scanned, boxes not final yet, oldest first


class FaceBlurOperator(TableOperator[FaceBlurConfig]):
    """Detect faces and blur+permute them; adds ``face_boxes`` and a ``deid`` header.

    Input: a ``frame`` column of fixed_shape_tensor uint8 [H, W, 3] (RGB) plus any other
    columns (``event_id``, ``t_ns`` ...), which pass through unchanged. Output: the same
    columns with ``frame`` replaced by anonymised frames in a new buffer, ``face_boxes``
    (the boxes anonymised in that frame, padded, pixels, with detector scores) and
    ``deid``. A frame whose detection fails raises ComplianceError: it is never emitted raw.
    Rows come out in stream order once their boxes are final (see "Look-ahead" above): call
    ``flush()`` at the end of each stream for the rest (``keep`` holds nothing back).
    """

    kind = "face_blur"
    version = "0.14.0"
    config_model = FaceBlurConfig

    def __init__(self, config: FaceBlurConfig | None = None) -> None:
        super().__init__(config)
        self._detector: Any = None
        self._still: _MtcnnDetector | None = None  # FacePolicy.still_model
        self._secret: bytes = b""
        self._seg: _Segment | None = None
        self._done: list[pa.Table] = []  # anonymised tables not returned yet, in stream order
        self._faces: dict[tuple[int, int, int, int], tuple[float, ...]] = {}  # the row's padded boxes -> detected faces

    # -- lifecycle -----------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.config
        self._secret = cfg.secret if cfg.secret is not None else os.urandom(32)
        if cfg.face.action != "keep" and self._detector is None:
            self._detector = _MediapipeDetector(cfg.model_selection, cfg.face.min_score, cfg.face.tiles,
                                                cfg.face.second_pass, cfg.face.reuse_threshold)
        if cfg.face.action != "keep" and cfg.face.still_model == "mtcnn":
            from modalign.operators.deid.mtcnn import default_weights

            default_weights()  # its weights are there (loaded on its first frame: ``_still_model``)
        self._ready = True

    def _still_model(self) -> "_MtcnnDetector | None":
        """The still model, loaded on the first frame that gets it (reading its weights costs ~0.2 CPU s,
        and an actor that decodes only dense video up to a range's cut never runs it); None: off."""
        if self._still is None and self.config.face.action != "keep" and self.config.face.still_model == "mtcnn":
            self._still = _MtcnnDetector()
        return self._still

    def reset(self) -> None:
        """Drop the held-back frames (withheld, never emitted) and the face tracks."""
        self._seg = None
        self._done.clear()

    def flush(self, cut: bool = False) -> list[pa.Table]:
        """End of stream: the held-back frames, anonymised (the last one scanned as the
        stream's last frame), in stream order, one table per frame shape. The operator is then
        ready for another stream. ``cut``: the video goes on past the last frame given (a range
        of it ends inside its overlap), so that frame is scanned as the dense frame it is in the
        whole video, not as a last frame (which gets every pass and the still model)."""
        if self.config.face.action == "keep":
            return []
        self.ensure_setup()
        try:
            if self._seg is not None:
                self._finish(cut)
        except BaseException:
            self.reset()
            raise
        out = []
        while self._done:
            out.append(take_run(self._done))
        return out

    @property
    def detector_name(self) -> str:
        if self.config.face.action == "keep":
            return "none"
        name = getattr(self._detector, "name", "mediapipe-face-detection")
        still = self.config.face.still_model == "mtcnn"
        return name + (f"+{_MtcnnDetector.model_name()}" if still else "")

    def output_schema(self, input_schema: pa.Schema) -> pa.Schema:
        return region_schema(input_schema, FACE_BOXES, DEID)

    # -- processing ----------------------------------------------------------------------
    def process(self, table: pa.Table) -> pa.Table:
        self.ensure_setup()
        frames = frame_array(table)
        n = len(frames)
        pol = self.config.face
        if pol.action == "keep":
            return self._assemble(table, frames, [[] for _ in range(n)], method=pol.action)
        if n:
            try:
                self._add(table, frames)
            except BaseException:
                self.reset()  # what was held is withheld, never emitted raw
                raise
        if self._done:
            return take_run(self._done)
        empty = table.slice(0, 0)
        return self._assemble(empty, frame_array(empty), [], method=pol.action)

    def _add(self, table: pa.Table, frames: pa.ExtensionArray) -> None:
        """Scan this table's rows (each once the next row is known), emit the final ones."""
        stream, first, last = stream_span(table)
        shape = (int(frames.type.shape[0]), int(frames.type.shape[1]))
        seg = self._seg
        if seg is not None:
            later = seg.last_order is None or first is None or first > seg.last_order
            if seg.stream != stream or not later:  # another stream, not flushed: its rows must not go out here
                dropped = len(seg.rows) + (seg.waiting is not None) + sum(t.num_rows for t in self._done)
                if dropped:
                    log.warning("face_blur: %d held frame(s) of %s dropped (withheld): the stream was not flushed",
                                dropped, seg.stream)
                self.reset()
            elif not seg.schema.equals(table.schema, check_metadata=False):
                self._finish()  # a new frame shape: the held frames end their segment
        if self._seg is None:
            self._seg = self._new_segment(stream, table.schema, shape)
        seg = self._seg
        seg.last_order = last if last is not None else seg.last_order
        imgs, valid = tensor_view(frames)
        ids = event_ids(table)
        times = _frame_times(table, seg.pos)
        for i in range(len(frames)):
            if seg.waiting is not None and times[i] <= seg.waiting.t_ns:  # time went back: tracks start over
                self._finish()
                seg = self._seg = self._new_segment(stream, table.schema, shape)
                seg.last_order = last
            row = _Row(table, i, imgs[i], bool(valid[i]), ids[i], seg.pos, times[i])
            if seg.waiting is not None:
                self._scan(seg, seg.waiting, row.t_ns)
            seg.waiting = row
            seg.pos += 1
        self._emit(seg, seg.resolver.pop())

    def _new_segment(self, stream: str | None, schema: pa.Schema, shape: tuple[int, int]) -> _Segment:
        pol = self.config.face
        if hasattr(self._detector, "forget"):  # earlier answers belong to the stream (and its frame shape)
            self._detector.forget()
        h, w = shape
        if pol.track_hold_s > 0:
            return _Segment(stream, schema, shape, Hindsight(w, h, pol.temporal_window, pol.track_hold_s),
                            FaceTracks(w, h, pol.track_hold_s))
        return _Segment(stream, schema, shape, _Spread(pol.temporal_window), None)

    def _finish(self, cut: bool = False) -> None:
        """End of a stream or a segment: scan the waiting row as the last one (``cut``: as one
        followed a frame interval later), emit every row."""
        seg = self._seg
        if seg.waiting is not None:
            row = seg.waiting
            step = row.t_ns - seg.scanned_t if seg.scanned_t is not None else None
            self._scan(seg, row, row.t_ns + step if cut and step else None)
            seg.waiting = None
        self._emit(seg, seg.resolver.pop(end=True))
        self._seg = None

    def _scan(self, seg: _Segment, row: _Row, next_t: int | None) -> None:
        """Detect (and track) the faces of ``row``; ``next_t``: the next row's time (None: last row)."""
        pol = self.config.face
        self._faces.clear()
        scan = _tiled(row.pos, pol.tile_every, seg.scanned_t, row.t_ns, next_t)
        tiled, fine = _passes(scan, seg.flags, last=next_t is None, alternate=seg.tracks is not None,
                              light=seg.light_scans, every=pol.full_every)
        close = tiled and fine and ((CLOSE_EVERY > 0 and seg.full_scans % CLOSE_EVERY == 0)
                                    or _sparse(seg.scanned_t, row.t_ns, next_t))
        seg.full_scans += tiled and fine
        if scan:
            seg.light_scans = 0 if tiled and fine else seg.light_scans + 1
        seg.flags, seg.scanned_t = [seg.flags[1], (scan, tiled, fine)], row.t_ns
        seg.rows.append(row)
        if seg.tracks is None:
            seg.resolver.add(self._detect(row, tiled, fine, close=close) if row.valid else [])
            return
        tracks, t = seg.tracks, row.t_ns
        seen: list = []
        if row.valid and not scan:  # between two scans: the tracks carry each face, hindsight interpolates it
            seen = tracks.update(t, [], confident=False)
        elif row.valid:
            second = hasattr(self._detector, "detect_near")
            checked: set[BoxT] = set()
            boxes = self._detect(row, tiled, fine, close=close, checked=checked)
            missed = tracks.missed(t, boxes) if second and scan else []
            if missed:  # a tracked face a full scan lost: look again, closer (between scans, tracks interpolate)
                boxes = _dedupe(boxes + self._detect(row, tiled, fine, near=missed))
            if second:  # a weak detection that starts no track must be seen again up close (hands, textures)
                continuing = tracks.continuing(t, boxes)
                boxes = [b if b[4] >= CONFIRM_SCORE or b in checked or b in continuing else self._verified(row, b)
                         for b in boxes]
                boxes = [b for b in boxes if b is not None]
            seen = tracks.update(t, boxes, confident=scan)
        seg.resolver.add(t, seen, tracks.live())

    def _emit(self, seg: _Segment, applied: list[list[BoxT]]) -> None:
        """Anonymise the oldest ``len(applied)`` scanned rows (final boxes) into a new frame
        buffer; queue the output table."""
        if not applied:
            return
        rows, seg.rows = seg.rows[: len(applied)], seg.rows[len(applied):]
        pol = self.config.face
        pieces, lo = [], 0
        for k in range(1, len(rows) + 1):  # consecutive rows of one input table: one zero-copy slice
            if k == len(rows) or rows[k].src is not rows[lo].src or rows[k].i != rows[k - 1].i + 1:
                pieces.append(rows[lo].src.slice(rows[lo].i, k - lo))
                lo = k
        table = pieces[0] if len(pieces) == 1 else pa.concat_tables(pieces)
        applied = [_dedupe(b) if r.valid else [] for r, b in zip(rows, applied)]
        out = np.stack([r.img for r in rows])  # new buffer: the input's (read-only) buffer is never written
        for k, r in enumerate(rows):
            for b in applied[k]:
                if pol.action == "mask":
                    mask_region(out[k], b)
                else:
                    anonymise_region(out[k], b, self._secret, r.event_id, pol.blur_sigma_ratio)
        valid = np.array([r.valid for r in rows])
        like = table.column(FRAME).chunk(0)  # the tensor type (no copy of the raw pixels)
        self._done.append(self._assemble(table, frames_like(like, out, valid), applied, method=pol.action))

    def _detect(self, row: _Row, tiled: bool, fine: bool, near: list[BoxT] | None = None,
                close: bool = False, checked: set[BoxT] | None = None) -> list[BoxT]:
        """Padded detections in ``row`` (``close``: also the close grid, where the detector has
        one); with ``near``, only the second look around those boxes. A full scan (``tiled``
        and ``fine``) with ``close`` or with nothing found also gets the zoom-out pass; its
        boxes (both models agreed) are added to ``checked``: a closer look cannot judge a face
        that fills the frame."""
        pol = self.config.face
        img = row.img
        wide: list = []
        still: list = []
        try:
            if near is None:
                raw = self._detector.detect(img, tiled=tiled, fine=fine)
                closer = self._detector.detect_close(img) if close and hasattr(self._detector, "detect_close") else []
                if tiled and fine and (close or not (raw or closer)) and hasattr(self._detector, "detect_wide"):
                    wide = self._detector.detect_wide(img)
                if close and (model := self._still_model()) is not None:
                    still = model.detect(img)
            else:
                raw, closer = self._detector.detect_near(img, near), []
        except Exception:
            raise self._detection_failed(row) from None
        boxes = _pad_clip(raw, pol, img.shape[1], img.shape[0], self._faces)
        for d in still:
            # the still model's last stage judged it: a face the other passes missed is kept, and a
            # MediaPipe detection of the same face (often a weak one no closer look confirms) needs no
            # closer look; compared as detected faces, not padded boxes (a padded box reaches the next face)
            padded = _pad_clip([d], pol, img.shape[1], img.shape[0], self._faces)
            if not padded:
                continue
            b = padded[0]
            same = [k for k, f in enumerate(boxes) if overlap(self._faces.get(f[:4], f), d) > 0.5]
            if not same:
                boxes.append(b)
                same = [len(boxes) - 1]
            for k in same:
                boxes[k] = boxes[k][:4] + (max(boxes[k][4], b[4]),)
                if checked is not None:
                    checked.add(boxes[k])
        # the zoom-out (both models agreed): faces the other passes missed, kept without a closer look
        for b in _pad_clip(wide, pol, img.shape[1], img.shape[0], self._faces):
            if not any(overlap(b, f) > 0.3 for f in boxes):
                boxes.append(b)
                if checked is not None:
                    checked.add(b)
        found = list(boxes)
        for b in _pad_clip(closer, pol, img.shape[1], img.shape[0], self._faces):
            # the close grid adds faces the other passes missed, each seen again up close (it
            # also fires on bodies, at up to 0.89, and such a box beside a face must not
            # replace the face's own box in its track)
            if not any(overlap(b, f) > 0.3 for f in found):
                b = self._verified(row, b)
                if b is not None:
                    boxes.append(b)
        return _dedupe(boxes)

    def _detection_failed(self, row: _Row) -> ComplianceError:
        return ComplianceError(
            f"face detection failed on event {row.event_id}; the frame and those held back before it are "
            "withheld, not written raw",
            source_uri=first_str(row.src, "source_uri"),
            stage=self.kind,
        )

    def _verified(self, row: _Row, box: BoxT) -> BoxT | None:
        """``box`` (a padded detection) if both models, on upscaled crops around it, find
        a face there scoring at least ``VERIFY_SCORE`` (then with that score), else None. The
        crops are ``VERIFY_REACH`` times the detected (unpadded) face's side: the short-range
        model scores a face filling 1/2 to 2/3 of its input highest (LFW faces missed by the
        grids: 0.70-0.81 there, 0.59-0.68 in a crop of 3 sides)."""
        h, w = row.img.shape[:2]
        face = _unpad(box, self.config.face)
        if box[0] <= 0 or box[1] <= 0 or box[2] >= w or box[3] >= h:  # clipped: its padding cannot be taken off
            face = self._faces.get(box[:4], face)
        try:
            found = [f for reach in VERIFY_REACH
                     for f in self._detector.detect_near(row.img, [face], both=True, reach=reach)]
        except Exception:
            raise self._detection_failed(row) from None
        best = max((f[4] for f in found if overlap(f, box) > 0.3), default=0.0)
        return box[:4] + (best,) if best >= VERIFY_SCORE else None

    def _assemble(self, table: pa.Table, frames: pa.Array, applied: list[list[BoxT]], method: str) -> pa.Table:
        header = {"policy": self.config.policy_tag, "method": method, "detector": self.detector_name,
                  "threshold": self.config.face.min_score}
        return with_regions(table, frames, applied, header, FACE_BOXES, DEID)


# -- helpers ---------------------------------------------------------------------------------
def take_run(queue: list[pa.Table]) -> pa.Table:
    """Pop the oldest queued output table, joined with the queued ones of the same schema after it."""
    first = queue.pop(0)
    run = [first]
    while queue and queue[0].schema.equals(first.schema, check_metadata=False):
        run.append(queue.pop(0))
    return run[0] if len(run) == 1 else pa.concat_tables(run)


def region_schema(schema: pa.Schema, boxes_col: str, deid_col: str) -> pa.Schema:
    """``schema`` with (fresh) columns for the removed regions' boxes and their de-id header."""
    for name in (boxes_col, deid_col):
        idx = schema.get_field_index(name)
        if idx >= 0:
            schema = schema.remove(idx)
    return schema.append(pa.field(boxes_col, pa.list_(BOX_TYPE))).append(pa.field(deid_col, DEID_TYPE))


def frames_like(frames: pa.ExtensionArray, pixels: np.ndarray, valid: np.ndarray) -> pa.ExtensionArray:
    """A tensor array of ``frames``' type over new ``pixels`` (N, H, W, 3), nulls where not ``valid``."""
    storage = pa.FixedSizeListArray.from_arrays(
        pa.array(pixels.reshape(-1), type=pa.uint8()),
        int(np.prod(pixels.shape[1:])),
        mask=None if bool(np.all(valid)) else pa.array(~np.asarray(valid, bool)),
    )
    return pa.ExtensionArray.from_storage(frames.type, storage)


def with_regions(table: pa.Table, frames: pa.Array, applied: list[list[BoxT]], header: dict,
                 boxes_col: str, deid_col: str) -> pa.Table:
    """``table`` with ``frames`` in place of its frame column, plus per-row boxes and headers
    (``header`` without ``count``: the count is each row's number of boxes)."""
    idx = table.schema.get_field_index(FRAME)
    out = table.set_column(idx, table.schema.field(idx), frames)
    for name in (boxes_col, deid_col):
        j = out.schema.get_field_index(name)
        if j >= 0:
            out = out.remove_column(j)
    boxes = pa.array(
        [[{"x0": b[0], "y0": b[1], "x1": b[2], "y1": b[3], "score": b[4]} for b in bs] for bs in applied],
        type=pa.list_(BOX_TYPE),
    )
    headers = pa.array([dict(header, count=len(bs)) for bs in applied], type=DEID_TYPE)
    return out.append_column(pa.field(boxes_col, boxes.type), boxes).append_column(pa.field(deid_col, DEID_TYPE), headers)


def frame_array(table: pa.Table) -> pa.ExtensionArray:
    """The ``frame`` column as one fixed-shape tensor array (InputError if absent or not uint8 RGB)."""
    if FRAME not in table.column_names:
        raise InputError(f"face_blur needs a {FRAME!r} column", stage="face_blur", code="bad_batch")
    col = table.column(FRAME)
    typ = col.type
    if (
        not isinstance(typ, pa.FixedShapeTensorType)
        or typ.value_type != pa.uint8()
        or len(typ.shape) != 3
        or typ.shape[2] != 3
        or (typ.permutation is not None and list(typ.permutation) != [0, 1, 2])
    ):
        raise InputError(
            f"face_blur needs {FRAME!r} as fixed_shape_tensor uint8 [H, W, 3] (row-major), got {typ}",
            stage="face_blur",
            code="bad_batch",
        )
    return col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)


def tensor_view(frames: pa.ExtensionArray) -> tuple[np.ndarray, np.ndarray]:
    """(N, H, W, 3) read-only view of the frames (no copy) and a validity mask."""
    shape = tuple(frames.type.shape)
    size = int(np.prod(shape))
    storage = frames.storage
    n = len(storage)
    values = storage.values.slice(storage.offset * size, n * size)
    arr = values.to_numpy(zero_copy_only=True).reshape((n, *shape))
    valid = np.ones(n, dtype=bool) if storage.null_count == 0 else storage.is_valid().to_numpy(zero_copy_only=False)
    return arr, valid


def event_ids(table: pa.Table) -> list[str]:
    """Event id per row (``row-i`` where absent): names frames in errors, salts permutations."""
    if "event_id" in table.column_names:
        return [str(x) if x is not None else f"row-{i}" for i, x in enumerate(table.column("event_id").to_pylist())]
    return [f"row-{i}" for i in range(table.num_rows)]


def first_str(table: pa.Table, name: str) -> str | None:
    """The first row's value of a string column, or None."""
    if name in table.column_names and table.num_rows:
        v = table.column(name)[0].as_py()
        return str(v) if v is not None else None
    return None


def _tiled(pos: int, every: int, prev_t: int | None, t: int, next_t: int | None) -> bool:
    """Does the frame at stream position ``pos`` get the tiled pass (``FacePolicy.tile_every``)?

    With ``every == 2`` a frame at an odd position is skipped only when both neighbours in the
    stream are within ``DENSE_GAP_NS`` of it, so the tracks cover it from them; sparse
    (sampled) frames and the stream's last frame (``next_t`` None) are always tiled. Depends
    on the stream alone, not on where its tables begin and end.
    """
    if every <= 1 or pos % every == 0 or next_t is None or prev_t is None:
        return True
    return t - prev_t > DENSE_GAP_NS or next_t - t > DENSE_GAP_NS


def _sparse(prev_t: int | None, t: int, next_t: int | None) -> bool:
    """Is the frame at ``t`` no part of a dense run (its stream's last frame, a still, or more
    than ``DENSE_GAP_NS`` from the scanned frame before or the frame after it)? No later scan
    can carry a face back to it, so it gets every pass. A dense stream's first frame is part
    of its run (hindsight covers it from the scans after)."""
    return (next_t is None or next_t - t > DENSE_GAP_NS
            or (prev_t is not None and t - prev_t > DENSE_GAP_NS))


def _passes(scan: bool, flags: list[tuple[bool, bool, bool] | None], last: bool,
            alternate: bool, light: int = 1, every: int = 2) -> tuple[bool, bool]:
    """(tiles, fine) of a frame: does it get the first model's tiles, the second model's finer
    grid? A frame ``_tiled`` does not pick gets neither (the whole frame only). In a dense
    stream (scans two apart) the finer grid runs on every other scan; with ``alternate``
    (tracking: a face found on one full scan is followed, and covered back in time) so do
    the tiles, on every ``every``-th scan (``light``: scans since the last full one), the
    scans between getting the whole frame (and the closer looks at missed tracks). The first
    frame after a gap, sparse frames and the stream's last frame get both. ``flags``:
    (scanned, tiles, fine) of the two frames before it."""
    if not scan:
        return False, False
    two, one = flags
    dense = two is not None and one is not None and two[0] and not one[0]
    if last or not dense:
        return True, True
    if not alternate:
        return True, not two[2]
    both = light >= every - 1
    return both, both


def stream_span(table: pa.Table) -> tuple[str | None, int | None, int | None]:
    """(stream id from the event_id prefix, first and last t_ns or frame_index) of a table: which
    stream its rows continue, and where (the operators that carry state across tables use it)."""
    stream = None
    if "event_id" in table.column_names and table.num_rows:
        first = table.column("event_id")[0].as_py()
        stream = str(first).rsplit("/", 1)[0] if first is not None else None
    for name in ("t_ns", "frame_index"):
        if name in table.column_names and table.num_rows:
            col = table.column(name)
            a, b = col[0].as_py(), col[table.num_rows - 1].as_py()
            if a is not None and b is not None:
                return stream, int(a), int(b)
    return stream, None, None


def _frame_times(table: pa.Table, start: int = 0, frame_ns: int = 40_000_000) -> list[int]:
    """Time of each row: ``t_ns``, else ``frame_index`` (or the stream position, the first
    row's being ``start``) at 25 fps."""
    for name, scale in (("t_ns", 1), ("frame_index", frame_ns)):
        if name in table.column_names and table.column(name).null_count == 0:
            return [int(v) * scale for v in table.column(name).to_pylist()]
    return [(start + i) * frame_ns for i in range(table.num_rows)]


def _pad_clip(raw: list[tuple[float, float, float, float, float]], pol: FacePolicy, w: int, h: int,
              faces: dict | None = None) -> list[BoxT]:
    """Detections scoring ``pol.min_score`` grown to the head (``pad_ratio`` of their width to
    each side, ``pad_above_ratio`` / ``pad_below_ratio`` of their height above and below),
    clipped to the ``w`` x ``h`` frame, in whole pixels; ``faces`` gets each box's detection
    (the face a closer look is measured on: a clipped box cannot be unpadded)."""
    out = []
    for x0, y0, x1, y1, s in raw:
        if s < pol.min_score:
            continue
        pw, bh = pol.pad_ratio * (x1 - x0), y1 - y0
        bx0 = max(0, int(math.floor(x0 - pw)))
        by0 = max(0, int(math.floor(y0 - pol.pad_above_ratio * bh)))
        bx1 = min(w, int(math.ceil(x1 + pw)))
        by1 = min(h, int(math.ceil(y1 + pol.pad_below_ratio * bh)))
        if bx1 > bx0 and by1 > by0:
            out.append((bx0, by0, bx1, by1, float(s)))
            if faces is not None:
                faces.setdefault((bx0, by0, bx1, by1), (x0, y0, x1, y1))
    return out


def _unpad(box: BoxT, pol: FacePolicy) -> tuple[float, float, float, float]:
    """The detected face inside a box ``_pad_clip`` padded (exact where it was not clipped)."""
    x0, y0, x1, y1 = box[:4]
    pw = pol.pad_ratio * (x1 - x0) / (1 + 2 * pol.pad_ratio)
    bh = (y1 - y0) / (1 + pol.pad_above_ratio + pol.pad_below_ratio)
    return x0 + pw, y0 + pol.pad_above_ratio * bh, x1 - pw, y1 - pol.pad_below_ratio * bh


def _merge(boxes: list[BoxT]) -> list[BoxT]:
    """Union overlapping boxes (the same face in neighbouring frames) into one covering box."""
    boxes = sorted(set(boxes))
    merged = True
    while merged and len(boxes) > 1:
        merged = False
        for i in range(len(boxes)):
            for j in range(i + 1, len(boxes)):
                a, b = boxes[i], boxes[j]
                if overlap(a, b) > MERGE_IOU:
                    u = (min(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), max(a[3], b[3]), max(a[4], b[4]))
                    boxes = [x for k, x in enumerate(boxes) if k not in (i, j)] + [u]
                    merged = True
                    break
            if merged:
                break
    return sorted(boxes)


def _dedupe(boxes: list[BoxT]) -> list[BoxT]:
    """One box per face: boxes of the same face (IoU >= ``SAME_FACE_IOU``) become their union,
    a box lying ``NESTED`` inside a larger one is dropped; neighbouring faces keep their own
    boxes (a union of two faces' boxes would cover the space between them, and chain)."""
    out: list[BoxT] = []
    for b in sorted(set(boxes), key=lambda x: (-(x[2] - x[0]) * (x[3] - x[1]), x)):
        area = (b[2] - b[0]) * (b[3] - b[1])
        for k, a in enumerate(out):
            ix = max(0, min(a[2], b[2]) - max(a[0], b[0]))
            iy = max(0, min(a[3], b[3]) - max(a[1], b[1]))
            inter = ix * iy
            if inter >= NESTED * area:
                out[k] = a[:4] + (max(a[4], b[4]),)
                break
            if inter / ((a[2] - a[0]) * (a[3] - a[1]) + area - inter) >= SAME_FACE_IOU:
                out[k] = (min(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), max(a[3], b[3]), max(a[4], b[4]))
                break
        else:
            out.append(b)
    return sorted(out)
