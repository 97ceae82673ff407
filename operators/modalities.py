"""Each modality declared once: how a source of it is read, de-identified, stored and embedded.

The ingest worker (``pipeline.worker``), the runner's counters (``pipeline.runner``) and the
embedding registry (``operators.embed.registry``) all read these plans; none of them has
an if-chain over modality names. Adding a modality is one more ``ModalityPlan`` here (plus
its operators and row model).

| modality | source operator | de-identification chain | event row | embed payload | encoder |
| --- | --- | --- | --- | --- | --- |
| video | ``VideoFramesOperator`` | faces, then text shown in frames | ``VideoFrameRow`` (JPEG) | frames at ``embed.image_fps`` | image |
| audio | ``AudioMfccOperator`` (voice anonymised on the waveform when the policy says so) | voice policy | ``MfccRow`` | MFCC frames | audio |
| pdf | ``PdfTextOperator`` | personal data in text | ``TextBlockRow`` | text blocks | text |

Builders import their operator inside the call, so importing this module loads no model.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from modalign.schemas.config import RunConfig
from modalign.schemas.tables import MfccRow, TextBlockRow, VideoFrameRow, _Row


@dataclass(frozen=True)
class DeidContext:
    """What a de-identification operator is built with: the run config, tenant and key vault."""

    config: RunConfig
    tenant: str
    key_store_dir: Path

    def subkey(self, purpose: bytes) -> bytes:
        """A sub-key of the tenant key: deleting the tenant key also retires what it keyed."""
        from modalign.operators.deid.keystore import KeyStore

        return hmac.new(KeyStore(self.key_store_dir).key(self.tenant), purpose, hashlib.sha256).digest()


Builder = Callable[[DeidContext], Any]
# (header column, header) -> (run.json counter, amount) or None when nothing was removed
Counter = Callable[[str, dict[str, Any], int], "tuple[str, int] | None"]


@dataclass(frozen=True)
class ModalityPlan:
    """One modality's path through the worker, from source bytes to stored and embedded rows."""

    name: str
    source: Builder  # the SourceOperator reading a source of this modality
    deid: tuple[Builder, ...]  # TableOperators applied in order, in the ingest process
    event_row: type[_Row]  # the stored event table
    meta_columns: tuple[str, ...]  # what the aligner gets
    embed_columns: tuple[str, ...]  # what the embedder gets (de-identified)
    encoder: str  # key of ``operators.embed.registry.ENCODERS``
    counter: Counter  # de-identification headers -> run.json counters
    embed_fps: Callable[[RunConfig], float | None] = lambda cfg: None  # None: every event
    # (rows, bytes): payload gathered over batches into one embed call until either is reached (a
    # sampled modality's batch carries a frame or two, each call a file per granularity); None: one
    # call per batch
    embed_batch: Callable[[RunConfig], tuple[int, int] | None] = lambda cfg: None
    to_events: Callable[[pa.Table, RunConfig], pa.Table] = lambda t, cfg: t  # payload -> stored form
    counters: tuple[str, ...] = field(default=())  # counters this modality can add (run.json lists them all)
    # True: the source operator decodes the bytes through ``SourceContext.reader``, which hashes
    # them as they are read (one read); False: it hands the path to tools (poppler, tesseract)
    # and the worker hashes the file apart.
    reads_stream: bool = True


def _removed(counter: str) -> Counter:
    """Counts a header's ``count`` under ``counter`` unless the method kept the data."""
    def count(column: str, header: dict[str, Any], rows: int) -> tuple[str, int] | None:
        return None if header["method"] == "keep" or not header["count"] else (counter, header["count"])
    return count


# -- video ----------------------------------------------------------------------------------

def _video_source(ctx: DeidContext) -> Any:
    from modalign.operators.ingest.video import VideoFramesOperator

    return VideoFramesOperator(ctx.config.ingest.video)


def _faces(ctx: DeidContext) -> Any:
    from modalign.operators.deid.faces import FaceBlurConfig, FaceBlurOperator

    pol = ctx.config.policy
    return FaceBlurOperator(FaceBlurConfig(face=pol.face, policy_tag=pol.tag, secret=ctx.subkey(b"face-permutation")))


def _frame_text(ctx: DeidContext) -> Any:
    from modalign.operators.deid.frame_text import FrameTextOperator, config_from_policy

    pol = ctx.config.policy
    keep = {"action": "keep"} if pol.frame_text.action == "keep" else {}
    return FrameTextOperator(config_from_policy(pol, ctx.subkey(b"frame-text-permutation"),
                                                ocr_fps=pol.frame_text.ocr_fps,
                                                reuse_threshold=pol.frame_text.reuse_threshold, **keep))


