"""Row models of every table modalign writes; their Arrow schemas derive from these.

Each class is the single declaration of one table: pydantic validates rows built in
Python (CTAL rows, quarantine rows) and ``modalign.schemas.arrow.arrow_schema`` gives the Parquet
schema. Column names carry units (``t_ns``, ``residual_ns``); times are int64 ns on the
session clock. Every output row carries the lineage columns of ``LineageColumns``.
"""

from __future__ import annotations

from dataclasses import dataclass
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


# -- modality quality properties (per record; ``operators.quality`` computes them) ---------------
# Scalar statistics of the signal as decoded, measured before de-identification: they describe
# the camera, microphone or scan, and none of them can hold personal data. Each field's ge/le is
# its physical range, which bounds the expectations of ``schemas.config.QualityConfig``.

class VideoQuality(BaseModel):
    """Properties of one decoded video frame (before de-identification); the resolution is the
    row's ``width``/``height``."""

    brightness_mean: F32 = Field(ge=0, le=255, description="mean BT.601 luma of the frame, 0-255")
    contrast: F32 = Field(ge=0, le=127.5, description="standard deviation of the luma, 0-255 scale")
    sharpness: F32 = Field(ge=0, le=1_040_400, description="variance of the 4-neighbour Laplacian of the luma, "
                                                           "downscaled to a longer side of at most 320 px")
    channels: I32 = Field(ge=1, le=8, description="channels of the decoded pixel format: 1 gray, 3 YUV/RGB, "
                                                  "4 with alpha; a palette is 3")
    pixel_format: str = Field(description="FFmpeg name of the decoded pixel format, e.g. yuv420p, gray")


class AudioQuality(BaseModel):
    """Properties of one MFCC frame's window (25 ms) of the 16 kHz mono signal, before voice
    anonymisation; the waveform itself is never stored."""

    loudness_dbfs: F32 = Field(ge=-120, le=10, description="RMS level of the window in dB relative to full "
                                                         "scale 1.0 (a full-scale square wave: 0; a full-scale "
                                                         "sine: -3.01; digital silence: -120)")
    clipping_ratio: F32 = Field(ge=0, le=1, description="fraction of the window's samples at or within 1 LSB "
                                                        "(16-bit) of full scale")
    snr_db: F32 = Field(ge=-130, le=130, description="speech-to-noise estimate: loudness over the source's "
                                                     "running noise floor (10th percentile of the last 10 s of "
                                                     "frame levels, this frame included)")


class TextQuality(BaseModel):
    """Properties of one text block."""

    ocr_confidence: F32 | None = Field(None, ge=0, le=100, description="mean tesseract confidence of the "
                                                                       "block's words, 0-100 (None: text layer)")


@dataclass(frozen=True)
class QualityProperty:
    """One numeric property of a modality's event rows that expectations and the shift check read."""

    modality: str
    name: str
    column: tuple[str, ...]  # ("quality", name) or a top-level column of the event row
    low: float  # physical range
    high: float
    description: str


def _quality_properties() -> dict[str, dict[str, QualityProperty]]:
    import annotated_types as at

    out: dict[str, dict[str, QualityProperty]] = {}
    for modality, model in (("video", VideoQuality), ("audio", AudioQuality), ("pdf", TextQuality)):
        props = out.setdefault(modality, {})
        for name, info in model.model_fields.items():
            lo = next((m.ge for m in info.metadata if isinstance(m, at.Ge)), None)
            hi = next((m.le for m in info.metadata if isinstance(m, at.Le)), None)
            if lo is not None and hi is not None:  # the numeric ones (pixel_format is a name)
                props[name] = QualityProperty(modality, name, ("quality", name), float(lo), float(hi),
                                              info.description or "")
    for side in ("width", "height"):  # the resolution is the frame row's own
        out["video"][side] = QualityProperty("video", side, (side,), 1.0, 16_384.0, f"frame {side} as displayed, px")
    return out


QUALITY_PROPERTIES: dict[str, dict[str, QualityProperty]] = _quality_properties()
"""modality -> property name -> where it is and its physical range: every property an expectation
or the shift check may name."""


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
    quality: VideoQuality | None = Field(None, description="properties of the decoded frame, measured before "
                                                           "de-identification (None: not measured)")


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
    quality: AudioQuality | None = Field(None, description="properties of the frame's window of the signal, "
                                                           "before voice anonymisation (None: not measured)")


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
    quality: TextQuality | None = Field(None, description="properties of the block's extraction "
                                                          "(None: not measured)")


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


class QualityShiftRow(_Row):
    """One modality property's distribution in the committed events against the reference output's
    (monitor/quality; ``operators.quality.shift``; runbooks/quality-shift.md): per session, and over
    every committed session when there are several. Statistics only."""

    TABLE: ClassVar[str] = "monitor_quality"
    PATH: ClassVar[str] = "monitor/quality"
    modality: str
    property: str
    session_id: str | None = Field(description="None: every committed session of the modality together")
    current_n: int = Field(description="records with a value")
    current_mean: float | None
    current_std: float | None
    current_p05: float | None
    current_p50: float | None
    current_p95: float | None
    reference: str | None = Field(description="the reference output (--reference OUT0); None: none, no alarm")
    reference_n: int | None
    reference_mean: float | None
    reference_std: float | None
    psi: float | None = Field(None, description="population stability index over the reference's quantile bins")
    shift_sigmas: float | None = Field(None, description="(current mean - reference mean) / max(reference std, "
                                                         "the property's sigma floor)")
    alarm: bool = False


class MonitorAlarmRow(_Row):
    """A monitor's alarm (monitor/alarms): kind embedding_drift or norm_jump (runbooks/embedding-drift.md),
    or quality_shift (runbooks/quality-shift.md)."""

    TABLE: ClassVar[str] = "monitor_alarms"
    PATH: ClassVar[str] = "monitor/alarms"
    kind: str
    model_id: str | None = Field(description="the embedding model (None: a quality alarm)")
    granularity: str | None
    session_id: str | None = Field(description="None: a quality alarm over every committed session")
    window_index: I32 | None = Field(description="the embedding window (None: a quality alarm)")
    start_t_ns: int | None
    end_t_ns: int | None
    value: float = Field(description="the divergence (embedding_drift), the window's mean norm (norm_jump) "
                                     "or the PSI (quality_shift)")
    threshold: float = Field(description="the divergence threshold, the reference's mean norm, or the PSI "
                                         "threshold")
    modality: str | None = Field(None, description="quality_shift: the modality")
    property: str | None = Field(None, description="quality_shift: the property")


ALL_TABLES: tuple[type[_Row], ...] = (
    VideoFrameRow, MfccRow, TextBlockRow, RecordRow, CtalRow, CtalSummaryRow,
    DriftAlarmRow, FeatureRow, QuarantineRow, SourceLineageRow, EmbeddingWindowRow, MonitorAlarmRow,
    QualityShiftRow,
)
