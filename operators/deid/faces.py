"""Face de-identification of decoded video frames, inside the ingest worker.

Data flow: ``modalign.operators.ingest`` video decode -> **FaceBlurOperator** -> JPEG encode and the
aligner. Raw frames never leave the ingest process: this operator runs right after decode
and every frame it returns has each detected face replaced by a strong Gaussian blur
followed by a keyed pixel permutation of the blurred box. Pixels outside the boxes are
bit-identical to the input; only the box coordinates (``face_boxes``) are kept. Policy
action ``mask`` fills each box with its mean colour instead (nothing of the face is left).

Small faces: MediaPipe's full-range model sees the frame letterboxed to 192x192, so faces
under ~110 px in 720p are missed whole-frame; ``FacePolicy.tiles`` (default 2) adds a pass
over a 2x2 grid of overlapping tiles. ``tile_every = 2`` runs that pass on every other
frame of a dense stream (the face tracks cover the frames between; sparse or
sampled frames always get it), and the second model's 3x3 grid on every other tiled frame.

Second pass: with ``FacePolicy.second_pass`` the short-range model (another network) also
runs on the tiles, and on an upscaled crop around each tracked face the first pass missed
in a frame, so a face is re-found (and its box stays tight) rather than guessed. A weak
detection (score under ``face_tracks.CONFIRM_SCORE``) that continues no track is kept only
when both models, looking at an upscaled crop around it, score it ``VERIFY_SCORE``: hands,
hair and textures fire weakly and are not confirmed; weak real faces mostly are.

Temporal consistency (faces fail closed): detections feed face tracks
(``modalign.operators.deid.face_tracks``, kept across the tables of one stream, same
``event_id`` prefix, later ``t_ns``). Each face gets one box per frame: its detection, the
box interpolated between two detections around a miss, its box moved back in time for up
to ``track_hold_s`` before it was first found in the table (``temporal_window`` frames for
a single weak detection), or, forward in time and at the end
of a table, its last box moved with its velocity and widened until the track has been
missed for ``FacePolicy.track_hold_s`` and in 3 fully scanned frames in a row (a weak
detection never seen again is dropped after 2 frames: hands and textures). With
``track_hold_s = 0`` the older static window applies instead: a detection in frame ``i`` is
copied to frames ``i - temporal_window .. i + temporal_window`` (carried into the next
table of the stream). Call ``reset()`` between unrelated streams.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import numpy as np
import pyarrow as pa
from pydantic import Field

from modalign.operators.base import OperatorConfig, TableOperator
from modalign.operators.deid.face_tracks import CONFIRM_SCORE, FaceTracks, interpolate, overlap
from modalign.operators.dependencies import require
from modalign.schemas.errors import ComplianceError, InputError
from modalign.schemas.arrow import arrow_type
from modalign.schemas.policy import DEFAULT_POLICY_TAG, FacePolicy
from modalign.schemas.tables import Box, DeidHeader

FRAME = "frame"
FACE_BOXES = "face_boxes"
DEID = "deid"
BOX_TYPE = arrow_type(Box)
DEID_TYPE = arrow_type(DeidHeader)
METHOD = "blur_permute"
MERGE_IOU = 0.3
VERIFY_SCORE = 0.7  # a weak new detection is kept when a closer look scores this (LFW faces: 34 of 38 weak ones)
SAME_FACE_IOU = 0.5  # tracked path: boxes this similar are one face
NESTED = 0.9  # tracked path: a box this much inside another adds nothing
TILE_OVERLAP = 0.25  # fraction of a tile shared with its neighbour
MIN_TILED_SIDE = 400  # frames whose longer side is below this are only detected whole
SECOND_TILES = 3  # the second (short-range, 128x128 input) model's grid: faces of ~60-250 px in 720p
DENSE_GAP_NS = 100_000_000  # frames closer than this count as consecutive for tile_every

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
    Gaussian sigma is ``sigma_ratio * max(box w, h)``; the permutation is drawn from a
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
        roi = _strong_blur(roi, sigma).reshape(bh, bw, -1)
    salt_b = salt.encode() if isinstance(salt, str) else bytes(salt)
    msg = b"modalign-face-permute\x1f" + salt_b + f"\x1f{x0},{y0},{x1},{y1}".encode()
    seed = int.from_bytes(hmac.new(secret, msg, hashlib.sha256).digest(), "big")
    rng = np.random.Generator(np.random.PCG64(seed))
    flat = roi.reshape(bh * bw, -1)
    permuted = np.take(flat, rng.permutation(bh * bw), axis=0)
    img[y0:y1, x0:x1] = permuted.reshape(img[y0:y1, x0:x1].shape)
    return img


def _strong_blur(roi: np.ndarray, sigma: float) -> np.ndarray:
    """Gaussian blur of standard deviation ``sigma`` (pixels), computed at reduced resolution.

    A direct blur with sigma ~ 50 px costs ~200 ms for a 300x350 box; blurring a copy
    downscaled by ``k = sigma / 2`` (area averaging, itself a low-pass) with sigma 2 and
    scaling back gives the same loss of detail (nothing finer than ~sigma survives) in
    well under a millisecond.
    """
    cv2 = require("cv2")
    bh, bw = roi.shape[:2]
    k = max(1.0, sigma / 2.0)
    if k <= 1.5:
        return cv2.GaussianBlur(roi, (0, 0), sigmaX=sigma, sigmaY=sigma, borderType=cv2.BORDER_REFLECT)
    sw, sh = max(1, int(round(bw / k))), max(1, int(round(bh / k)))
    small = cv2.resize(roi, (sw, sh), interpolation=cv2.INTER_AREA)
    small = cv2.GaussianBlur(small, (0, 0), sigmaX=sigma / k, sigmaY=sigma / k, borderType=cv2.BORDER_REFLECT)
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

    def __init__(self, model_selection: int, min_score: float, tiles: int = 1, second: bool = False) -> None:
        mp = require("mediapipe")
        fd = mp.solutions.face_detection
        self._fd = fd.FaceDetection(model_selection=model_selection, min_detection_confidence=min_score)
        self._fd2 = fd.FaceDetection(model_selection=1 - model_selection, min_detection_confidence=min_score) if second else None
        self.tiles = tiles
        names = ("short-range", "full-range")
        self.name = f"mediapipe-face-detection@{mp.__version__}/{names[model_selection]}" + (f"/tiles{tiles}" if tiles > 1 else "")
        if second:
            self.name += f"+{names[1 - model_selection]}"

    def detect(self, rgb: np.ndarray, tiled: bool = True, fine: bool = True) -> list[tuple[float, float, float, float, float]]:
        """Detections of the whole frame; with ``tiled`` also of the tiles and, with ``fine``,
        of the second model's finer grid."""
        h, w = rgb.shape[:2]
        out = []
        for region in tile_regions(w, h, self.tiles if tiled else 1):
            out += _run(self._fd, rgb, region)
        if tiled and fine and self._fd2 is not None and self.tiles > 1:
            for region in tile_regions(w, h, SECOND_TILES)[1:]:
                out += _run(self._fd2, rgb, region)
        return out

    def detect_near(self, rgb: np.ndarray, boxes: Sequence[Sequence[float]],
                    both: bool = False) -> list[tuple[float, float, float, float, float]]:
        """Faces in a square crop of twice the side of each box (a tracked face's predicted,
        padded box), by the second model (the first where there is none; ``both``: by both)."""
        h, w = rgb.shape[:2]
        out = []
        for b in boxes:
            side = 2 * max(b[2] - b[0], b[3] - b[1])
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
class _Carry:
    """Detections of the last frames of the previous table (oldest first)."""

    stream: str | None
    last_order: int | None
    shape: tuple[int, int]
    boxes: list[list[BoxT]] = field(default_factory=list)


