"""Video ingest: decode a video source into RGB frame tables on the session clock.

First stage of the video path (source -> frames -> face de-identification -> embed).
Each frame's time is its container PTS (``pts * time_base``, exact rational arithmetic)
mapped through the source's ``SessionClock``: variable frame rate is handled because
time never comes from ``index / fps``. Frames stream out in tables of at most
``batch_frames`` rows, so memory stays bounded by one batch however long the video.

Tables hold raw pixels: they must not leave the ingest process before ``operators.deid``.
The PyAV helpers at the bottom (open, error mapping, declared span) are shared with the
audio operator.
"""

from __future__ import annotations

from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from operators.align.clock import NS_PER_S, pts_to_ns
from operators.base import OperatorConfig
from operators.ingest.base import SourceContext, SourceOperator, event_id
from pipeline.errors import LimitExceededError, UnreadableInputError, UnsupportedInputError

if TYPE_CHECKING:  # pragma: no cover
    import av

# A stream that declares a duration but stops decoding more than this early is truncated.
TRUNCATION_TOLERANCE_NS = NS_PER_S
FRAME_DIMS = ["height", "width", "channel"]


class VideoFramesConfig(OperatorConfig):
    """Sampling and limits; ``sample_fps=None`` keeps every decoded frame."""

    sample_fps: float | None = None
    max_pixels: int = 3840 * 2160
    max_duration_s: float = 4 * 3600
    batch_frames: int = 32


def frame_type(height: int = 0, width: int = 0) -> pa.DataType:
    """Tensor type of the ``frame`` column; 0 in a dimension means "fixed per table"."""
    return pa.fixed_shape_tensor(pa.uint8(), [height, width, 3], dim_names=FRAME_DIMS)


def video_frames_schema(height: int = 0, width: int = 0) -> pa.Schema:
    """Schema of a frame table. Every table has one frame shape ``[H, W, 3]`` (RGB uint8);
    a mid-stream resolution change starts a new table. ``height=width=0`` is the generic
    schema: same names and types, with the shape left open."""
    return pa.schema([
        pa.field("event_id", pa.string(), nullable=False),
        pa.field("t_ns", pa.int64(), nullable=False, metadata={"doc": "session-clock ns from the frame PTS"}),
        pa.field("pts", pa.int64(), nullable=False, metadata={"doc": "presentation timestamp, stream time base"}),
        pa.field("time_base", pa.string(), nullable=False, metadata={"doc": "stream time base 'num/den'"}),
        pa.field("frame_index", pa.int32(), nullable=False, metadata={"doc": "index among decoded frames"}),
        pa.field("width", pa.int32(), nullable=False),
        pa.field("height", pa.int32(), nullable=False),
        pa.field("frame", frame_type(height, width), nullable=False, metadata={"doc": "RGB uint8 [H, W, 3]"}),
    ], metadata={"table": "video_frames", "doc": "decoded video frames (raw pixels, pre-deid)"})


def frames_to_numpy(table: pa.Table) -> np.ndarray:
    """``(N, H, W, 3)`` uint8 view of the ``frame`` column: zero-copy for a single-chunk
    column (as ``read`` yields), one copy otherwise. The view is read-only."""
    col = table.column("frame")
    if col.num_chunks == 1:
        return col.chunk(0).to_numpy_ndarray()
    return pa.concat_arrays(col.chunks).to_numpy_ndarray()


