"""The ingest worker: decode one source and de-identify it, inside one process.

This is the body of the Ray ingest actor (``modalign.pipeline.actors``) but knows nothing about
Ray, so it runs in tests in-process. Raw payload (pixels, waveform, OCR text) exists only
between the decode operator and the de-identification operator of this process; what
leaves (the yielded items and the event files) is de-identified.

``ingest`` yields ``(kind, payload)`` items:

- ``("clock", (mapping, windows))``: when the source's clock is estimated or verified
  against another source: the mapping ingested with and the per-window observed offsets;
- ``("source", lineage)``: then, the lineage columns of every row of this source;
- ``("meta", table)``: event ids and session times for the aligner;
- ``("embed", (modality, table))``: de-identified payload sampled for embedding;
- ``("quarantine", row)``: a rejected source or range (``QuarantineRow`` fields);
- ``("lineage", row)``: last item, the source's ``SourceLineageRow`` fields.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from modalign.operators.ingest.base import SourceContext
from modalign.schemas.errors import ComplianceError, InputError
from modalign.pipeline.layout import OutputLayout, remove_parts, with_lineage, write_table
from modalign.schemas.config import RunConfig
from modalign.schemas.manifest import ClockMapping
from modalign.schemas.tables import MfccRow, TextBlockRow, VideoFrameRow

log = logging.getLogger(__name__)

Item = tuple[str, Any]


def encode_jpeg(frames: np.ndarray, quality: int) -> list[bytes]:
    from PIL import Image

    out = []
    for f in frames:
        buf = io.BytesIO()
        Image.fromarray(f).save(buf, format="JPEG", quality=quality)
        out.append(buf.getvalue())
    return out


def sample_every(t_ns: np.ndarray, fps: float, state: dict) -> np.ndarray:
    """Mask keeping the first event at or after each 1/fps step (state carries across batches)."""
    step = int(round(1e9 / fps))
    keep = np.zeros(len(t_ns), dtype=bool)
    nxt = state.get("next")
    for i, t in enumerate(t_ns.tolist()):
        if nxt is None or t >= nxt:
            keep[i] = True
            nxt = (t // step + 1) * step
    state["next"] = nxt
    return keep


class IngestWorker:
    """Holds the ingest and de-identification operators of one actor (models loaded once)."""

    def __init__(self, config: RunConfig, out_root: Path, key_store_dir: Path) -> None:
        self.config = config
        self.layout = OutputLayout(Path(out_root))
        self.key_store_dir = Path(key_store_dir)
        self._ops: dict[str, Any] = {}

    # -- operators, built once per worker -------------------------------------------------
    def _op(self, name: str, tenant: str = "default"):
        key = f"{name}:{tenant}"
        if key not in self._ops:
            self._ops[key] = self._build(name, tenant)
        return self._ops[key]

    def _build(self, name: str, tenant: str):
        cfg, pol = self.config, self.config.policy
        if name == "video":
            from modalign.operators.ingest.video import VideoFramesOperator

            return VideoFramesOperator(cfg.ingest.video)
        if name == "audio":
            from modalign.operators.deid.voice import voice_transform
            from modalign.operators.ingest.audio import AudioMfccOperator

            # Voice anonymisation happens on the waveform, before MFCC, in this process.
            return AudioMfccOperator(cfg.ingest.audio,
                                     waveform_transform=voice_transform(pol.voice, cfg.ingest.audio.sample_rate_hz))
        if name == "pdf":
            from modalign.operators.ingest.pdf import PdfTextOperator

            return PdfTextOperator(cfg.ingest.pdf)
        if name == "face":
            from modalign.operators.deid.faces import FaceBlurConfig, FaceBlurOperator

            return FaceBlurOperator(FaceBlurConfig(face=pol.face, policy_tag=pol.tag,
                                                   secret=self._subkey(tenant, b"face-permutation")))
        if name == "frame_text":
            from modalign.operators.deid.frame_text import FrameTextOperator, config_from_policy

            ft = pol.frame_text
            return FrameTextOperator(config_from_policy(pol, self._subkey(tenant, b"frame-text-permutation"),
                                                        ocr_fps=ft.ocr_fps,
                                                        **({"action": "keep"} if ft.action == "keep" else {})))
        if name == "text":
            from modalign.operators.deid.text import TextPiiConfig, TextPiiOperator

            return TextPiiOperator(TextPiiConfig(
                text=pol.text, policy_tag=pol.tag, tenant=tenant, key_store_dir=self.key_store_dir))
        if name == "voice":
            from modalign.operators.deid.voice import VoicePolicyConfig, VoicePolicyOperator

            return VoicePolicyOperator(VoicePolicyConfig(voice=pol.voice, policy_tag=pol.tag,
                                                         sample_rate_hz=cfg.ingest.audio.sample_rate_hz))
        raise KeyError(name)

    def _subkey(self, tenant: str, purpose: bytes) -> bytes:
        """A sub-key of the tenant key: deleting the tenant key also retires what it keyed."""
        from modalign.operators.deid.keystore import KeyStore

        return hmac.new(KeyStore(self.key_store_dir).key(tenant), purpose, hashlib.sha256).digest()

    # -- one source -----------------------------------------------------------------------
    def ingest(
        self, ctx: SourceContext, tenant: str = "default", subjects: tuple[str, ...] = (),
        reference: tuple[Path, ClockMapping] | None = None,
    ) -> Iterator[Item]:
        """Ingest one source; ``reference`` (path, clock) when its clock is estimated/verified against it."""
        if reference is not None:
            ctx, clock_item = self._clock(ctx, *reference)
            yield clock_item
        modality = ctx.spec.modality
        chain = {"video": ("video", "face", "frame_text"), "audio": ("audio", "voice"), "pdf": ("pdf", "text")}[modality]
        ops = [self._op(n, tenant) for n in chain]
        lineage = dict(
            session_id=ctx.session_id, source_id=ctx.spec.id, source_uri=ctx.uri, source_version=ctx.version,
            operators=";".join(op.tag for op in ops), policy=self.config.policy.tag, model_id=None,
        )
        yield "source", lineage
        remove_parts(self.layout.events_dir(modality, ctx.session_id), ctx.spec.id)
        stats = {"events": 0, "deid": {}, "status": "ingested"}
        started = time.perf_counter()
        sampler: dict = {}
        part = 0
        try:
            for raw in ops[0].read(ctx):
                transform = getattr(ops[0], "waveform_transform", None)
                if transform is not None:  # tells the voice policy the MFCCs are of anonymised speech
                    from modalign.operators.deid.voice import mark_transformed

                    raw = mark_transformed(raw, transform)
                clean = raw
                for op in ops[1:]:  # the de-identification operators of this modality, in order
                    clean = op.process(clean)
                del raw  # the raw batch ends here, in this process
                if clean.num_rows == 0:
                    continue
                self._count_deid(stats, clean)
                events = self._event_table(modality, clean, lineage)
                write_table(self.layout.events(modality, ctx.session_id, ctx.spec.id, part), events)
                part += 1
                stats["events"] += clean.num_rows
                meta_cols = ["event_id", "t_ns"] + (["end_t_ns"] if modality == "pdf" else [])
                yield "meta", clean.select(meta_cols)
                yield "embed", (modality, self._embed_payload(modality, clean, sampler))
        except (InputError, ComplianceError) as exc:
            stats["status"] = "partial" if stats["events"] else "quarantined"
            yield "quarantine", self._quarantine_row(ctx, exc)
        except Exception as exc:  # an operator bug must not end the run; nothing raw in the message
            log.exception("internal error ingesting %s", ctx.uri)
            stats["status"] = "partial" if stats["events"] else "quarantined"
            err = InputError(f"internal error ({type(exc).__name__}); see the worker log", source_uri=ctx.uri,
                             stage=f"ingest/{modality}", code="internal_error")
            yield "quarantine", self._quarantine_row(ctx, err)
        yield "lineage", dict(
            session_id=ctx.session_id, source_id=ctx.spec.id, source_uri=ctx.uri, source_version=ctx.version,
            modality=modality, status=stats["status"], events=stats["events"], operators=lineage["operators"],
            policy=lineage["policy"], deid=list(stats["deid"].values()), subjects=list(subjects),
            latency_ms=(time.perf_counter() - started) * 1e3,
        )

    def _clock(self, ctx: SourceContext, ref_path: Path, ref_clock: ClockMapping) -> tuple[SourceContext, Item]:
        """Estimate (or verify) the source's clock against a reference recording, in this process.

        The decoded audio of both stays here; only the mapping and window offsets leave. If no
        offset can be found, the manifest's mapping is kept and no windows are reported.
        """
        from modalign.operators.align.offset import estimate_source_offset

        clock = ctx.spec.clock
        try:
            est = estimate_source_offset(ref_path, ctx.path, self.config.ingest.audio.sample_rate_hz,
                                         ref_clock=ref_clock)
        except InputError as exc:
            log.warning("clock of %s not estimated against %s: %s", ctx.uri, ref_path.name, exc.message)
            return ctx, ("clock", (clock, []))
        if clock.estimate_from:
            clock = est.clock_mapping(estimate_from=clock.estimate_from)
            ctx = replace(ctx, spec=ctx.spec.model_copy(update={"clock": clock}))
        return ctx, ("clock", (clock, est.observations()))

    @staticmethod
    def _count_deid(stats: dict, table: pa.Table) -> None:
        """Sum the de-identification headers (faces, frame text, text, voice) per method and detector."""
        for col in ("deid", "text_deid"):
            if col not in table.column_names:
                continue
            for h in table.column(col).to_pylist():
                agg = stats["deid"].setdefault((h["method"], h["detector"]), dict(h, count=0))
                agg["count"] += h["count"]

    def _event_table(self, modality: str, clean: pa.Table, lineage: dict) -> pa.Table:
        if modality == "video":
            from modalign.operators.ingest.video import frames_to_numpy

            jpeg = encode_jpeg(frames_to_numpy(clean), self.config.ingest.video.jpeg_quality)
            t = clean.drop_columns(["frame"]).append_column("frame_jpeg", pa.array(jpeg, pa.binary()))
            return with_lineage(t, lineage, VideoFrameRow.schema())
        if modality == "audio":
            return with_lineage(clean, lineage, MfccRow.schema())
        return with_lineage(clean, lineage, TextBlockRow.schema())

    def _embed_payload(self, modality: str, clean: pa.Table, sampler: dict) -> pa.Table:
        if modality == "video":
            keep = sample_every(clean.column("t_ns").to_numpy(), self.config.embed.image_fps, sampler)
            return clean.filter(pa.array(keep)).select(["event_id", "t_ns", "frame", "face_boxes"])
        if modality == "audio":
            return clean.select(["event_id", "t_ns", "mfcc"])
        return clean.select(["event_id", "t_ns", "text", "box", "page_index"])

    @staticmethod
    def _quarantine_row(ctx: SourceContext, exc: InputError | ComplianceError) -> dict:
        return dict(
            session_id=ctx.session_id, source_id=ctx.spec.id, source_uri=ctx.uri, source_version=ctx.version,
            stage=exc.stage or f"ingest/{ctx.spec.modality}", reason_code=exc.code, message=exc.message,
            start_t_ns=getattr(exc, "start_t_ns", None), end_t_ns=getattr(exc, "end_t_ns", None),
        )