class FaceBlurOperator(TableOperator[FaceBlurConfig]):
    """Detect faces and blur+permute them; adds ``face_boxes`` and a ``deid`` header.

    Input: a ``frame`` column of fixed_shape_tensor uint8 [H, W, 3] (RGB) plus any other
    columns (``event_id``, ``t_ns`` ...), which pass through unchanged. Output: the same
    columns with ``frame`` replaced by anonymised frames in a new buffer, ``face_boxes``
    (the boxes anonymised in that frame, padded, pixels, with detector scores) and
    ``deid``. A frame whose detection fails raises ComplianceError: it is never emitted raw.
    """

    kind = "face_blur"
    version = "0.4.0"
    config_model = FaceBlurConfig

    def __init__(self, config: FaceBlurConfig | None = None) -> None:
        super().__init__(config)
        self._detector: Any = None
        self._secret: bytes = b""
        self._carry: _Carry | None = None
        self._tracks: FaceTracks | None = None
        self._tracks_key: tuple | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.config
        self._secret = cfg.secret if cfg.secret is not None else os.urandom(32)
        if cfg.face.action != "keep" and self._detector is None:
            self._detector = _MediapipeDetector(cfg.model_selection, cfg.face.min_score, cfg.face.tiles,
                                                cfg.face.second_pass)
        self._ready = True

    def reset(self) -> None:
        """Forget the carried detections and the face tracks (call between unrelated streams)."""
        self._carry = None
        self._tracks = self._tracks_key = None

    @property
    def detector_name(self) -> str:
        if self.config.face.action == "keep":
            return "none"
        return getattr(self._detector, "name", "mediapipe-face-detection")

    def output_schema(self, input_schema: pa.Schema) -> pa.Schema:
        return region_schema(input_schema, FACE_BOXES, DEID)

    # -- processing ----------------------------------------------------------------------
    def process(self, table: pa.Table) -> pa.Table:
        self.ensure_setup()
        frames = frame_array(table)
        n = len(frames)
        pol = self.config.face
        ids = event_ids(table)
        if pol.action == "keep" or n == 0:
            applied: list[list[BoxT]] = [[] for _ in range(n)]
            return self._assemble(table, frames, applied, method=pol.action)

        h, w = frames.type.shape[0], frames.type.shape[1]
        imgs, valid = tensor_view(frames)
        tiled = _tiled_rows(table, n, pol.tile_every)
        fine = _fine_rows(tiled)
        if pol.track_hold_s > 0:
            applied = self._detect_tracked(table, imgs, valid, tiled, fine, (h, w))
        else:
            detected = [self._detect(table, imgs[i], i, tiled[i], fine[i]) if valid[i] else [] for i in range(n)]
            applied = self._spread(table, detected, (h, w))
        out = imgs.copy()  # new buffer: the input's (read-only) buffer is never written
        for i in range(n):
            for b in applied[i]:
                if pol.action == "mask":
                    mask_region(out[i], b)
                else:
                    anonymise_region(out[i], b, self._secret, ids[i], pol.blur_sigma_ratio)
        return self._assemble(table, frames_like(frames, out, valid), applied, method=pol.action)

    def _spread(self, table: pa.Table, detected: list[list[BoxT]], shape: tuple[int, int]) -> list[list[BoxT]]:
        """Boxes to anonymise per frame: own detections, neighbours' within the window, carry."""
        n, win = len(detected), self.config.face.temporal_window
        pools: list[list[BoxT]] = [list(d) for d in detected]
        for i, boxes in enumerate(detected):
            if not boxes:
                continue
            for j in range(max(0, i - win), min(n, i + win + 1)):
                if j != i:
                    pools[j].extend(boxes)
        stream, first_order, last_order = _stream_key(table)
        carry = self._carry
        carry_ok = (
            carry is not None
            and carry.stream == stream
            and carry.shape == shape
            and (carry.last_order is None or first_order is None or first_order > carry.last_order)
        )
        if carry_ok:
            m = len(carry.boxes)
            for k, boxes in enumerate(carry.boxes):  # carried frame k sits at relative index k - m
                for j in range(0, min(n, win - (m - k) + 1)):
                    pools[j].extend(boxes)
        if win > 0:
            tail = detected[-win:]
            if len(tail) < win and carry_ok:
                tail = (carry.boxes + tail)[-win:]
            self._carry = _Carry(stream=stream, last_order=last_order, shape=shape, boxes=[list(b) for b in tail])
        else:
            self._carry = None
        return [_merge(p) for p in pools]

    def _detect(self, table: pa.Table, img: np.ndarray, i: int, tiled: bool, fine: bool,
                near: list[BoxT] | None = None) -> list[BoxT]:
        """Padded detections in frame ``i``; with ``near``, only the second look around those boxes."""
        pol = self.config.face
        try:
            if near is None:
                raw = self._detector.detect(img, tiled=tiled, fine=fine)
            else:
                raw = self._detector.detect_near(img, near)
        except Exception:
            raise self._detection_failed(table, i) from None
        return _dedupe(_pad_clip(raw, pol.pad_ratio, img.shape[1], img.shape[0], pol.min_score))

    def _detection_failed(self, table: pa.Table, i: int) -> ComplianceError:
        return ComplianceError(
            f"face detection failed on event {event_ids(table)[i]}; the frame is withheld, not written raw",
            source_uri=first_str(table, "source_uri"),
            stage=self.kind,
        )

    def _verified(self, table: pa.Table, img: np.ndarray, i: int, box: BoxT) -> BoxT | None:
        """``box`` if both models, on an upscaled crop around it, find a face there scoring at
        least ``VERIFY_SCORE`` (then with that score), else None."""
        try:
            found = self._detector.detect_near(img, [box], both=True)
        except Exception:
            raise self._detection_failed(table, i) from None
        best = max((f[4] for f in found if overlap(f, box) > 0.3), default=0.0)
        return box[:4] + (best,) if best >= VERIFY_SCORE else None

    def _detect_tracked(self, table: pa.Table, imgs: np.ndarray, valid: np.ndarray, tiled: list[bool],
                        fine: list[bool], shape: tuple[int, int]) -> list[list[BoxT]]:
        """Boxes per frame from detections and face tracks (``face_tracks``): each face gets one
        box that follows it through missed detections, within and across tables of a stream."""
        h, w = shape
        key = (_stream_key(table)[0], shape)
        if self._tracks is None or self._tracks_key != key:
            self._tracks, self._tracks_key = FaceTracks(w, h, self.config.face.track_hold_s), key
        self._carry = None
        times = _frame_times(table)
        second = hasattr(self._detector, "detect_near")
        seen = []
        for i in range(len(imgs)):
            if not valid[i]:
                seen.append([])
                continue
            boxes = self._detect(table, imgs[i], i, tiled[i], fine[i])
            missed = self._tracks.missed(times[i], boxes) if second and tiled[i] else []
            if missed:  # a tracked face a full scan lost: look again, closer (between scans, tracks interpolate)
                boxes = _dedupe(boxes + self._detect(table, imgs[i], i, tiled[i], fine[i], near=missed))
            if second:  # a weak detection that starts no track must be seen again up close (hands, textures)
                boxes = [b if b[4] >= CONFIRM_SCORE or self._tracks.continues(times[i], b)
                         else self._verified(table, imgs[i], i, b) for b in boxes]
                boxes = [b for b in boxes if b is not None]
            seen.append(self._tracks.update(times[i], boxes, confident=tiled[i]))
        pol = self.config.face
        return [_dedupe(b) for b in interpolate(seen, times, w, h, pol.temporal_window, pol.track_hold_s)]

    def _assemble(self, table: pa.Table, frames: pa.Array, applied: list[list[BoxT]], method: str) -> pa.Table:
        header = {"policy": self.config.policy_tag, "method": method, "detector": self.detector_name,
                  "threshold": self.config.face.min_score}
        return with_regions(table, frames, applied, header, FACE_BOXES, DEID)