class VideoFramesOperator(SourceOperator[VideoFramesConfig]):
    """Decodes a video source with PyAV into RGB frame tables, PTS-timed."""

    kind = "video_frames"
    version = "0.1.0"
    modality = "video"
    config_model = VideoFramesConfig

    def output_schema(self) -> pa.Schema:
        """Generic schema; the ``frame`` shape is ``[H, W, 3]`` of each table's frames."""
        return video_frames_schema()

    def setup(self) -> None:
        import av  # noqa: F401  (fail here, not mid-stream, when PyAV is absent)

        self._ready = True

    def read(self, ctx: SourceContext) -> Iterator[pa.Table]:
        self.ensure_setup()
        container = open_container(ctx.path, ctx.uri, stage=self.kind)
        with container:
            if not container.streams.video:
                raise UnsupportedInputError("no video stream; give this source modality 'audio' or drop it",
                                            source_uri=ctx.uri, stage=self.kind, code="no_video_stream")
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            self._check_limits(ctx, container, stream)
            yield from self._frames(ctx, container, stream)

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

    def _frames(self, ctx: SourceContext, container: Any, stream: Any) -> Iterator[pa.Table]:
        import av

        cfg, clock = self.config, ctx.clock
        sid, src = ctx.session_id, ctx.spec.id
        max_local_ns = None  # set from the first frame: max_duration counts from there
        step = None if cfg.sample_fps is None else Fraction(NS_PER_S) / Fraction(cfg.sample_fps)
        origin_ns = next_ns = None
        rows: dict[str, list] = {k: [] for k in ("pts", "tb", "t", "idx")}
        buf: np.ndarray | None = None
        n = 0
        last_t = None  # session ns of the last decoded frame

        def flush() -> pa.Table | None:
            nonlocal buf, n
            if n == 0:
                return None
            hh, ww = buf.shape[1:3]
            table = pa.table({
                "event_id": [event_id(sid, src, "frame", i) for i in rows["idx"]],
                "t_ns": pa.array(rows["t"], pa.int64()),
                "pts": pa.array(rows["pts"], pa.int64()),
                "time_base": rows["tb"],
                "frame_index": pa.array(rows["idx"], pa.int32()),
                "width": pa.array([ww] * n, pa.int32()),
                "height": pa.array([hh] * n, pa.int32()),
                "frame": pa.FixedShapeTensorArray.from_numpy_ndarray(buf[:n], dim_names=FRAME_DIMS),
            }, schema=video_frames_schema(hh, ww))
            for v in rows.values():
                v.clear()
            buf, n = None, 0
            return table

        index = -1
        try:
            for frame in container.decode(stream):
                index += 1
                if frame.pts is None:
                    continue  # no presentation time: cannot be placed on the clock
                tb = frame.time_base or stream.time_base
                local = pts_to_ns(frame.pts, tb)
                if max_local_ns is None:
                    max_local_ns = local + int(cfg.max_duration_s * NS_PER_S)
                t = clock.to_session(local)
                if local > max_local_ns:
                    if n:
                        yield flush()
                    raise LimitExceededError(f"decoded past max_duration_s={cfg.max_duration_s:.0f}; frames "
                                             "after it are dropped", source_uri=ctx.uri, stage=self.kind,
                                             code="duration_exceeded", start_t_ns=t)
                if frame.width * frame.height > cfg.max_pixels:
                    if n:
                        yield flush()
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
                rgb = frame.to_ndarray(format="rgb24")
                if buf is not None and buf.shape[1:3] != rgb.shape[:2]:
                    yield flush()
                if buf is None:
                    buf = np.empty((cfg.batch_frames, *rgb.shape), dtype=np.uint8)
                buf[n] = rgb
                n += 1
                rows["pts"].append(frame.pts)
                rows["tb"].append(f"{tb.numerator}/{tb.denominator}")
                rows["t"].append(t)
                rows["idx"].append(index)
                if n == cfg.batch_frames:
                    yield flush()
        except av.error.FFmpegError as e:
            if n:
                yield flush()
            raise partial_error(ctx, self.kind, container, stream, last_t, f"decoding failed ({type(e).__name__})")
        if n:
            yield flush()
        if last_t is None:
            raise UnreadableInputError("no frame could be decoded; check that the file plays, re-encode it",
                                       source_uri=ctx.uri, stage=self.kind)
        check_truncated(ctx, self.kind, container, stream, last_t)


# ---- PyAV helpers shared with operators.ingest.audio ---------------------------------


def open_container(path: Path, uri: str, stage: str) -> Any:
    """Open ``path`` with PyAV; missing, empty or unparsable files -> UnreadableInputError."""
    import av

    if not path.is_file():
        raise UnreadableInputError("file not found; check the manifest path", source_uri=uri, stage=stage,
                                   code="file_missing")
    if path.stat().st_size == 0:
        raise UnreadableInputError("file is empty; re-upload the source", source_uri=uri, stage=stage,
                                   code="file_empty")
    try:
        return av.open(str(path), mode="r")
    except (av.error.FFmpegError, OSError, ValueError) as e:
        raise UnreadableInputError(f"not a readable media file ({type(e).__name__}); check that it is complete "
                                   "and plays", source_uri=uri, stage=stage) from None


def declared_span_ns(container: Any, stream: Any) -> tuple[int, int | None]:
    """(start, end) local ns the container declares for ``stream``; end None when unknown.

    Uses the stream's own duration, else the container's when it has only this stream
    (a container duration also covers the other streams)."""
    tb = stream.time_base
    start = pts_to_ns(stream.start_time, tb) if stream.start_time is not None and tb else 0
    if stream.duration is not None and tb:
        return start, start + pts_to_ns(stream.duration, tb)
    if container.duration is not None and len(container.streams) == 1:
        return start, start + int(container.duration) * (NS_PER_S // 1_000_000)
    return start, None


def partial_error(ctx: SourceContext, stage: str, container: Any, stream: Any, last_t: int | None,
                  what: str) -> UnreadableInputError:
    """An error for the range after the last good unit (``last_t``, session ns) to the declared end."""
    _, end = declared_span_ns(container, stream)
    end_t = None if end is None else ctx.clock.to_session(end)
    if last_t is None:
        return UnreadableInputError(f"{what} before any output; re-encode the source",
                                    source_uri=ctx.uri, stage=stage)
    return UnreadableInputError(f"{what} after session t={last_t} ns; the rest of the source is quarantined, "
                                "re-encode it to recover", source_uri=ctx.uri, stage=stage, code="decode_failed",
                                start_t_ns=last_t + 1, end_t_ns=end_t)


def check_truncated(ctx: SourceContext, stage: str, container: Any, stream: Any, last_t: int) -> None:
    """Raise when decoding stopped well before the declared end (a truncated upload)."""
    _, end = declared_span_ns(container, stream)
    if end is not None and ctx.clock.to_session(end) - last_t > TRUNCATION_TOLERANCE_NS:
        raise partial_error(ctx, stage, container, stream, last_t, "stream ended before its declared duration")
