"""Run configuration: every knob of every stage, with the field's defaults.

Users write a YAML/JSON file with any subset of these fields (``modalign run --config``);
unknown keys are errors that name the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from modalign.schemas.manifest import Modality
from modalign.schemas.policy import DeidPolicy
from modalign.schemas.tables import QUALITY_PROPERTIES

DAY_S = 86_400
MAX_SIDE_PX = 16_384


class _Strict(BaseModel):
    # Every number has a physical bound, and no field takes inf or nan.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class VideoIngestConfig(_Strict):
    """Video decode: sampling, output size and limits; ``sample_fps=None`` keeps every frame."""

    sample_fps: float | None = Field(None, gt=0, le=1000, description="None: every decoded frame")
    keyframes_only: bool = Field(False, description="decode keyframes only (fast scene sampling)")
    max_side: int | None = Field(None, gt=0, le=MAX_SIDE_PX, description="downscale so the longer side is at most this (px)")
    max_pixels: int = Field(3840 * 2160, gt=0, le=MAX_SIDE_PX**2, description="decoded frames larger than this are rejected")
    max_duration_s: float = Field(4 * 3600, gt=0, le=7 * DAY_S)
    batch_frames: int = Field(32, gt=0, le=4096, description="frames per table, at most")
    batch_bytes: int = Field(16 * 2**20, gt=0, le=4 * 2**30, description="pixel bytes per table, at most (one frame minimum)")
    jpeg_quality: int = Field(90, ge=10, le=100, description="quality of stored de-identified frames")
    range_s: float | None = Field(
        30.0, ge=1, le=3600,
        description="a longer video is cut at the first keyframe after every range_s into ranges that ingest "
                    "actors decode at once (the cuts depend on the file only: any number of actors gives the "
                    "same output); None: one actor decodes each video whole")
    range_overlap_s: float = Field(
        1.0, ge=0, le=60,
        description="a range also decodes and de-identifies this much (from the keyframe before) on either side "
                    "of its own frames, so face tracks and text on screen carry across the cut")


class AudioIngestConfig(_Strict):
    """Audio decode and MFCC (the field's 16 kHz / 40 coefficients / 25 ms / 10 ms) and limits."""

    sample_rate_hz: int = Field(16_000, ge=8_000, le=192_000)
    n_mfcc: int = Field(40, gt=0, le=128)
    n_mels: int = Field(64, gt=0, le=512)
    win_ms: float = Field(25.0, ge=1, le=1000)
    hop_ms: float = Field(10.0, ge=1, le=1000)
    max_duration_s: float = Field(4 * 3600, gt=0, le=7 * DAY_S)
    chunk_s: float = Field(10.0, ge=0.1, le=600, description="seconds of audio decoded per MFCC batch")
    vad: bool = Field(True, description="compute the per-frame voice-activity flag `voiced`")
    vad_threshold_db: float = Field(10.0, gt=0, le=120, description="active: this far above the noise floor")
    vad_floor_s: float = Field(3.0, gt=0, le=600, description="noise floor: quietest frame of this window")
    vad_hangover_ms: float = Field(200.0, ge=0, le=60_000, description="voiced for this long after the last active frame")
    vad_min_dbfs: float = Field(-55.0, ge=-200, le=0, description="frames quieter than this are never active")
    range_min_s: float | None = Field(
        60.0, ge=1, le=7 * DAY_S,
        description="a longer stream is cut into up to one range per ingest actor, each at least this long, that "
                    "the actors process at once; every range decodes the stream from its start (the output equals "
                    "one decode's), so more ranges cost more decoding. None: each stream whole")

    @model_validator(mode="after")
    def _frames_fit(self) -> "AudioIngestConfig":
        if self.hop_ms > self.win_ms:
            raise ValueError(f"hop_ms ({self.hop_ms}) must not exceed win_ms ({self.win_ms}): samples would be skipped")
        if self.n_mfcc > self.n_mels:
            raise ValueError(f"n_mfcc ({self.n_mfcc}) must not exceed n_mels ({self.n_mels})")
        return self


class PdfIngestConfig(_Strict):
    """PDF extraction settings and per-document / per-page limits (timeouts in seconds)."""

    dpi: int = Field(200, ge=50, le=1200, description="render resolution; also the pixel scale of every box")
    lang: str = Field("eng", pattern=r"^[A-Za-z_]+(\+[A-Za-z_]+)*$", description="tesseract language(s)")
    max_pages: int = Field(500, gt=0, le=100_000)
    render_timeout_s: float = Field(60, gt=0, le=3600, description="per poppler call (info, render, text layer)")
    ocr_timeout_s: float = Field(120, gt=0, le=3600, description="per tesseract call (one page)")
    max_page_pixels: int = Field(10000 * 10000, gt=0, le=40_000**2, description="page area at dpi, checked before extraction")
    max_image_pixels: int = Field(12000 * 12000, gt=0, le=40_000**2, description="declared size of any embedded image")
    text_layer: bool = Field(True, description="use a page's text layer when it has one; OCR the others")
    text_layer_min_chars: int = Field(16, ge=1, le=100_000, description="non-space characters for a page to count as text")
    ocr_workers: int = Field(2, ge=1, le=256, description="pages rendered/OCRed concurrently (and the in-flight bound)")
    subprocess_memory_mb: int = Field(2048, ge=64, le=1 << 20, description="address-space ceiling of each poppler/tesseract")


class IngestConfig(_Strict):
    video: VideoIngestConfig = VideoIngestConfig()
    audio: AudioIngestConfig = AudioIngestConfig()
    pdf: PdfIngestConfig = PdfIngestConfig()
    max_file_bytes: int = Field(20 * 2**30, gt=0, le=2**40)
    max_object_memory_bytes: int = Field(
        512 * 2**20, gt=0, le=2**40,
        description="an object-store source that a tool reads by path (a PDF) is held in memory, never on disk, "
                    "while it is processed; a larger one is quarantined (limit_exceeded)")
    allowed_roots: list[Path] = Field(
        default_factory=list, description="folders sources may also resolve into, besides their manifest's folder")


class AlignConfig(_Strict):
    tick_hz: float = Field(25.0, ge=0.01, le=1000, description="aligned output ticks per second")
    tolerance_ms: dict[Modality, Annotated[float, Field(gt=0, le=60_000)]] = Field(
        default_factory=lambda: {"video": 33.0, "audio": 40.0, "pdf": 200.0},
        description="per-modality half-window; outside it a tick records a gap",
    )
    drift_threshold_ms: float = Field(800.0, gt=0, le=3_600_000)
    drift_consecutive_ticks: int = Field(5, ge=1, le=1_000_000)
    allowed_lateness_ms: float = Field(
        2000.0, ge=0, le=3_600_000, description="an event later than this behind its source's newest is logged 'late', not matched"
    )
    part_s: float = Field(
        60.0, gt=0, le=DAY_S, description="session seconds per timeline part: records, CTAL and alarms are written "
                                          "(and the aligner checkpointed) as the watermarks pass each part"
    )


class ImageEncoderSpec(_Strict):
    """A user image encoder from a local file (contract: operators/embed/loaders.py)."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="recorded in model_id as NAME@HASH")
    weights: Path = Field(description="TorchScript file (torch.jit.save), or the state dict / checkpoint for factory")
    factory: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$",
                                description="'package.module:callable' returning an nn.Module; None: weights is TorchScript")
    factory_kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of factory")
    mean: tuple[float, float, float] = Field((0.485, 0.456, 0.406), description="per-channel mean of pixel/255, RGB")
    std: tuple[float, float, float] = Field((0.229, 0.224, 0.225), description="per-channel std of pixel/255, RGB")

    @field_validator("std")
    @classmethod
    def _positive_std(cls, v: tuple[float, float, float]) -> tuple[float, float, float]:
        if any(x <= 0 for x in v):
            raise ValueError("every std must be > 0")
        return v


class EmbedConfig(_Strict):
    image_encoder: ImageEncoderSpec | None = Field(
        None, description="a user image encoder from a local file; None: EfficientNet-Lite0")
    patch_features: bool = Field(
        False, description="also write patch rows (one per grid cell: 49 per embedded frame) and a patch index")
    image_weights: Path | None = Field(None, description="EfficientNet-Lite0 state dict; None: the packaged weights")
    text_model_path: Path | None = Field(None, description="a sentence-transformers folder; None: the packaged MiniLM")
    text_model: str = Field("all-minilm-l6-v2", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                            description="name recorded in the text model_id (NAME@HASH); set it with text_model_path")
    text_backend: Literal["auto", "native", "sentence-transformers"] = Field(
        "auto", description="auto: a BERT folder with mean pooling (the packaged MiniLM) runs in plain torch, any "
                            "other in sentence-transformers; native: plain torch or a config error")
    image_fps: float = Field(1.0, gt=0, le=240, description="video frames embedded per second of video")
    roi_boxes: list[tuple[int, int, int, int]] = Field(
        default_factory=list, max_length=64,
        description="fixed regions (x0, y0, x1, y1 px) of every embedded video frame, e.g. the projector screen: "
                    "roi features pooled from the frame's patch grid, like face boxes")
    image_size: int = Field(224, ge=32, le=2048)
    batch_size: int = Field(
        16, ge=1, le=4096, description="frames (or texts) per forward pass; a video's sampled frames reach the "
                                       "embedder in calls of this many (ingest.video.batch_bytes of pixels at most)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto | cpu | cuda")

    @field_validator("roi_boxes")
    @classmethod
    def _boxes_in_frame(cls, v: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
        for k, (x0, y0, x1, y1) in enumerate(v):
            if not (0 <= x0 < x1 <= MAX_SIDE_PX and 0 <= y0 < y1 <= MAX_SIDE_PX):
                raise ValueError(f"roi_boxes[{k}] = {(x0, y0, x1, y1)}: need 0 <= x0 < x1 <= {MAX_SIDE_PX} "
                                 f"and 0 <= y0 < y1 <= {MAX_SIDE_PX}")
        return v


class RuntimeConfig(_Strict):
    address: str | None = Field(None, description="Ray address; None starts a local Ray")
    num_cpus: int | None = Field(None, ge=1, le=4096, description="local Ray only; default: all cores")
    ingest_actors: int | None = Field(None, ge=1, le=4096, description="default: the cluster's CPUs (the embed actor takes none on a CPU-only cluster)")
    embed_actors: int | None = Field(
        None, ge=1, le=1024,
        description="default: one per GPU of the cluster when the encoders use GPUs; on CPUs one per "
                    "4 ingest actors (an embed actor does about a quarter of an ingest actor's work), at least one")
    max_in_flight: int = Field(4, ge=1, le=1024, description="downstream calls (align, embed) in flight per source stream")
    ray_temp_dir: Path | None = Field(
        None, description="local Ray only: session, log and spill folder "
                          "(default: $RAY_TMPDIR, else <tmp>/modalign-ray-<uid>)"
    )
    min_free_mb: int = Field(256, ge=0, le=2**30, description="free space OUT needs before a run starts (MiB)")
    lease_ttl_s: float = Field(30.0, ge=2, le=3600, description="a writer whose lease heartbeat is older than "
                               "this is taken to be dead and its lease of OUT is taken over")


class LineageHttpConfig(_Strict):
    """An OpenLineage HTTP endpoint (Marquez and others): events are POSTed to ``url`` + ``endpoint``.

    A failing endpoint never fails a run: the run logs one warning and stops sending to it,
    and the file events in OUT are kept. The API key is read from the environment variable
    ``api_key_env`` names, never from the config (the config is copied into run.json)."""

    url: str = Field(max_length=2048, pattern=r"^https?://[^\s/@]+(/[^\s@]*)?$",
                     description="base URL, http(s)://host[:port][/path]; no user:password@ (use api_key_env)")
    endpoint: str = Field("api/v1/lineage", max_length=256, pattern=r"^[A-Za-z0-9_./-]*$",
                          description="path joined to url")
    api_key_env: str | None = Field(None, pattern=r"^[A-Z_][A-Z0-9_]{0,127}$",
                                    description="environment variable holding the API key (sent as a bearer token)")
    timeout_s: float = Field(5.0, gt=0, le=120, description="per request")
    retries: int = Field(1, ge=0, le=10, description="retries of a failed request (connection errors and 5xx)")


class LineageEventsConfig(_Strict):
    """OpenLineage run events of a run (``modalign.pipeline.openlineage``)."""

    enabled: bool = Field(True, description="emit OpenLineage events at all")
    namespace: str = Field("modalign", max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:/@-]*$",
                           description="job namespace of every event")
    job_name: str = Field("modalign.run", max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:/@-]*$",
                          description="job of the run; a session's job is JOB_NAME.session.SESSION_ID")
    file: bool = Field(True, description="write each event as a JSON file into OUT/lineage/openlineage/")
    http: LineageHttpConfig | None = Field(None, description="also POST every event here; None: file only")


class StorageConfig(_Strict):
    """How modalign talks to object storage when INPUT or OUT is ``s3://bucket/prefix``
    (``pipeline.objstore.S3Options``). Credentials are never here: they come from the standard
    AWS chain (environment, config and profile files, instance or pod roles)."""

    endpoint_url: str | None = Field(
        None, max_length=2048, pattern=r"^https?://[^\s/@]+(/[^\s@]*)?$",
        description="S3-compatible endpoint (SeaweedFS, MinIO, Ceph); None: $AWS_ENDPOINT_URL_S3 / "
                    "$AWS_ENDPOINT_URL, else AWS")
    region: str | None = Field(None, max_length=64, pattern=r"^[a-z0-9-]+$",
                               description="None: $AWS_REGION / $AWS_DEFAULT_REGION / the profile's")
    max_attempts: int = Field(5, ge=1, le=20, description="tries of one call on transient errors (first included)")
    retry_mode: Literal["standard", "adaptive"] = Field(
        "standard", description="botocore retry mode; adaptive adds client-side rate limiting when throttled")
    connect_timeout_s: float = Field(5.0, gt=0, le=300)
    read_timeout_s: float = Field(60.0, gt=0, le=3600)
    max_concurrency: int = Field(16, ge=1, le=512,
                                 description="concurrent calls per store and process (stays under S3's per-prefix limits)")


class EmbeddingMonitorConfig(_Strict):
    """The embedding drift monitor (``operators.monitor.embedding_drift``; ``runbooks/embedding-drift.md``)."""

    enabled: bool = Field(True, description="monitor every (model, granularity) of the committed features")
    window: int = Field(32, ge=4, le=100_000, description="vectors per window (a session's last window takes "
                                                          "the remainder: windows of window to 2 * window - 1)")
    bins: int = Field(8, ge=2, le=256, description="equal-mass bins per statistic, from the reference")
    projections: int = Field(4, ge=0, le=64, description="fixed random projections histogrammed besides the L2 norm")
    reference_windows: int = Field(8, ge=2, le=10_000, description="the first N windows are the reference "
                                                                   "(unless --reference OUT0)")
    history: int = Field(32, ge=2, le=100_000, description="past divergences the threshold's mean and sigma use")
    update_every: int = Field(4, ge=1, le=100_000, description="windows between threshold updates (k)")
    alpha: float = Field(2.0, ge=0, le=100, description="threshold = mu + alpha * sigma")
    alpha_step: float = Field(0.5, ge=0, le=100, description="alpha rises by this after adapt_after consecutive "
                                                             "alarms (0: never); it resets after a quiet window")
    adapt_after: int = Field(3, ge=1, le=10_000, description="consecutive alarms before alpha rises")
    alpha_max: float = Field(6.0, ge=0, le=1000, description="alpha never rises above this")
    norm_jump: float = Field(0.2, gt=0, le=1000, description="a norm alarm needs the window's mean L2 norm this "
                                                             "far from the reference's, relative...")
    norm_sigmas: float = Field(4.0, ge=0, le=1000, description="... and this many sigmas of the reference "
                                                               "windows' mean norms")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="seed of the random projections")


class MonitorConfig(_Strict):
    embedding: EmbeddingMonitorConfig = EmbeddingMonitorConfig()
    reference: str | None = Field(
        None, min_length=1, max_length=4096,
        description="another modalign output (a folder or s3://bucket/prefix) whose committed features are the "
                    "monitors' reference (`--reference OUT0`); None: the first windows of this output")


class QualityExpectation(_Strict):
    """One declarative expectation on a modality property of every record, in the spirit of Great
    Expectations' ``expect_column_values_to_be_between``: a value below ``min`` or above ``max`` (either
    may be left out) breaks it, and ``action`` says what happens then (``pipeline.worker``):
    ``warn`` counts it; ``drop`` withholds the record (one ``quality_expectation`` quarantine row per
    contiguous run of dropped records); ``fail`` stops the run before its commit. A record without a
    value (the OCR confidence of a text-layer block) never breaks one. The properties and their
    physical ranges: ``schemas.tables.QUALITY_PROPERTIES``."""

    modality: Modality
    property: str = Field(pattern=r"^[a-z][a-z_]*$", description="e.g. brightness_mean, clipping_ratio, ocr_confidence")
    min: float | None = Field(None, ge=-1e9, le=1e9, description="lowest allowed value (None: no lower bound)")
    max: float | None = Field(None, ge=-1e9, le=1e9, description="highest allowed value (None: no upper bound)")
    action: Literal["warn", "drop", "fail"] = "warn"

    @model_validator(mode="after")
    def _known_and_bounded(self) -> "QualityExpectation":
        props = QUALITY_PROPERTIES[self.modality]
        if self.property not in props:
            raise ValueError(f"{self.modality} has no quality property {self.property!r}; known: {', '.join(props)}")
        if self.min is None and self.max is None:
            raise ValueError("give min, max or both")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min ({self.min}) is above max ({self.max})")
        p = props[self.property]
        for name, v in (("min", self.min), ("max", self.max)):
            if v is not None and not p.low <= v <= p.high:
                raise ValueError(f"{name} {v} is outside the physical range of {self.modality} {self.property}, "
                                 f"[{p.low:g}, {p.high:g}]")
        return self

    def describe(self) -> str:
        """``video brightness_mean in [16, 240]`` (how messages and summaries name it)."""
        lo = "-inf" if self.min is None else f"{self.min:g}"
        hi = "inf" if self.max is None else f"{self.max:g}"
        return f"{self.modality} {self.property} in [{lo}, {hi}]"


DEFAULT_EXPECTATIONS = (
    QualityExpectation(modality="video", property="brightness_mean", min=16, max=240, action="warn"),
    QualityExpectation(modality="audio", property="clipping_ratio", max=0.01, action="warn"),
    QualityExpectation(modality="pdf", property="ocr_confidence", min=40, action="warn"),
)
"""Warn on frames darker or brighter than video's nominal luma range (16-235/240), audio windows with
more than 1 % clipped samples, and OCR blocks tesseract read with a mean confidence under 40."""

# sigma floors of the shift check, in the property's unit: a stationary reference (a fixed camera) has a
# tiny standard deviation, against which any other session would look shifted
DEFAULT_MIN_SIGMA = {
    "video.brightness_mean": 8.0, "video.contrast": 4.0, "video.sharpness": 0.0, "video.channels": 0.5,
    "video.width": 1.0, "video.height": 1.0,
    "audio.loudness_dbfs": 3.0, "audio.clipping_ratio": 0.005, "audio.snr_db": 3.0,
    "pdf.ocr_confidence": 5.0,
}


class QualityShiftConfig(_Strict):
    """The distribution-shift check of every commit against ``--reference OUT0``
    (``operators.quality.shift``, ``runbooks/quality-shift.md``): per (modality, property), the committed
    values of each session (and of all sessions together) against all of OUT0's. An alarm needs both a
    PSI of at least ``psi_threshold`` and a mean shift of at least ``shift_sigmas`` reference standard
    deviations (floored at ``min_sigma`` and at ``min_sigma_fraction`` of the reference mean)."""

    enabled: bool = Field(True, description="write monitor/quality at every commit")
    bins: int = Field(10, ge=2, le=100, description="reference-quantile bins of the PSI")
    psi_threshold: float = Field(0.25, gt=0, le=100, description="PSI at which the distributions differ "
                                                                 "(0.1-0.25: moderate, above: significant)")
    shift_sigmas: float = Field(3.0, ge=0, le=1000, description="... and the mean moved this many (floored) "
                                                                "reference standard deviations")
    min_events: int = Field(50, ge=1, le=10**9, description="values both sides need before an alarm")
    min_sigma: dict[str, Annotated[float, Field(ge=0, le=1e9)]] = Field(
        default_factory=lambda: dict(DEFAULT_MIN_SIGMA),
        description="'modality.property' -> sigma floor in the property's unit; entries given replace the "
                    "defaults' of the same key only")
    min_sigma_fraction: float = Field(0.05, ge=0, le=100, description="sigma floor relative to |reference mean|")

    @field_validator("min_sigma", mode="before")
    @classmethod
    def _over_defaults(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        for key in v:
            modality, _, prop = str(key).partition(".")
            if prop not in QUALITY_PROPERTIES.get(modality, {}):
                raise ValueError(f"no quality property {key!r}; known: "
                                 + ", ".join(f"{m}.{p}" for m, ps in QUALITY_PROPERTIES.items() for p in ps))
        return {**DEFAULT_MIN_SIGMA, **v}


class QualityConfig(_Strict):
    """Modality quality gates: expectations on every record's properties, applied in the ingest worker
    before events are written, and the shift check against a reference run at every commit."""

    expectations: list[QualityExpectation] = Field(
        default_factory=lambda: list(DEFAULT_EXPECTATIONS), max_length=256,
        description="applied in order; [] turns the gates off (the properties are still recorded)")
    shift: QualityShiftConfig = QualityShiftConfig()


class RunConfig(_Strict):
    """Everything ``modalign run`` needs besides INPUT and --out."""

    ingest: IngestConfig = IngestConfig()
    align: AlignConfig = AlignConfig()
    policy: DeidPolicy = DeidPolicy()
    embed: EmbedConfig = EmbedConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    openlineage: LineageEventsConfig = LineageEventsConfig()
    storage: StorageConfig = StorageConfig()
    monitor: MonitorConfig = MonitorConfig()
    quality: QualityConfig = QualityConfig()
    key_store: Path | None = Field(
        None, description="pseudonym key vault; default ~/.modalign/keys (never inside the output folder)"
    )
