"""PyAV helpers shared by the video and audio ingest operators.

Both operators open a container here, so every hostile input (missing, empty, not media,
a document or a text file under a media extension, a header that promises more than the
file holds) is rejected the same way, with the same reason codes:

=================  ===========================  ==============================================
code               class                        when
=================  ===========================  ==============================================
file_missing       UnreadableInputError         the path is not a file
file_empty         UnreadableInputError         zero bytes
wrong_type         UnsupportedInputError        a PDF (or other document) under a media name
not_media          UnsupportedInputError        FFmpeg only reads it as text art (tty demuxer)
unreadable         UnreadableInputError         FFmpeg cannot parse it (garbage, no moov, ...)
decode_failed      UnreadableInputError         decoding failed after good output (a range)
corrupt_frames     UnreadableInputError         some packets failed, later ones decoded (range)
truncated          UnreadableInputError         ended before its declared duration (range)
=================  ===========================  ==============================================
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

from modalign.operators.align.clock import pts_to_ns
from modalign.operators.dependencies import require
from modalign.operators.ingest.base import SourceContext
from modalign.schemas.errors import UnreadableInputError, UnsupportedInputError
from modalign.schemas.units import NS_PER_S

# A stream that declares a duration but stops decoding more than this early is truncated.
TRUNCATION_TOLERANCE_NS = NS_PER_S
# FFmpeg demuxers that turn any text file into "video" (ANSI art renderers): never media.
TEXT_DEMUXERS = frozenset({"tty", "bin", "xbin", "adf", "idf"})
# Leading bytes of documents that FFmpeg may reject or misread; named in the message.
DOCUMENT_MAGIC = {b"%PDF-": "a PDF document", b"PK\x03\x04": "a ZIP archive (or office document)",
                  b"\xd0\xcf\x11\xe0": "an OLE office document", b"{\\rtf": "an RTF document"}


def _head(path: Path | None, reader: Any, n: int) -> bytes:
    """The first ``n`` bytes of the source: through ``reader`` (its position kept) or from ``path``."""
    if reader is not None:
        pos = reader.tell()
        try:
            reader.seek(0)
            return reader.read(n)
        finally:
            reader.seek(pos)
    with open(path, "rb") as f:  # type: ignore[arg-type]
        return f.read(n)


def sniff_document(path: Path | None, reader: Any = None) -> str | None:
    """What document the source is by its first bytes (None: not a known document type)."""
    head = _head(path, reader, 1024)
    for magic, what in DOCUMENT_MAGIC.items():
        if head.startswith(magic) or (magic == b"%PDF-" and magic in head):
            return what
    return None


def open_container(path: Path, uri: str, stage: str, reader: Any = None) -> Any:
    """Open ``path`` with PyAV (reading through ``reader`` when given, a seekable file object
    over the same file; ``path`` None: the reader is all there is, e.g. an object-store source);
    see the module docstring for the reason codes."""
    av = require("av")

    if path is not None and not path.is_file():
        raise UnreadableInputError("file not found; check the manifest path", source_uri=uri, stage=stage,
                                   code="file_missing")
    if (path.stat().st_size if path is not None else _size(reader)) == 0:
        raise UnreadableInputError("file is empty; re-upload the source", source_uri=uri, stage=stage,
                                   code="file_empty")
    document = sniff_document(path, reader)
    if document is not None:
        raise UnsupportedInputError(f"the file is {document}, not audio/video; fix its extension or manifest "
                                    "modality", source_uri=uri, stage=stage, code="wrong_type")
    try:
        container = av.open(reader if reader is not None else str(path), mode="r")
    except (av.error.FFmpegError, OSError, ValueError) as e:
        raise UnreadableInputError(f"not a readable media file ({type(e).__name__}); check that it is complete "
                                   "and plays", source_uri=uri, stage=stage, code="unreadable") from None
    if container.format.name in TEXT_DEMUXERS:
        container.close()
        raise UnsupportedInputError("a text file, not audio/video; remove it from the input", source_uri=uri,
                                    stage=stage, code="not_media")
    return container


def _size(reader: Any) -> int:
    pos = reader.tell()
    try:
        return reader.seek(0, 2)
    finally:
        reader.seek(pos)


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


def wav_declared_ns(path: Path | None, reader: Any = None) -> int | None:
    """Duration (ns) a RIFF/WAVE header declares for its data chunk, None when not a WAV or
    when the size is a streaming placeholder (0 or 0xFFFFFFFF). FFmpeg clamps a data size
    larger than the file to the file, so this is the only place a lying header shows."""
    try:
        head = _head(path, reader, 4096)
    except OSError:
        return None
    if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return None
    pos, byte_rate = 12, None
    while pos + 8 <= len(head):
        cid, size = head[pos:pos + 4], struct.unpack("<I", head[pos + 4:pos + 8])[0]
        if cid == b"fmt " and pos + 16 <= len(head):
            byte_rate = struct.unpack("<I", head[pos + 16:pos + 20])[0]
        elif cid == b"data":
            if size in (0, 0xFFFFFFFF) or not byte_rate:
                return None
            return size * NS_PER_S // byte_rate
        pos += 8 + size + (size & 1)
    return None


def partial_error(ctx: SourceContext, stage: str, container: Any, stream: Any, last_t: int | None,
                  what: str, code: str = "decode_failed", end_local_ns: int | None = None) -> UnreadableInputError:
    """An error for the range after the last good unit (``last_t``, session ns) to the declared
    end (``end_local_ns`` overrides the container's declared end)."""
    end = end_local_ns if end_local_ns is not None else declared_span_ns(container, stream)[1]
    end_t = None if end is None else ctx.clock.to_session(end)
    if last_t is None:
        return UnreadableInputError(f"{what} before any output; re-encode the source",
                                    source_uri=ctx.uri, stage=stage, code=code if code != "decode_failed" else
                                    "unreadable")
    return UnreadableInputError(f"{what} after session t={last_t} ns; the rest of the source is quarantined, "
                                "re-encode it to recover", source_uri=ctx.uri, stage=stage, code=code,
                                start_t_ns=last_t + 1, end_t_ns=end_t)


def check_truncated(ctx: SourceContext, stage: str, container: Any, stream: Any, last_t: int,
                    declared_end_ns: int | None = None) -> None:
    """Raise ``truncated`` when decoding stopped well before the declared end (a cut upload,
    or a header that promises more than the file holds)."""
    end = declared_span_ns(container, stream)[1]
    if declared_end_ns is not None:
        end = declared_end_ns if end is None else max(end, declared_end_ns)
    if end is not None and ctx.clock.to_session(end) - last_t > TRUNCATION_TOLERANCE_NS:
        raise partial_error(ctx, stage, container, stream, last_t, "stream ended before its declared duration",
                            code="truncated", end_local_ns=end)


def probe_stream(path: Path | Any, kind: str) -> tuple[bool, int | None]:
    """Whether the container at ``path`` (or in a seekable file object, which is closed after)
    has a ``kind`` stream (``audio | video``), and the local ns where its first one declares it
    ends (None: unknown). Reads the header only; (False, None) when it cannot be opened (the
    source operator then reports why)."""
    av = require("av")
    try:
        with av.open(str(path) if isinstance(path, (str, Path)) else path) as container:
            streams = getattr(container.streams, kind)
            return (True, declared_span_ns(container, streams[0])[1]) if streams else (False, None)
    except (av.error.FFmpegError, OSError):
        return False, None