# -- helpers ---------------------------------------------------------------------------------
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
        mask=None if frames.null_count == 0 else pa.array(~valid),
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


def _fine_rows(tiled: list[bool]) -> list[bool]:
    """Rows that also get the second model's finer grid: every other tiled row of a run of
    tiled rows two apart (a dense stream), every tiled row otherwise, and the last row."""
    out = []
    for i, t in enumerate(tiled):
        dense = i >= 2 and tiled[i - 2] and not tiled[i - 1]
        out.append(t and (i == len(tiled) - 1 or not dense or not out[i - 2]))
    return out


def _tiled_rows(table: pa.Table, n: int, every: int) -> list[bool]:
    """Rows that get the tiled detection pass (see ``FacePolicy.tile_every``).

    With ``every == 2`` an odd row is skipped only when both neighbours are in this table
    and within ``DENSE_GAP_NS`` of it, so the window spreads their small-face boxes onto it;
    sparse (sampled) frames and the last row of a table are always tiled. Depends on the
    table alone: re-processing a table gives the same output.
    """
    if every <= 1 or n == 0:
        return [True] * n
    t = table.column("t_ns").to_numpy() if "t_ns" in table.column_names else None
    out = []
    for i in range(n):
        if i % every == 0 or i == n - 1:
            out.append(True)
        elif t is None:
            out.append(False)
        else:
            out.append(int(t[i]) - int(t[i - 1]) > DENSE_GAP_NS or int(t[i + 1]) - int(t[i]) > DENSE_GAP_NS)
    return out


