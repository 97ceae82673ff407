"""Run configuration: every knob of every stage, with the field's defaults.

Users write a YAML/JSON file with any subset of these fields (``modalign run --config``);
unknown keys are errors that name the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from schemas.policy import DeidPolicy


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class VideoIngestConfig(_Strict):
    sample_fps: float | None = Field(None, gt=0, description="None: every decoded frame")
    max_pixels: int = Field(3840 * 2160, gt=0, description="frames larger than this are rejected")
    max_duration_s: float = Field(4 * 3600, gt=0)
    jpeg_quality: int = Field(90, ge=10, le=100, description="quality of stored de-identified frames")


class AudioIngestConfig(_Strict):
    sample_rate_hz: int = Field(16_000, gt=0)
    n_mfcc: int = Field(40, gt=0)
    win_ms: float = Field(25.0, gt=0)
    hop_ms: float = Field(10.0, gt=0)
    max_duration_s: float = Field(4 * 3600, gt=0)


class PdfIngestConfig(_Strict):
    dpi: int = Field(200, ge=50, le=600)
    lang: str = "eng"
    max_pages: int = Field(500, gt=0)
    render_timeout_s: float = Field(60.0, gt=0)
    ocr_timeout_s: float = Field(120.0, gt=0)


class IngestConfig(_Strict):
    video: VideoIngestConfig = VideoIngestConfig()
    audio: AudioIngestConfig = AudioIngestConfig()
    pdf: PdfIngestConfig = PdfIngestConfig()
    max_file_bytes: int = Field(20 * 2**30, gt=0)


class AlignConfig(_Strict):
    tick_hz: float = Field(25.0, gt=0)
    tolerance_ms: dict[str, float] = Field(
        default_factory=lambda: {"video": 33.0, "audio": 40.0, "pdf": 200.0},
        description="per-modality half-window; outside it a tick records a gap",
    )
    drift_threshold_ms: float = Field(800.0, gt=0)
    drift_consecutive_ticks: int = Field(5, ge=1)
    allowed_lateness_ms: float = Field(
        2000.0, ge=0, description="an event later than this behind its source's newest is logged 'late', not matched"
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


class EmbedConfig(_Strict):
    image_encoder: ImageEncoderSpec | None = Field(
        None, description="a user image encoder from a local file; None: EfficientNet-Lite0")
    patch_features: bool = Field(
        False, description="also write patch rows (one per grid cell: 49 per embedded frame) and a patch index")
    image_weights: Path | None = Field(None, description="EfficientNet-Lite0 state dict; None: the packaged weights")
    text_model_path: Path | None = Field(None, description="a sentence-transformers folder; None: the packaged MiniLM")
    text_model: str = Field("all-minilm-l6-v2", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                            description="name recorded in the text model_id (NAME@HASH); set it with text_model_path")
    image_fps: float = Field(1.0, gt=0, description="video frames embedded per second of video")
    image_size: int = Field(224, ge=32)
    batch_size: int = Field(16, ge=1)
    device: str = Field("auto", description="auto | cpu | cuda")


class RuntimeConfig(_Strict):
    address: str | None = Field(None, description="Ray address; None starts a local Ray")
    num_cpus: int | None = Field(None, ge=1, description="local Ray only; default: all cores")
    ingest_actors: int | None = Field(None, ge=1, description="default: max(1, cpus - 1)")
    max_in_flight: int = Field(4, ge=1, description="downstream calls (align, embed) in flight per source stream")
    ray_temp_dir: Path | None = Field(
        None, description="local Ray only: session, log and spill folder (default: Ray's, or $RAY_TMPDIR)"
    )


class RunConfig(_Strict):
    """Everything ``modalign run`` needs besides INPUT and --out."""

    ingest: IngestConfig = IngestConfig()
    align: AlignConfig = AlignConfig()
    policy: DeidPolicy = DeidPolicy()
    embed: EmbedConfig = EmbedConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    key_store: Path | None = Field(
        None, description="pseudonym key vault; default ~/.modalign/keys (never inside the output folder)"
    )
