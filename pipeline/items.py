"""What an ingest worker streams back to the driver: one small class per kind of item.

``pipeline.worker.IngestWorker.ingest`` yields these, ``pipeline.actors.IngestActor``
forwards them as Ray stream items, ``pipeline.runner`` routes each to where it goes. The
rows inside are the row models of ``schemas.tables``, validated where they are made.

Order for one source: ``ClockItem`` (only when its clock is estimated or verified), then
``SourceItem``, then a ``MetaItem`` per batch, each ``EmbedItem`` after the batches whose payload
it carries, any ``QuarantineItem``, and ``DoneItem`` last (or ``FaultItem`` when OUT failed, and
nothing after it). A video or an audio stream split into ranges (``SourceJob.range``) streams this
once per range, each from its own worker; the driver puts the ranges back together in time order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modalign.schemas.manifest import ClockMapping, SourceSpec
from modalign.schemas.tables import LineageColumns, QuarantineRow, SourceLineageRow

if TYPE_CHECKING:
    from modalign.operators.ingest.audio import AudioRange
    from modalign.operators.ingest.video import VideoRange
    from modalign.pipeline.discovery import ObjectPath


@dataclass(frozen=True)
class SourceJob:
    """What the driver hands a worker for one source (no payload: the worker reads the file,
    or the object: ``path`` is then an ``ObjectPath``, read with the run's storage config)."""

    run_id: str
    session_id: str
    spec: SourceSpec
    path: "Path | ObjectPath"
    uri: str
    version: str  # known without reading the source (local: size + mtime; object store: ETag + size)
    tenant: str = "default"
    subjects: tuple[str, ...] = ()  # the session's and the source's own (``Manifest.subjects_of``)
    reference: "tuple[Path | ObjectPath, ClockMapping] | None" = None  # (source, clock) to estimate/verify against
    roots: "tuple[Path | ObjectPath, ...]" = ()  # where the path may resolve; the worker checks again before it opens it
    size: int | None = None  # bytes, as the listing said (object storage)
    range: "VideoRange | AudioRange | None" = None  # one stretch of a source split across workers (None: all of it)


@dataclass(frozen=True)
class ClockItem:
    """The clock mapping the source is ingested with, and per-window observed offsets."""

    mapping: ClockMapping
    windows: list[tuple[int, int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class SourceItem:
    """The lineage columns every row of this source carries; sent before its events.

    ``end_ns``: where the recording ends on the session clock, as its container says (None:
    unknown, or a document). If the source is cut short (its worker dies), the aligner
    reports the time from its last event to here as gaps."""

    lineage: LineageColumns
    end_ns: int | None = None


@dataclass(frozen=True)
class MetaItem:
    """Event ids and session times of one batch, for the aligner, and the events file that holds
    the batch (relative to OUT), for the commit; ``seconds``: the worker's time to decode,
    de-identify and write it (the ingest latency metric)."""

    table: Any  # pa.Table
    path: str = ""
    seconds: float | None = None


@dataclass(frozen=True)
class EmbedItem:
    """De-identified payload of one or more batches for the embedder (one call, a file per granularity).

    Through Ray the table travels as the next stream item, not inside this one (a ref
    nested in an item hit ray #58080), so the driver forwards that ref unread; in-process
    ``table`` holds it."""

    modality: str
    rows: int
    table: Any = None  # pa.Table in-process; None when it is the next stream item


@dataclass(frozen=True)
class QuarantineItem:
    """A rejected source or range (never its payload)."""

    row: QuarantineRow


@dataclass(frozen=True)
class FaultItem:
    """The environment failed while this source was written (OUT read-only or full): the run
    must stop; the source is not bad input and is not quarantined."""

    message: str


@dataclass(frozen=True)
class DoneItem:
    """Last item: the source's lineage row and the de-identification counters it adds."""

    row: SourceLineageRow
    counts: dict[str, int] = field(default_factory=dict)


Item = ClockItem | SourceItem | MetaItem | EmbedItem | QuarantineItem | FaultItem | DoneItem