def _stream_key(table: pa.Table) -> tuple[str | None, int | None, int | None]:
    """(stream id from the event_id prefix, first and last t_ns or frame_index)."""
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


def _frame_times(table: pa.Table, frame_ns: int = 40_000_000) -> list[int]:
    """Time of each row: ``t_ns``, else ``frame_index`` (or the row) at 25 fps."""
    for name, scale in (("t_ns", 1), ("frame_index", frame_ns)):
        if name in table.column_names and table.column(name).null_count == 0:
            return [int(v) * scale for v in table.column(name).to_pylist()]
    return [i * frame_ns for i in range(table.num_rows)]


def _pad_clip(raw: list[tuple[float, float, float, float, float]], pad: float, w: int, h: int, min_score: float) -> list[BoxT]:
    out = []
    for x0, y0, x1, y1, s in raw:
        if s < min_score:
            continue
        pw, ph = pad * (x1 - x0), pad * (y1 - y0)
        bx0 = max(0, int(math.floor(x0 - pw)))
        by0 = max(0, int(math.floor(y0 - ph)))
        bx1 = min(w, int(math.ceil(x1 + pw)))
        by1 = min(h, int(math.ceil(y1 + ph)))
        if bx1 > bx0 and by1 > by0:
            out.append((bx0, by0, bx1, by1, float(s)))
    return out


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