def encode_jpeg(frames: Iterable[Any], quality: int) -> list[bytes]:
    """JPEG bytes of ``(H, W, 3)`` uint8 frames."""
    import io

    from PIL import Image

    out = []
    for f in frames:
        buf = io.BytesIO()
        Image.fromarray(f).save(buf, format="JPEG", quality=quality)
        out.append(buf.getvalue())
    return out


def _video_events(table: pa.Table, cfg: RunConfig) -> pa.Table:
    from modalign.operators.ingest.video import iter_frames

    jpeg = encode_jpeg(iter_frames(table), cfg.ingest.video.jpeg_quality)  # chunk by chunk: no copy
    return table.drop_columns(["frame"]).append_column("frame_jpeg", pa.array(jpeg, pa.binary()))


def _video_counter(column: str, header: dict[str, Any], rows: int) -> tuple[str, int] | None:
    return _removed("faces_blurred" if column == "deid" else "frame_text_blurred")(column, header, rows)


# -- audio ----------------------------------------------------------------------------------

def _audio_source(ctx: DeidContext) -> Any:
    from modalign.operators.deid.voice import voice_transform
    from modalign.operators.ingest.audio import AudioMfccOperator

    cfg = ctx.config
    # Voice anonymisation happens on the waveform, before MFCC, in this process, keyed by the tenant.
    secret = ctx.subkey(b"voice-anonymisation") if cfg.policy.voice.action == "anonymise" else None
    return AudioMfccOperator(cfg.ingest.audio, waveform_transform=voice_transform(
        cfg.policy.voice, cfg.ingest.audio.sample_rate_hz, secret=secret))


def _voice(ctx: DeidContext) -> Any:
    from modalign.operators.deid.voice import VoicePolicyConfig, VoicePolicyOperator

    cfg = ctx.config
    return VoicePolicyOperator(VoicePolicyConfig(voice=cfg.policy.voice, policy_tag=cfg.policy.tag,
                                                 sample_rate_hz=cfg.ingest.audio.sample_rate_hz))


def _voice_counter(column: str, header: dict[str, Any], rows: int) -> tuple[str, int]:
    """MFCC frames stored per voice method (``voice_frames:voiceanon@3/...``, ``voice_frames:waveform_dropped``)."""
    return f"voice_frames:{header['method']}", rows


# -- pdf ------------------------------------------------------------------------------------

def _pdf_source(ctx: DeidContext) -> Any:
    from modalign.operators.ingest.pdf import PdfTextOperator

    return PdfTextOperator(ctx.config.ingest.pdf)


def _text(ctx: DeidContext) -> Any:
    from modalign.operators.deid.text import TextPiiConfig, TextPiiOperator

    pol = ctx.config.policy
    return TextPiiOperator(TextPiiConfig(text=pol.text, policy_tag=pol.tag, tenant=ctx.tenant,
                                         key_store_dir=ctx.key_store_dir))


PLANS: Mapping[str, ModalityPlan] = {
    "video": ModalityPlan(
        name="video", source=_video_source, deid=(_faces, _frame_text), event_row=VideoFrameRow,
        meta_columns=("event_id", "t_ns"), embed_columns=("event_id", "t_ns", "frame", "face_boxes"),
        encoder="image", counter=_video_counter, embed_fps=lambda cfg: cfg.embed.image_fps,
        embed_batch=lambda cfg: (cfg.embed.batch_size, cfg.ingest.video.batch_bytes),
        to_events=_video_events, counters=("faces_blurred", "frame_text_blurred")),
    "audio": ModalityPlan(
        name="audio", source=_audio_source, deid=(_voice,), event_row=MfccRow,
        meta_columns=("event_id", "t_ns"), embed_columns=("event_id", "t_ns", "mfcc"),
        encoder="audio", counter=_voice_counter),
    "pdf": ModalityPlan(
        name="pdf", source=_pdf_source, deid=(_text,), event_row=TextBlockRow,
        meta_columns=("event_id", "t_ns", "end_t_ns"), embed_columns=("event_id", "t_ns", "text", "box", "page_index"),
        encoder="text", counter=_removed("pii_replaced"), counters=("pii_replaced",), reads_stream=False),
}


def plan_for(modality: str) -> ModalityPlan:
    """The plan of ``video | audio | pdf``; KeyError names the known ones."""
    try:
        return PLANS[modality]
    except KeyError:
        raise KeyError(f"no modality {modality!r}; known: {', '.join(PLANS)}") from None
