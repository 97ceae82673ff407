"""Row models of every table modalign writes; their Arrow schemas derive from these.

Each class is the single declaration of one table: pydantic validates rows built in
Python (CTAL rows, quarantine rows) and ``modalign.schemas.arrow.arrow_schema`` gives the Parquet
schema. Column names carry units (``t_ns``, ``residual_ns``); times are int64 ns on the
session clock. Every output row carries the lineage columns of ``LineageColumns``.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from modalign.schemas.arrow import Arrow, arrow_schema
from modalign.schemas.errors import QuarantineReason

F32List = Annotated[list[float], Arrow(pa.list_(pa.float32()))]
I32 = Annotated[int, Arrow(pa.int32())]
F32 = Annotated[float, Arrow(pa.float32())]


class _Row(BaseModel):
    model_config = ConfigDict(extra="forbid")
    TABLE: ClassVar[str] = ""
    PATH: ClassVar[str] = ""  # the table's own folder under OUT (one table per folder)

    @classmethod
    def schema(cls) -> pa.Schema:
        return arrow_schema(cls)


class LineageColumns(_Row):
    """Where a row came from; present on every output row."""

    session_id: str
    source_id: str
    source_uri: str
    source_version: str = Field(description="the source's version, known without reading it: "
                                            "'local:<bytes>:<mtime ns>' for a file, the ETag for an object")
    operators: str = Field(description="operator kind@version chain that produced the row, ';'-separated")
    policy: str = Field(description="de-identification policy id@version")
    model_id: str | None = Field(None, description="embedding model name@weights-hash, if any")


class Box(BaseModel):
    """A pixel box in the frame or page it belongs to."""

    x0: I32
    y0: I32
    x1: I32
    y1: I32
    score: F32 = 1.0


class DeidHeader(BaseModel):
    """What de-identification did to a segment."""

    policy: str
    method: str = Field(description="e.g. blur_permute, pseudonymise, waveform_dropped")
    detector: str = Field(description="detector name@version")
    count: I32 = Field(description="items removed in this segment")
    threshold: F32 = 0.0


class PiiCount(BaseModel):
    """How many personal-data items of one kind a text block held."""

    kind: str = Field(description="entity kind, e.g. person, email, iban")
    count: I32


class Word(BaseModel):
    """One OCR word; ``text`` is already de-identified (a pseudonym where ``entity`` is set)."""

    text: str
    x0: I32
    y0: I32
    x1: I32
    y1: I32
    conf: F32
    entity: str | None = None


class VideoFrameRow(LineageColumns):
    """A de-identified video frame (events/video)."""

    TABLE: ClassVar[str] = "events_video"
    PATH: ClassVar[str] = "events/video"
    event_id: str
    t_ns: int
    pts: int = Field(description="presentation timestamp in the stream's time base")
    time_base: str = Field(description="stream time base as 'num/den'")
    frame_index: I32
    width: I32
    height: I32
    frame_jpeg: bytes = Field(description="de-identified frame, JPEG")
    face_boxes: list[Box]
    deid: DeidHeader
    text_boxes: list[Box] | None = Field(None, description="regions of personal data shown as text, blurred")
    text_deid: DeidHeader | None = Field(None, description="what frame-text de-identification did")


class MfccRow(LineageColumns):
    """One MFCC frame (10 ms hop) of an audio source (events/audio); the waveform is never stored."""

    TABLE: ClassVar[str] = "events_audio"
    PATH: ClassVar[str] = "events/audio"
    event_id: str
    t_ns: int
    frame_index: int
    mfcc: F32List
    voiced: bool | None = Field(None, description="voice-activity flag of the frame (None: not computed)")
    deid: DeidHeader


class TextBlockRow(LineageColumns):
    """One OCR (or text-layer) block of a PDF page (events/pdf), personal data pseudonymised."""

    TABLE: ClassVar[str] = "events_pdf"
    PATH: ClassVar[str] = "events/pdf"
    event_id: str
    t_ns: int = Field(description="session time from which the page is shown")
    end_t_ns: int | None = Field(description="session time at which the next page replaces it (None: last page)")
    page_index: I32
    block_index: I32
    text: str
    words: list[Word]
    box: Box
    extraction: str = Field(description="ocr | text_layer")
    dpi: I32
    timing: str = Field(description="schedule | sequential")
    pii_counts: list[PiiCount] = Field(
        description="personal-data items detected in this block, one entry per kind found, sorted by kind"
    )
    deid: DeidHeader


class RecordRow(LineageColumns):
    """One tick x one source of the aligned timeline (records/)."""

    TABLE: ClassVar[str] = "records"
    PATH: ClassVar[str] = "records"
    tick_index: int
    t_ns: int
    modality: str
    event_id: str | None = Field(description="matched event, None for a gap")
    event_t_ns: int | None
    residual_ns: int | None = Field(description="event_t_ns - t_ns")
    decision: str = Field(description="matched | gap")


class CtalRow(_Row):
    """Cross-modal timestamp alignment log: one row per non-clean tick decision."""

    TABLE: ClassVar[str] = "ctal"
    PATH: ClassVar[str] = "ctal/log"
    event_id: str
    trace_id: str
    session_id: str
    stage: str
    tick_index: int
    aligned_t_ns: int
    modalities: list[str]
    observed_offsets_ns: list[int | None]
    decision: str = Field(description="gap | late | out_of_tolerance (drift) | interpolated")
    reason: str
    latency_ms: list[float] = Field(description="processing latency per modality, ms, same order as modalities")


class CtalSummaryRow(_Row):
    """Per-session, per-source alignment summary."""

    TABLE: ClassVar[str] = "ctal_summary"
    PATH: ClassVar[str] = "ctal/summary"
    session_id: str
    source_id: str
    modality: str
    ticks: int
    matched: int
    gaps: int
    late: int = Field(0, description="events that arrived after their ticks were decided (logged, not matched)")
    residual_p50_ms: float | None
    residual_p95_ms: float | None
    residual_max_ms: float | None
    offset_ns: int
    skew_ppm: float
    offset_method: str = Field(description="manifest | estimated")
    offset_confidence: float | None = Field(None, description="confidence of an estimated offset, 0..1")


class DriftAlarmRow(_Row):
    """Max pairwise residual above threshold for N consecutive ticks."""

    TABLE: ClassVar[str] = "drift_alarms"
    PATH: ClassVar[str] = "ctal/alarms"
    session_id: str
    start_tick: int
    end_tick: int
    start_t_ns: int
    end_t_ns: int
    max_residual_ms: float
    sources: list[str]


class FeatureRow(LineageColumns):
    """One embedding at one granularity (features/)."""

    TABLE: ClassVar[str] = "features"
    PATH: ClassVar[str] = "features"
    feature_id: int = Field(description="FAISS id of this row")
    cache_key: str
    granularity: str = Field(description="frame | roi | patch")
    modality: str
    event_id: str
    t_ns: int
    box: Box | None
    dim: I32
    vector: F32List


class QuarantineRow(_Row):
    """A rejected input or range: never its payload, only what and why."""

    TABLE: ClassVar[str] = "quarantine"
    PATH: ClassVar[str] = "quarantine"
    session_id: str
    source_id: str | None
    source_uri: str
    source_version: str | None
    stage: str
    reason_code: QuarantineReason
    message: str
    start_t_ns: int | None = None
    end_t_ns: int | None = None


class SourceLineageRow(_Row):
    """One ingested source and what was removed from it (lineage/sources)."""

    TABLE: ClassVar[str] = "lineage_sources"
    PATH: ClassVar[str] = "lineage/sources"
    run_id: str
    session_id: str
    source_id: str
    source_uri: str
    source_version: str
    modality: str
    status: str = Field(description="ingested | quarantined | partial | no_stream (a video without sound)")
    events: int
    operators: str
    policy: str
    deid: list[DeidHeader]
    subjects: list[str]
    clock_offset_ns: int = Field(0, description="session time of the source's local zero used for its events")
    clock_skew_ppm: float = 0.0
    clock_method: str = Field("manifest", description="manifest | estimated (against clock_reference)")
    clock_reference: str | None = Field(None, description="source the clock was estimated or verified against")
    track_of: str | None = Field(None, description="the video source whose own audio stream this source is")
    source_sha256: str | None = Field(None, description="'sha256:<hex>' of the source bytes, hashed as they were "
                                                        "read (None: the source was not read)")


class EmbeddingWindowRow(_Row):
    """One window of the embedding drift monitor: a session's vectors of one model and granularity
    in time order (monitor/embedding; ``operators.monitor.embedding_drift``)."""

    TABLE: ClassVar[str] = "monitor_windows"
    PATH: ClassVar[str] = "monitor/embedding"
    model_id: str
    granularity: str
    session_id: str
    window_index: I32 = Field(description="index in the (model, granularity) stream, over every session in order")
    start_t_ns: int
    end_t_ns: int
    vectors: I32
    mean_norm: float
    reference: bool = Field(description="part of the reference (no divergence, no alarm)")
    divergence: float | None = Field(None, description="mean KL of the window's histograms against the reference's")
    threshold: float | None = Field(None, description="mu + alpha * sigma of past divergences when it was scored")
    alpha: float | None = None
    drift_alarm: bool = False
    norm_alarm: bool = False


class MonitorAlarmRow(_Row):
    """A monitor's alarm (monitor/alarms): kind embedding_drift or norm_jump; runbooks/embedding-drift.md."""

    TABLE: ClassVar[str] = "monitor_alarms"
    PATH: ClassVar[str] = "monitor/alarms"
    kind: str
    model_id: str
    granularity: str
    session_id: str
    window_index: I32
    start_t_ns: int
    end_t_ns: int
    value: float = Field(description="the divergence (embedding_drift) or the window's mean norm (norm_jump)")
    threshold: float = Field(description="the divergence threshold, or the reference's mean norm")


ALL_TABLES: tuple[type[_Row], ...] = (
    VideoFrameRow, MfccRow, TextBlockRow, RecordRow, CtalRow, CtalSummaryRow,
    DriftAlarmRow, FeatureRow, QuarantineRow, SourceLineageRow, EmbeddingWindowRow, MonitorAlarmRow,
)
