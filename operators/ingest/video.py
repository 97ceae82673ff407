"""Video ingest: decode a video source into RGB frame tables on the session clock.

First stage of the video path (source -> frames -> face de-identification -> embed).
Each frame's time is its container PTS (``pts * time_base``, exact rational arithmetic)
mapped through the source's ``SessionClock``: variable frame rate is handled because
time never comes from ``index / fps``. Frames stream out in tables of at most
``batch_frames`` rows and ``batch_bytes`` of pixels, so memory stays bounded by one batch
however long the video.

Sampling: every frame (``sample_fps=None``), the first frame at or after each
``1/sample_fps`` step, or keyframes only (``keyframes_only``: non-key packets are never
decoded; combines with ``sample_fps``). Frames are shown as a player would: the display
matrix (or a legacy ``rotate`` tag) is applied, so a portrait phone clip comes out
portrait with ``width``/``height`` swapped. ``max_side`` downscales on decode (aspect
kept, area interpolation) so the full-size RGB frame is never materialised.

Damage: packets are decoded one by one; after a packet the decoder rejects (or a frame it
marks corrupt) frames are dropped until the next keyframe (frames predicted from a broken
reference decode "fine" but show garbage), so a corrupt middle costs only its own stretch
(``corrupt_frames``, one range from the last good frame to the next), not the rest of the
file. The range is conservative: the decoder reports an error up to its threading delay
late, so it may include a few good frames on either side.

Ranges: ``plan_ranges`` reads a video's packet index (demux only, nothing decoded) and cuts
it at the first keyframe after every ``range_s`` into ``VideoRange`` s, so that several
workers can decode one long video at once. A range decodes from a keyframe ``overlap_s``
before its first frame to ``overlap_s`` past its last, so the de-identification that follows
sees each border with context on both sides (face tracks, text on screen), and a worker keeps
only its own frames (``VideoRange.owns``). Frame indices (and event ids) come from the
packet index, as a decode from the start would count them. The cut points depend on the
file and the config only, never on how many workers there are: any number of workers gives
the same output.

Quality: each frame's ``quality`` (``schemas.tables.VideoQuality``: brightness, contrast, sharpness,
the decoded pixel format's channels) is measured here, on the decoded frame before any
de-identification (``modalign.operators.quality.video``): the properties of the camera signal, as
scalars.

Tables hold raw pixels: they must not leave the ingest process before ``modalign.operators.deid``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from modalign.operators.align.clock import pts_to_ns
from modalign.operators.dependencies import require
from modalign.operators.ingest._av import (TRUNCATION_TOLERANCE_NS, check_truncated, declared_span_ns,  # noqa: F401
                                  open_container, partial_error)  # re-exported: the shared helpers' old home
from modalign.operators.ingest.base import SourceContext, SourceOperator, event_id
from modalign.operators.quality.video import frame_quality, pixel_channels
from modalign.schemas.arrow import arrow_type
from modalign.schemas.errors import LimitExceededError, UnreadableInputError, UnsupportedInputError
from modalign.schemas.config import VideoIngestConfig
from modalign.schemas.tables import VideoQuality
from modalign.schemas.units import NS_PER_S

if TYPE_CHECKING:  # pragma: no cover
    import av

FRAME_DIMS = ["height", "width", "channel"]
# More consecutive rejected packets than this: the stream is garbage, stop decoding it.
MAX_CONSECUTIVE_ERRORS = 500


# The operator's config is the run config's section: one declaration of every field.
VideoFramesConfig = VideoIngestConfig


def frame_type(height: int = 0, width: int = 0) -> pa.DataType:
    """Tensor type of the ``frame`` column; 0 in a dimension means "fixed per table"."""
    return pa.fixed_shape_tensor(pa.uint8(), [height, width, 3], dim_names=FRAME_DIMS)


def video_frames_schema(height: int = 0, width: int = 0) -> pa.Schema:
    """Schema of a frame table. Every table has one frame shape ``[H, W, 3]`` (RGB uint8);
    a mid-stream resolution (or rotation) change starts a new table. ``height=width=0`` is
    the generic schema: same names and types, with the shape left open."""
    return pa.schema([
        pa.field("event_id", pa.string(), nullable=False),
        pa.field("t_ns", pa.int64(), nullable=False, metadata={"doc": "session-clock ns from the frame PTS"}),
        pa.field("pts", pa.int64(), nullable=False, metadata={"doc": "presentation timestamp, stream time base"}),
        pa.field("time_base", pa.string(), nullable=False, metadata={"doc": "stream time base 'num/den'"}),
        pa.field("frame_index", pa.int32(), nullable=False,
                 metadata={"doc": "index among decoded frames (among keyframes when keyframes_only)"}),
        pa.field("width", pa.int32(), nullable=False, metadata={"doc": "as displayed: after rotation and resize"}),
        pa.field("height", pa.int32(), nullable=False),
        pa.field("frame", frame_type(height, width), nullable=False, metadata={"doc": "RGB uint8 [H, W, 3]"}),
        pa.field("quality", arrow_type(VideoQuality), nullable=False,
                 metadata={"doc": "properties of the decoded frame (operators.quality.video)"}),
    ], metadata={"table": "video_frames", "doc": "decoded video frames (raw pixels, pre-deid)"})


def frames_to_numpy(table: pa.Table) -> np.ndarray:
    """``(N, H, W, 3)`` uint8 view of the ``frame`` column: zero-copy for a single-chunk
    column (as ``read`` yields), one copy otherwise. The view is read-only."""
    col = table.column("frame")
    if col.num_chunks == 1:
        return col.chunk(0).to_numpy_ndarray()
    return pa.concat_arrays(col.chunks).to_numpy_ndarray()


def iter_frames(table: pa.Table) -> Iterator[np.ndarray]:
    """Each ``(H, W, 3)`` uint8 frame of the ``frame`` column, a read-only view into its chunk:
    no copy, however many chunks the column has (``frames_to_numpy`` copies a chunked one)."""
    for chunk in table.column("frame").chunks:
        yield from chunk.to_numpy_ndarray()


def quarter_turns(frame: Any, stream: Any) -> int:
    """Counter-clockwise quarter turns (``np.rot90``'s ``k``) that show ``frame`` upright.

    ``frame.rotation`` is FFmpeg's display-matrix angle (counter-clockwise degrees; -90 is
    a phone's portrait clip); a legacy ``rotate`` tag is clockwise degrees."""
    deg = int(getattr(frame, "rotation", 0) or 0)
    if deg == 0:
        try:
            deg = -int(float(stream.metadata.get("rotate", 0)))
        except (TypeError, ValueError):
            deg = 0
    return round(deg / 90) % 4


def scaled_size(width: int, height: int, max_side: int | None) -> tuple[int, int]:
    """(w, h) with the longer side at most ``max_side``, aspect kept (never upscaled)."""
    if max_side is None or max(width, height) <= max_side:
        return width, height
    s = max_side / max(width, height)
    return max(1, round(width * s)), max(1, round(height * s))


class _Batch:
    """Rows of one frame table being filled (one frame shape per table).

    The pixel buffer holds at most ``max_bytes`` (16 MB: 6 frames of 720p): below glibc's
    32 MB mmap threshold, so a freed batch's memory is reused for the next one instead of
    being mapped and page-faulted in afresh (that cost 30 % of decode time at 32 frames)."""

    def __init__(self, ctx: SourceContext, max_frames: int, max_bytes: int):
        self.ctx, self.max_frames, self.max_bytes = ctx, max_frames, max_bytes
        self.capacity = max_frames
        self.buf: np.ndarray | None = None
        self.rows: dict[str, list] = {k: [] for k in ("pts", "tb", "t", "idx", "quality")}
        self.n = 0

    def fits(self, shape: tuple[int, ...]) -> bool:
        return self.buf is None or self.buf.shape[1:] == shape

    def add(self, rgb: np.ndarray, pts: int, tb: Fraction, t: int, idx: int, fmt: Any = None) -> None:
        """One decoded frame; ``fmt``: its PyAV ``VideoFormat`` as decoded (its channels are recorded)."""
        if self.buf is None:
            self.capacity = max(1, min(self.max_frames, self.max_bytes // rgb.nbytes))
            self.buf = np.empty((self.capacity, *rgb.shape), dtype=np.uint8)
        self.buf[self.n] = rgb  # the one copy: decoder (or rotated view) -> batch tensor
        brightness, contrast, sharp = frame_quality(self.buf[self.n])  # before any de-identification
        self.rows["quality"].append({"brightness_mean": brightness, "contrast": contrast, "sharpness": sharp,
                                     "channels": 3 if fmt is None else pixel_channels(fmt),
                                     "pixel_format": "rgb24" if fmt is None else str(fmt.name)})
        self.n += 1
        self.rows["pts"].append(pts)
        self.rows["tb"].append(f"{tb.numerator}/{tb.denominator}")
        self.rows["t"].append(t)
        self.rows["idx"].append(idx)

    def full(self) -> bool:
        return self.n == self.capacity

    def flush(self) -> pa.Table:
        sid, src, n = self.ctx.session_id, self.ctx.spec.id, self.n
        hh, ww = self.buf.shape[1:3]
        table = pa.table({
            "event_id": [event_id(sid, src, "frame", i) for i in self.rows["idx"]],
            "t_ns": pa.array(self.rows["t"], pa.int64()),
            "pts": pa.array(self.rows["pts"], pa.int64()),
            "time_base": self.rows["tb"],
            "frame_index": pa.array(self.rows["idx"], pa.int32()),
            "width": pa.array([ww] * n, pa.int32()),
            "height": pa.array([hh] * n, pa.int32()),
            "frame": pa.FixedShapeTensorArray.from_numpy_ndarray(self.buf[:n], dim_names=FRAME_DIMS),
            "quality": pa.array(self.rows["quality"], arrow_type(VideoQuality)),
        }, schema=video_frames_schema(hh, ww))
        for v in self.rows.values():
            v.clear()
        self.buf, self.n = None, 0
        return table


@dataclass(frozen=True)
class VideoRange:
    """One keyframe-aligned stretch of a video, for one worker (``plan_ranges``).

    It owns the frames with ``start_pts <= pts < end_pts`` (None: open) and decodes from the
    keyframe ``decode_from_pts`` to ``decode_to_pts``, the overlap on either side; ``pts``
    holds the presentation times of the packets it decodes, in order, and ``first_index``
    the frame index of the first of them, so indices match a decode from the start."""

    index: int
    count: int
    start_pts: int | None
    end_pts: int | None
    decode_from_pts: int | None
    decode_to_pts: int | None
    first_index: int
    pts: tuple[int, ...]
    before_pts: int | None  # the frame before decode_from_pts: where frame sampling stands there
    origin_pts: int  # the stream's first frame: the origin of frame sampling
    time_base: tuple[int, int]
    sha256: str | None = None  # of the whole file: a range cannot hash it on the way

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def owns(self, pts: np.ndarray) -> np.ndarray:
        """Mask of the frames (by PTS) this range outputs."""
        keep = np.ones(len(pts), dtype=bool)
        if self.start_pts is not None:
            keep &= pts >= self.start_pts
        if self.end_pts is not None:
            keep &= pts < self.end_pts
        return keep

    def local_ns(self, pts: int) -> int:
        return pts_to_ns(pts, Fraction(*self.time_base))

    @property
    def end_local_ns(self) -> int | None:
        """Where this range's output ends (local ns): the next range's first frame (None: the last)."""
        return None if self.end_pts is None else self.local_ns(self.end_pts)

    def rows_owned(self, table: pa.Table) -> np.ndarray:
        """Mask of the decoded rows (``pts`` column) this range outputs: not its overlap."""
        return self.owns(table.column("pts").to_numpy())

    @property
    def seconds(self) -> float:
        """About how much of the video this range outputs (from its first owned frame to the next
        range's first, or to its last packet), for progress displays."""
        owned = [p for p in self.pts if (self.start_pts is None or p >= self.start_pts)
                 and (self.end_pts is None or p < self.end_pts)]
        if not owned:
            return 0.0
        end = self.end_pts if self.end_pts is not None else max(owned)
        return max(0.0, (self.local_ns(end) - self.local_ns(min(owned))) / 1e9)

    def index_of(self, pts: int) -> int:
        """The frame index of the frame at ``pts`` (as counted by a decode from the start)."""
        return self.first_index + int(np.searchsorted(np.asarray(self.pts, dtype=np.int64), pts))


def plan_ranges(container: Any, range_s: float, overlap_s: float) -> list[VideoRange]:
    """Cut the first video stream of ``container`` into ranges of about ``range_s`` at keyframes,
    from its packet index (demuxed, never decoded); [] when it makes one range (short, one
    keyframe, no timestamps) or the packets are not what a range decode can count on (missing
    or repeated PTS), so the source is decoded whole."""
    stream = container.streams.video[0]
    tb = stream.time_base
    pts: list[int] = []
    keys: list[int] = []
    for packet in container.demux(stream):
        if not packet.size:  # the demuxer's flush packet
            continue
        if packet.pts is None:
            return []
        pts.append(packet.pts)
        if packet.is_keyframe:
            keys.append(packet.pts)
    if tb is None or len(keys) < 2:
        return []
    order = np.sort(np.asarray(pts, dtype=np.int64))
    if len(order) > 1 and not (np.diff(order) > 0).all():
        return []
    keyframes = np.sort(np.asarray(keys, dtype=np.int64))
    span = int(round(range_s / tb))
    overlap = int(round(overlap_s / tb))
    borders: list[int] = []
    target = int(order[0]) + span
    while True:  # the first keyframe at or after each multiple of range_s
        i = int(np.searchsorted(keyframes, target))
        if i >= len(keyframes):
            break
        if not borders or keyframes[i] > borders[-1]:
            borders.append(int(keyframes[i]))
        target = max(target + span, borders[-1] + 1)
    if not borders:
        return []
    starts, ends = [None, *borders], [*borders, None]
    ranges = []
    for k, (start, end) in enumerate(zip(starts, ends)):
        if start is None:
            lo = 0
        else:  # the last keyframe at least `overlap` before the range's first frame
            lo = int(np.searchsorted(order, keyframes[max(0, int(np.searchsorted(keyframes, start - overlap,
                                                                                   side="right")) - 1)]))
        hi = len(order) if end is None else int(np.searchsorted(order, end + overlap, side="right"))
        ranges.append(VideoRange(
            index=k, count=len(starts), start_pts=start, end_pts=end,
            decode_from_pts=None if start is None else int(order[lo]),
            decode_to_pts=None if end is None else int(order[hi - 1]),
            first_index=lo, pts=tuple(int(p) for p in order[lo:hi]),
            before_pts=None if lo == 0 else int(order[lo - 1]), origin_pts=int(order[0]),
            time_base=(tb.numerator, tb.denominator)))
    return ranges


class VideoFramesOperator(SourceOperator[VideoFramesConfig]):
    """Decodes a video source with PyAV into upright RGB frame tables, PTS-timed."""

    kind = "video_frames"
    version = "0.3.0"  # 0.3.0: the quality column
    modality = "video"
    config_model = VideoFramesConfig

    def output_schema(self) -> pa.Schema:
        """Generic schema; the ``frame`` shape is ``[H, W, 3]`` of each table's frames."""
        return video_frames_schema()

    def setup(self) -> None:
        require("av")  # fail here, not mid-stream, when PyAV is absent
        self._ready = True

    def read(self, ctx: SourceContext) -> Iterator[pa.Table]:
        self.ensure_setup()
        container = open_container(ctx.path, ctx.uri, stage=self.kind, reader=ctx.reader)
        with container:
            if not container.streams.video:
                raise UnsupportedInputError("no video stream; give this source modality 'audio' or drop it",
                                            source_uri=ctx.uri, stage=self.kind, code="no_video_stream")
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            if self.config.keyframes_only:
                stream.codec_context.skip_frame = "NONKEY"
            self._check_limits(ctx, container, stream)
            window = ctx.window
            if window is not None and window.decode_from_pts is not None:
                container.seek(window.decode_from_pts, stream=stream, backward=True, any_frame=False)
            yield from self._frames(ctx, container, stream, window)

    def _check_limits(self, ctx: SourceContext, container: "av.container.InputContainer", stream: Any) -> None:
        cfg = self.config
        w, h = int(stream.codec_context.width or 0), int(stream.codec_context.height or 0)
        if w * h > cfg.max_pixels:
            raise LimitExceededError(f"frames are {w}x{h}, over max_pixels={cfg.max_pixels}; downscale the source "
                                     "or raise the limit", source_uri=ctx.uri, stage=self.kind, code="pixels_exceeded")
        start, end = declared_span_ns(container, stream)
        if end is not None and end - start > cfg.max_duration_s * NS_PER_S:
            raise LimitExceededError(f"stream lasts {(end - start) / NS_PER_S:.0f} s, over max_duration_s="
                                     f"{cfg.max_duration_s:.0f}; split the source or raise the limit",
                                     source_uri=ctx.uri, stage=self.kind, code="duration_exceeded")

    def _decoded(self, container: Any, stream: Any, lost: list[int | None], demux: dict) -> Iterator[Any]:
        """Frames of ``stream``, decoding packet by packet. A rejected packet or a corrupt
        frame is skipped and its local ns (None: unknown) appended to ``lost``. ``demux`` gets
        ``packets`` (those that carried data) and ``failed`` (the demuxer raised: the rest unreachable)."""
        import av

        keyframes_only = self.config.keyframes_only
        errors = 0
        resync = False  # after a loss, frames are dropped until the next keyframe

        def when(pts: int | None, tb: Any) -> int | None:
            return None if pts is None or tb is None else pts_to_ns(pts, tb)

        try:
            for packet in container.demux(stream):
                demux["packets"] += packet.size > 0
                if keyframes_only and packet.size and not packet.is_keyframe:
                    continue
                try:
                    frames = stream.decode(packet)
                except av.error.FFmpegError:
                    lost.append(when(packet.pts, packet.time_base or stream.time_base))
                    resync = True
                    errors += 1
                    if errors > MAX_CONSECUTIVE_ERRORS:
                        return
                    continue
                errors = 0
                for frame in frames:
                    if resync and frame.key_frame:
                        resync = False
                    if resync or frame.is_corrupt:  # broken, or predicted from a broken reference
                        lost.append(when(frame.pts, frame.time_base or stream.time_base))
                        continue
                    yield frame
        except av.error.FFmpegError:  # the demuxer failed: nothing after this point is reachable
            demux["failed"] = True
            try:
                for frame in stream.decode(None):  # frames still inside the decoder come first
                    if not (resync or frame.is_corrupt):
                        yield frame
            except av.error.FFmpegError:
                pass
            lost.append(None)  # ... and everything after them is lost

    def _frames(self, ctx: SourceContext, container: Any, stream: Any,
                window: VideoRange | None = None) -> Iterator[pa.Table]:
        cfg, clock = self.config, ctx.clock
        max_local_ns = None  # set from the first frame: max_duration counts from there
        step = None if cfg.sample_fps is None else Fraction(NS_PER_S) / Fraction(cfg.sample_fps)
        origin_ns = next_ns = None
        if window is not None:  # counted from the stream's first frame, as a decode from the start would
            max_local_ns = window.local_ns(window.origin_pts) + int(cfg.max_duration_s * NS_PER_S)
            if step is not None:
                origin_ns = window.local_ns(window.origin_pts)
                before = window.before_pts
                # the first step after the frame before this range's first: where a whole decode stands
                next_ns = origin_ns if before is None else \
                    origin_ns + ((window.local_ns(before) - origin_ns) // step + 1) * step
        batch = _Batch(ctx, cfg.batch_frames, cfg.batch_bytes)
        lost: list[int | None] = []  # local ns of lost packets/frames, appended by _decoded
        pending: list[int | None] = []  # lost, not yet placed between two good frames
        n_lost = 0
        ranges: list[list[int | None]] = []  # [start, end] session ns of lost stretches; end None = open
        last_t = None  # session ns of the last good decoded frame
        index = -1
        demux = {"packets": 0, "failed": False}
        for frame in self._decoded(container, stream, lost, demux):
            index += 1
            if frame.pts is None:
                continue  # no presentation time: cannot be placed on the clock
            if window is not None:
                if window.decode_from_pts is not None and frame.pts < window.decode_from_pts:
                    continue  # a leading frame of the keyframe the seek landed on: the range before's
                if window.decode_to_pts is not None and frame.pts > window.decode_to_pts:
                    break  # past the overlap: the next range's
                index = window.index_of(frame.pts)
            tb = frame.time_base or stream.time_base
            local = pts_to_ns(frame.pts, tb)
            if max_local_ns is None:
                max_local_ns = local + int(cfg.max_duration_s * NS_PER_S)
            t = clock.to_session(local)
            if lost:  # take over what _decoded reported, keeping its list short
                n_lost += len(lost)
                pending += lost
                lost.clear()
            if pending:  # a loss before this frame (in presentation time): it lies after last_t
                before = [x for x in pending if x is None or x < local]
                if before:
                    pending = [x for x in pending if x is not None and x >= local]
                    ranges.append([(last_t + 1) if last_t is not None else None, t - 1])
            if local > max_local_ns:
                if batch.n:
                    yield batch.flush()
                raise LimitExceededError(f"decoded past max_duration_s={cfg.max_duration_s:.0f}; frames "
                                         "after it are dropped", source_uri=ctx.uri, stage=self.kind,
                                         code="duration_exceeded", start_t_ns=t)
            if frame.width * frame.height > cfg.max_pixels:
                if batch.n:
                    yield batch.flush()
                raise LimitExceededError(f"resolution changed to {frame.width}x{frame.height} mid-stream, over "
                                         f"max_pixels={cfg.max_pixels}", source_uri=ctx.uri, stage=self.kind,
                                         code="pixels_exceeded", start_t_ns=t)
            last_t = t
            if step is not None:
                if origin_ns is None:
                    origin_ns = next_ns = local
                if local < next_ns:
                    continue
                k = (local - origin_ns) // step + 1  # next step strictly after this frame
                next_ns = origin_ns + k * step
            w, h = scaled_size(frame.width, frame.height, cfg.max_side)
            if (w, h) == (frame.width, frame.height):
                rgb = frame.to_ndarray(format="rgb24")
            else:
                rgb = frame.to_ndarray(width=w, height=h, format="rgb24", interpolation="AREA")
            turns = quarter_turns(frame, stream)
            if turns:
                rgb = np.rot90(rgb, turns)  # a view; the batch copy makes it contiguous
            if not batch.fits(rgb.shape):
                yield batch.flush()
            batch.add(rgb, frame.pts, tb, t, index, frame.format)
            if batch.full():
                yield batch.flush()
        if batch.n:
            yield batch.flush()
        n_lost += len(lost)
        if pending or lost:  # lost frames after the last good one: open to the end
            ranges.append([(last_t + 1) if last_t is not None else None, None])
        if last_t is None:
            raise UnreadableInputError("no frame could be decoded; check that the file plays, re-encode it",
                                       source_uri=ctx.uri, stage=self.kind, code="unreadable")
        if ranges:
            if ranges[-1][1] is None and window is None and not demux["failed"] \
                    and 0 < demux["packets"] < (stream.frames or 0):
                # decoding failed up to the end, where the file ended (no demuxer error) before the
                # packets it declares: a cut file whose last packet is cut too (where the cut falls)
                check_truncated(ctx, self.kind, container, stream, last_t)
            raise self._damage_error(ctx, container, stream, ranges, n_lost)
        if window is None or window.last:  # only the last range reaches the end
            check_truncated(ctx, self.kind, container, stream, last_t)

    def _damage_error(self, ctx: SourceContext, container: Any, stream: Any, ranges: list[list[int | None]],
                      lost: int) -> UnreadableInputError:
        """One error spanning every lost stretch: ``corrupt_frames`` when decoding recovered
        after the last one, else ``decode_failed`` up to the declared end."""
        begin, end = declared_span_ns(container, stream)
        start = ranges[0][0] if ranges[0][0] is not None else ctx.clock.to_session(begin)
        stretches = f"{lost} packet(s)/frame(s) lost in {len(ranges)} stretch(es)"
        if ranges[-1][1] is None:
            return UnreadableInputError(
                f"decoding failed and did not recover ({stretches}); the frames before are ingested, the rest of "
                "the source is quarantined; re-encode it to recover", source_uri=ctx.uri, stage=self.kind,
                code="decode_failed", start_t_ns=start, end_t_ns=None if end is None else ctx.clock.to_session(end))
        return UnreadableInputError(
            f"{stretches} could not be decoded; the frames around them are ingested, the lost range is "
            "quarantined; re-encode the source to recover it", source_uri=ctx.uri, stage=self.kind,
            code="corrupt_frames", start_t_ns=start, end_t_ns=ranges[-1][1])
