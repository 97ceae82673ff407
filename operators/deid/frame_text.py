"""De-identification of personal data shown as text inside video frames (slides, badges).

Data flow: ``modalign.operators.ingest`` video decode -> ``FaceBlurOperator`` -> **FrameTextOperator**
-> JPEG encode and the aligner. Like faces, the raw pixels never leave the ingest process:
each frame this operator returns has every box of on-screen personal data (names, e-mails,
phones ... the kinds of ``modalign.operators.deid.text``) blurred then key-permuted with
``modalign.operators.deid.faces.anonymise_region``. Pixels outside the boxes are bit-identical to the
input, and a frame without personal data is returned bit-identical.

Sampling. A frame is OCRed when it is the first valid frame of the stream at or after a
step ``k / ocr_fps`` of the session clock (``t_ns``; without ``t_ns`` every valid frame is
a sample). The grid belongs to the stream, not to the table: where the tables of a stream
begin and end changes nothing, so the same frames give byte-identical output (pixels and
boxes) for any batching, in every run (the permutation key is the tenant secret, the salt
the frame's deterministic event id). A sample is converted to grayscale, upscaled by
``ocr_scale`` (tesseract misses much of ~13 px text at 1x), capped at ``ocr_max_pixels``
(default 1280x720: a 360p frame is read at 2x, a 720p frame at 1x, where 13 px text is read
less well, to stay near real time on one core), and read by tesseract in memory (no image
touches the disk). Words are grouped into lines (tesseract's block/paragraph/line), the
lines of a block joined by newlines.

Engine. ``engine = "library"`` (default) reads through libtesseract in this process
(tesserocr, which ships its own build; the language data is the Debian package's): the model
is loaded once per operator, so a sample costs its recognition only (a 360p frame at 2x
~130 ms, a 200x150 crop ~16 ms), where a tesseract process per sample pays ~190 ms to start
and load the model each time. Its input is a decoded frame (a bounded array of at most
``ocr_max_pixels``, not a file a parser reads), and ``ocr_timeout_s`` cancels a recognition
that runs over. ``engine = "cli"`` runs Debian's tesseract binary per sample as before
(stdin PGM -> TSV on stdout) under the memory ceiling and timeout of
``modalign.operators.sandbox.run_limited``. The two are different tesseract versions; the
detector name says which read the frames.

Detection. Each pair of consecutive samples goes through one ``detect_batch`` call over the
blocks of both (OCR artefacts are handled as for PDFs, and a name found in one sample of
the pair is also searched for in the other); the pair's boxes are the spans found in either
sample, each the union of the boxes of its words on each line it touches, mapped back to
frame pixels and padded by ``pad_px``. A pair whose texts are those of the pair before (a
static slide whose OCR was reused) gets that pair's answer without a second call: detection
is a pure function of the texts.

Temporal rule: a frame gets the boxes of the pair of samples around it (the sample at or
before it and the one after it); a sampled frame gets both of its pairs. Text that stays
on screen for at least ``1 / ocr_fps`` (plus one frame interval) is in at least one of
those two samples, so it is covered in every frame that shows it.

Look-ahead across tables. A frame's boxes need the next sample, which may lie in a later
table, so the operator holds back the frames from the last sample of a table on (at most
one ``1 / ocr_fps`` interval of frames, raw, in this process) and carries the last
sample's OCR blocks; they are emitted, anonymised, with the output of the next table of
the same stream (same ``event_id`` prefix, later ``t_ns``). ``process`` therefore returns
the frames that are final so far, in stream order, which may be fewer rows than it was
given (or none). At the end of a stream ``flush()`` returns the rest: the last valid held
frame is OCRed as one more sample, so text that appears after the last grid sample and
stays to the end is covered too (the worker calls it after the source's last batch). A
new frame shape within a stream ends a segment the same way (its frames come out with the
next call). ``reset()`` drops what is held (withheld, never emitted raw).

Reuse. Before a sample is OCRed, its grayscale thumbnail (means of 4x4 px cells) is compared
with that of the stream's last sample actually OCRed: when no cell changed by
``reuse_threshold`` or more (video compression noise moves a cell by a few levels, a changed
letter of 13 px text by ~60), the content is taken as the same and that sample's words are
used again (same words, same boxes; detection runs on the pair as always). Where cells changed
away from every block of read text of the reference (a person moving through the room), only
the part of the frame around them is OCRed (``reread_rect``: their bounding box with a 16 px
margin, at the frame's OCR scale) and its words replace the reference's stray marks there
(tesseract "reads" ``>.`` or ``we'`` in a face; a block of text holds a word with 3 letters or
digits in a row); a change that touches a block of text (the slide changed) or covers over
half the frame means a whole-frame OCR, as without reuse (tesseract reads a crop of a text
area less well than the whole frame: it missed an e-mail address there). Re-read cells take
the new thumbnail, the others keep the one they were last read at, so slow drift cannot add up
unseen. The reference belongs to the stream like ``last_step`` (and restarts with a new frame
shape), so output stays byte-identical for any batching. ``reuse_threshold`` 0 OCRs every
sample; the detector name says ``/reuse<N`` when reuse is on.

Residual risk: text shown for less than ``1 / ocr_fps`` can fall between two samples and
leak, and so can text tesseract does not read in any sample (very small, low-contrast,
rotated or stylised text) or that ``find_pii`` does not recognise as personal data, and, with
reuse on, a change smaller than ``reuse_threshold`` in every 4x4 cell (not a changed word of
legible text, but e.g. one faint low-contrast glyph). A box
covers the pixels where the text was OCRed: text that moves between two samples is covered
only where the samples saw it.

Failures: when tesseract fails, runs out of memory or times out on a sample, the table and
the frames held back before it are withheld with ``ComplianceError`` naming the event id
(never the text).
"""

from __future__ import annotations

import logging
import math
import os
import re
import subprocess
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Literal

import numpy as np
import pyarrow as pa
from pydantic import Field

from modalign.operators.base import OperatorConfig, TableOperator
from modalign.operators.deid.faces import (anonymise_region, event_ids, first_str, frame_array, frames_like,
                                           region_schema, stream_span, take_run, tensor_view, with_regions)
from modalign.operators.deid.names import load_nlp
from modalign.operators.deid.recognisers import RULES_VERSION, detect_batch, detector_name
from modalign.operators.dependencies import binary, missing, require, require_tesseract_langs
from modalign.operators.sandbox import out_of_memory, run_limited
from modalign.schemas.errors import ComplianceError, InputError, ModalignError
from modalign.schemas.policy import DEFAULT_POLICY_TAG, DeidPolicy, FrameTextPolicy, TextEntity, TextPolicy
from modalign.schemas.units import NS_PER_S

log = logging.getLogger(__name__)

TEXT_BOXES = "text_boxes"
TEXT_DEID = "text_deid"
METHOD = "blur_permute"
MERGE_IOU = 0.5  # near-identical boxes of the two neighbouring samples become one
REUSE_CELL = 4  # px side of a change-test cell: a changed letter of 13 px text moves a cell mean by ~60
REREAD_MARGIN_PX = 16  # context around the changed cells when only they are OCRed
_WORDLIKE = re.compile(r"[^\W_]{3}")
REREAD_MAX_PART = 0.5  # a changed rectangle over this part of the frame: the whole frame is OCRed
SALT_SUFFIX = "/frame_text"  # permutation salt = event_id + this (differs from the face boxes')

BoxT = tuple[int, int, int, int, float]  # x0, y0, x1, y1 (frame pixels, end-exclusive), score
SpanT = tuple[int, int, int, "OcrWord"]  # start, end (in the block text), line number, word
_POLICY, _TEXT = FrameTextPolicy(), TextPolicy()  # defaults come from the policy: declared once


class FrameTextConfig(OperatorConfig):
    """Operator settings; the policy-facing ones default to ``FrameTextPolicy`` / ``TextPolicy``
    (``config_from_policy`` sets them from a run's policy), the rest are OCR mechanics."""

    action: Literal["blur", "keep"] = Field("blur", description="keep: frames pass through, nothing is OCRed")
    ocr_fps: float = Field(_POLICY.ocr_fps, gt=0.0, le=1000.0, description="OCR samples per second of video (session clock)")
    ocr_scale: float = Field(2.0, ge=1.0, le=4.0, description="upscale factor of a sample before OCR")
    ocr_max_pixels: int = Field(
        1280 * 720, ge=1, description="the upscale is capped so the OCRed image has at most this many pixels"
    )
    lang: str = Field("eng", pattern=r"^[A-Za-z_]+(\+[A-Za-z_]+)*$", description="tesseract language(s)")
    psm: int = Field(11, ge=3, le=13, description="tesseract page segmentation mode; 11: sparse text")
    engine: Literal["library", "cli"] = Field(
        "library", description="library: libtesseract in this process (tesserocr), the model loaded once; cli: a "
                               "tesseract process per sample, under subprocess_memory_mb (see Engine)")
    ocr_timeout_s: float = Field(30.0, gt=0.0, description="per OCR sample")
    subprocess_memory_mb: int = Field(1024, ge=64, description="RLIMIT_AS of the tesseract process (engine cli)")
    min_conf: float = Field(30.0, ge=0.0, le=100.0, description="OCR words under this confidence are ignored")
    pad_px: int = Field(4, ge=0, le=64, description="margin added around each text box (frame pixels)")
    entities: tuple[TextEntity, ...] = Field(_TEXT.entities, description="personal-data kinds looked for")
    min_score: float = Field(_TEXT.min_score, ge=0.0, le=1.0, description="detector score threshold (TextPolicy)")
    min_scores: dict[TextEntity, float] = Field(default_factory=dict, description="per-kind thresholds")
    blur_sigma_ratio: float = Field(0.15, gt=0.0, le=1.0, description="Gaussian sigma / longer box side")
    reuse_threshold: int = Field(
        _POLICY.reuse_threshold, ge=0, le=255,
        description="a sample whose grayscale thumbnail (4x4 px cell means) differs from the stream's last OCRed "
                    "sample by less than this in every cell reuses that OCR; 0: every sample is OCRed "
                    "(FrameTextPolicy.reuse_threshold)",
    )
    policy_tag: str = DEFAULT_POLICY_TAG
    secret: bytes | None = Field(
        None,
        repr=False,
        exclude=True,
        description="permutation key; None: a random one per operator instance (setup)",
    )


def config_from_policy(policy: DeidPolicy, secret: bytes | None, **overrides: Any) -> FrameTextConfig:
    """The operator's config under a de-identification policy: the text policy's entity kinds
    and thresholds; ``keep`` only when the policy keeps every entity kind it detects."""
    text = policy.text
    keep = all(text.action_for(kind) == "keep" for kind in text.entities)
    fields: dict[str, Any] = dict(action="keep" if keep else "blur", entities=text.entities,
                                  min_score=text.min_score, min_scores=dict(text.min_scores),
                                  policy_tag=policy.tag, secret=secret)
    fields.update(overrides)
    return FrameTextConfig(**fields)


@dataclass(frozen=True)
class OcrWord:
    """One word read by tesseract; box in frame pixels (already divided by the OCR scale)."""

    text: str
    x0: int
    y0: int
    x1: int
    y1: int
    conf: float



@dataclass
class _Sample:
    """One OCRed frame: its text blocks and, per block, where each word sits in the text."""

    texts: list[str]
    spans: list[list[SpanT]]


@dataclass
class _Stream:
    """What one stream carries from a table to the next (see "Look-ahead" above)."""

    stream: str | None  # event_id prefix
    schema: pa.Schema  # of its tables (frame shape included): held rows and new rows concatenate
    last_order: int | None = None  # t_ns (else frame_index) of the last row seen
    last_step: int | None = None  # grid step of the last valid row (no t_ns: valid rows seen)
    held: pa.Table | None = None  # rows from the last sample on, not emitted yet (raw pixels)
    valid: list[bool] = field(default_factory=list)  # per held row
    boxes: list[list[BoxT]] = field(default_factory=list)  # per held row, gathered so far
    sample: _Sample | None = None  # the OCR of held row 0 (the last sample)
    ref: tuple[np.ndarray, list] | None = None  # thumbnail and words of the last sample actually OCRed


class FrameTextOperator(TableOperator[FrameTextConfig]):
    """OCR sampled frames, find personal data in the text, blur+permute it in every frame.

    Input: ``frame`` (fixed_shape_tensor uint8 [H, W, 3], RGB), ``t_ns`` (int64, session
    clock; without it every frame is OCRed) and ``event_id`` plus any other columns (the
    face operator's ``face_boxes`` and ``deid`` included), which pass through unchanged.
    Output: the same columns with ``frame`` in a new buffer where text was removed, plus
    ``text_boxes`` (list<Box>: boxes anonymised in that frame, padded, with the detector
    score) and ``text_deid`` (a DeidHeader: method ``blur_permute`` or ``keep``,
    detector ``tesseract@<ver>[/reuse<N]+<text detector>``, count = boxes). ``deid`` (the faces')
    is left as it is. Rows come out in stream order, held back until the next OCR sample is
    read: call ``flush()`` at the end of each stream for the rest (``keep`` holds nothing).
    """

    kind = "frame_text"
    version = "0.3.0"
    config_model = FrameTextConfig

    def __init__(self, config: FrameTextConfig | None = None) -> None:
        super().__init__(config)
        self._secret = b""
        self._tesseract: str | None = None
        self._tess_version = "?"
        self._env: dict[str, str] = {}
        self._api: Any = None  # tesserocr.PyTessBaseAPI (engine library), made in setup
        self._state: _Stream | None = None
        self._done: list[pa.Table] = []  # anonymised tables not returned yet, in stream order
        self._found: tuple[tuple[str, ...], list] | None = None  # the last pair's texts and detect_batch's answer

    # -- lifecycle -----------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.config
        self._secret = cfg.secret if cfg.secret is not None else os.urandom(32)
        if cfg.action != "keep":
            self._tesseract = binary("tesseract")
            try:
                langs = subprocess.run([self._tesseract, "--list-langs"], capture_output=True, text=True,
                                       timeout=30).stdout.split()
                ver = subprocess.run([self._tesseract, "--version"], capture_output=True, text=True, timeout=30)
            except (OSError, subprocess.SubprocessError):
                raise missing("tesseract", what="a working tesseract binary") from None
            require_tesseract_langs(langs, cfg.lang.split("+"))
            m = re.search(r"tesseract\s+v?(\S+)", (ver.stdout or "") + (ver.stderr or ""))
            self._tess_version = m.group(1) if m else "?"
            self._env = {**os.environ, "OMP_THREAD_LIMIT": "1"}  # one core per actor
            if cfg.engine == "library":
                self._api, self._tess_version = open_library(cfg.lang, cfg.psm, tessdata_dir(self._tesseract))
            if "person" in cfg.entities:
                load_nlp()
        self._ready = True

    def reset(self) -> None:
        """Drop the held-back frames and the carried sample (they are withheld, never emitted)."""
        self._state = None
        self._done.clear()

    def flush(self, cut: bool = False) -> list[pa.Table]:
        """End of stream: the held-back frames, anonymised (the last valid one is OCRed as a
        final sample, a cut too: ``cut`` changes nothing here), and anything else not returned
        yet; in stream order, one table per frame shape. The operator is then ready for another
        stream."""
        if self.config.action == "keep":
            return []
        self.ensure_setup()
        st = self._state
        try:
            self._finish_segment()
        except ModalignError:
            self.reset()
            raise
        except Exception as exc:
            self.reset()
            raise self._failed(exc, st.held if st is not None and st.held is not None else None) from None
        out = []
        while self._done:
            out.append(take_run(self._done))
        self._state = None
        return out

    @property
    def detector_name(self) -> str:
        if self.config.action == "keep":
            return "none"
        text = detector_name() if "person" in self.config.entities else RULES_VERSION
        reuse = f"/reuse<{self.config.reuse_threshold}" if self.config.reuse_threshold else ""
        lib = "/lib" if self.config.engine == "library" else ""
        return f"tesseract@{self._tess_version}{lib}{reuse}+{text}"

    def output_schema(self, input_schema: pa.Schema) -> pa.Schema:
        return region_schema(input_schema, TEXT_BOXES, TEXT_DEID)

    # -- processing ----------------------------------------------------------------------
    def process(self, table: pa.Table) -> pa.Table:
        self.ensure_setup()
        try:
            frames = frame_array(table)
        except InputError as exc:  # same checks as the face operator, under this stage's name
            raise InputError(exc.message.replace("face_blur", self.kind), stage=self.kind, code=exc.code) from None
        n = len(frames)
        if self.config.action == "keep":
            return self._assemble(table, frames, [[] for _ in range(n)], method="keep")
        if n == 0:
            return take_run(self._done) if self._done else self._assemble(table, frames, [], method=METHOD)
        try:
            self._add(table, frames)
        except ModalignError:
            self.reset()
            raise
        except Exception as exc:  # never let a message carrying OCR text escape
            self.reset()
            raise self._failed(exc, table) from None
        if self._done:
            return take_run(self._done)
        empty = table.slice(0, 0)
        return self._assemble(empty, frame_array(empty), [], method=METHOD)

    def _failed(self, exc: Exception, table: pa.Table | None) -> ComplianceError:
        ids = event_ids(table) if table is not None and table.num_rows else ["?"]
        return ComplianceError(
            f"frame text de-identification failed ({type(exc).__name__}) in the table starting at event "
            f"{ids[0]}; its frames and those held back before it are withheld, not written raw",
            source_uri=first_str(table, "source_uri") if table is not None else None,
            stage=self.kind,
        )

    def _add(self, table: pa.Table, frames: pa.ExtensionArray) -> None:
        """OCR this table's grid samples, extend the held rows by it and emit what is final."""
        cfg = self.config
        stream, first, last = stream_span(table)
        st = self._state
        if st is not None:
            later = st.last_order is None or first is None or first > st.last_order
            if st.stream != stream or not later:  # another stream, not flushed: its rows must not go out here
                dropped = (0 if st.held is None else st.held.num_rows) + sum(t.num_rows for t in self._done)
                if dropped:
                    log.warning("frame_text: %d held frame(s) of %s dropped (withheld): the stream was not flushed",
                                dropped, st.stream)
                self._done.clear()
                st = self._state = None
            elif not st.schema.equals(table.schema, check_metadata=False):
                self._finish_segment()  # a new frame shape: the held frames end their segment
                st.schema, st.last_step, st.ref = table.schema, None, None  # the next segment starts afresh
        if st is None:
            st = self._state = _Stream(stream=stream, schema=table.schema)
        st.last_order = last if last is not None else st.last_order

        h, w = int(frames.type.shape[0]), int(frames.type.shape[1])
        imgs, valid = tensor_view(frames)
        ids = event_ids(table)
        t_ns = table.column("t_ns").to_numpy(zero_copy_only=False) if "t_ns" in table.column_names else None
        samples, st.last_step = sample_rows(t_ns, valid, cfg.ocr_fps, st.last_step)

        held_n = 0 if st.held is None else st.held.num_rows
        rows = table if st.held is None else pa.concat_tables([st.held, table])  # zero-copy; metadata: the first's
        ok = st.valid + [bool(v) for v in valid]
        boxes = st.boxes + [[] for _ in range(len(frames))]
        prev = 0 if st.sample is not None else None  # position of the last sample in ``rows``
        for r in samples:
            cur = self._read(imgs[r], ids[r], table)
            found = self._detect(st.sample, cur, w, h)
            p = held_n + r
            for j in range(p if prev is None else prev, p + 1):  # the pair's boxes, both samples included
                if ok[j]:
                    boxes[j].extend(found)
            prev, st.sample = p, cur
        cut = len(ok) if prev is None else prev  # no sample yet: only null frames so far, all final
        if cut:
            self._emit(rows.slice(0, cut), boxes[:cut])
        st.held = rows.slice(cut) if cut < len(ok) else None
        st.valid, st.boxes = ok[cut:], boxes[cut:]

    def _finish_segment(self) -> None:
        """End of a stream or of a frame shape: OCR the last valid held frame (when it is not
        the last sample already) as a final sample, then emit every held frame."""
        st = self._state
        if st is None or st.held is None:
            return
        held = st.held
        q = max(j for j, v in enumerate(st.valid) if v) if any(st.valid) else 0
        if q > 0 and st.sample is not None:
            frames = frame_array(held)
            imgs, _ = tensor_view(frames)
            h, w = int(frames.type.shape[0]), int(frames.type.shape[1])
            found = self._detect(st.sample, self._read(imgs[q], event_ids(held)[q], held), w, h)
            for j in range(q + 1):
                if st.valid[j]:
                    st.boxes[j].extend(found)
        self._emit(held, st.boxes)
        st.held, st.valid, st.boxes, st.sample = None, [], [], None

    def _emit(self, rows: pa.Table, boxes: list[list[BoxT]]) -> None:
        """Anonymise ``rows`` (final boxes) into a new frame buffer; queue the output table."""
        frames = frame_array(rows)
        imgs, valid = tensor_view(frames)
        applied = [merge_boxes(b) if valid[i] else [] for i, b in enumerate(boxes)]
        if any(applied):
            ids = event_ids(rows)
            out = imgs.copy()  # new buffer: the input's (read-only) Arrow buffer is never written
            for i, bs in enumerate(applied):
                for b in bs:
                    anonymise_region(out[i], b, self._secret, ids[i] + SALT_SUFFIX, self.config.blur_sigma_ratio)
            frames = frames_like(frames, out, valid)
        self._done.append(self._assemble(rows, frames, applied, method=METHOD))

    def _read(self, rgb: np.ndarray, event_id: str, table: pa.Table) -> _Sample:
        """OCR one sample into its blocks' texts and word spans."""
        texts, spans = [], []
        for block in _group_blocks(self._words(rgb, event_id, table)):
            text, sp = _block_text(block)
            texts.append(text)
            spans.append(sp)
        return _Sample(texts, spans)

    def _detect(self, prev: _Sample | None, cur: _Sample, w: int, h: int) -> list[BoxT]:
        """Boxes of the personal data in a pair of consecutive samples (one ``detect_batch``
        over the blocks of both, so a name found in one is searched for in the other)."""
        cfg = self.config
        pair = [s for s in (prev, cur) if s is not None]
        texts = [t for s in pair for t in s.texts]
        spans = [sp for s in pair for sp in s.spans]
        out: list[BoxT] = []
        if texts:
            key = tuple(texts)
            if self._found is None or self._found[0] != key:  # a pure function of the texts: a pair of
                # samples that read what the last pair read (a static slide: reused OCR) gets its answer
                self._found = (key, detect_batch(texts, cfg.entities, cfg.min_score, cfg.min_scores))
            for sp, pii in zip(spans, self._found[1]):
                for span in pii:
                    out.extend(_span_boxes(sp, span.start, span.end, float(span.score), cfg.pad_px, w, h))
        return out

    def _words(self, rgb: np.ndarray, event_id: str, table: pa.Table) -> list[tuple[tuple[int, int, int], OcrWord]]:
        """The sample's words: those of the stream's last OCRed sample when no thumbnail cell
        changed by ``reuse_threshold`` or more since it (see "Reuse"), else a new OCR."""
        thr, st = self.config.reuse_threshold, self._state
        if not thr or st is None:
            return self._ocr(rgb, event_id, table)
        thumb = change_thumbnail(rgb)
        if st.ref is None or st.ref[0].shape != thumb.shape:
            words = self._ocr(rgb, event_id, table)
            st.ref = (thumb, words)
            return words
        ref_thumb, ref_words = st.ref
        changed = np.abs(ref_thumb - thumb) >= thr
        if not changed.any():
            return ref_words
        h, w = rgb.shape[:2]
        x0, y0, x1, y1 = reread_rect(changed, w, h)
        if (x1 - x0) * (y1 - y0) > REREAD_MAX_PART * w * h or _text_blocks_touch(ref_words, (x0, y0, x1, y1)):
            words = self._ocr(rgb, event_id, table)  # read text changed, or most of the frame: all of it again
            st.ref = (thumb, words)
            return words
        scale = ocr_scale_for(w, h, self.config.ocr_scale, self.config.ocr_max_pixels)  # the frame's, not the crop's
        kept = [(k, wd) for k, wd in ref_words if not _touches(wd, (x0, y0, x1, y1))]  # stray marks: read again
        base = 1 + max((k[0] for k, _ in kept), default=0)
        read = [((base + b, p, ln), OcrWord(wd.text, wd.x0 + x0, wd.y0 + y0, wd.x1 + x0, wd.y1 + y0, wd.conf))
                for (b, p, ln), wd in self._ocr(rgb[y0:y1, x0:x1], event_id, table, scale=scale)]
        words = kept + read
        new_thumb = ref_thumb.copy()  # cells outside the rectangle keep the reference they were last read at
        c = REUSE_CELL
        new_thumb[y0 // c : -(-y1 // c), x0 // c : -(-x1 // c)] = thumb[y0 // c : -(-y1 // c), x0 // c : -(-x1 // c)]
        st.ref = (new_thumb, words)
        return words

    def _ocr(self, rgb: np.ndarray, event_id: str, table: pa.Table,
             scale: float | None = None) -> list[tuple[tuple[int, int, int], OcrWord]]:
        """Words tesseract reads in one frame or part of one (boxes in its pixels), upscaled by
        ``scale`` (None: the frame's own, ``ocr_scale_for``); ComplianceError if it fails."""
        cfg = self.config
        if scale is None:
            scale = ocr_scale_for(rgb.shape[1], rgb.shape[0], cfg.ocr_scale, cfg.ocr_max_pixels)
        if self._api is not None:
            return self._ocr_library(rgb, scale, event_id, table)
        pgm = encode_pgm(rgb, scale)
        cmd = [self._tesseract or "tesseract", "stdin", "stdout", "-l", cfg.lang, "--psm", str(cfg.psm),
               "--dpi", str(int(round(72 * scale))), "tsv"]
        why = None
        try:
            proc = run_limited(cmd, input=pgm, timeout=cfg.ocr_timeout_s, memory_mb=cfg.subprocess_memory_mb,
                               env=self._env)
        except subprocess.TimeoutExpired:
            why = f"OCR ran over {cfg.ocr_timeout_s:.0f} s"
        except OSError as exc:
            why = f"tesseract could not start ({type(exc).__name__})"
        else:
            if proc.returncode != 0:
                why = (f"OCR hit the memory ceiling of {cfg.subprocess_memory_mb} MB" if out_of_memory(proc)
                       else f"tesseract exited with {proc.returncode}")
        if why is not None:
            raise self._ocr_failed(why, event_id, table)
        return parse_tsv(proc.stdout, scale, cfg.min_conf)

    def _ocr_library(self, rgb: np.ndarray, scale: float, event_id: str,
                     table: pa.Table) -> list[tuple[tuple[int, int, int], OcrWord]]:
        """``_ocr`` through libtesseract in this process (engine library)."""
        cfg, api = self.config, self._api
        gray = ocr_gray(rgb, scale)
        h, w = gray.shape
        api.SetImageBytes(gray.tobytes(), w, h, 1, w)
        api.SetSourceResolution(int(round(72 * scale)))
        if not api.Recognize(timeout=max(1, int(cfg.ocr_timeout_s * 1000))):  # 0 would mean none
            api.Clear()
            raise self._ocr_failed(f"OCR failed or ran over {cfg.ocr_timeout_s:.0f} s", event_id, table)
        tsv = api.GetTSVText(0)  # the CLI's TSV rows without its header (the page row comes first)
        api.Clear()
        return parse_tsv(tsv.encode("utf-8"), scale, cfg.min_conf, header=False)

    def _ocr_failed(self, why: str, event_id: str, table: pa.Table) -> ComplianceError:
        return ComplianceError(
            f"{why} on event {event_id}; the frames of this table and those held back before it are withheld, "
            "not written raw",
            source_uri=first_str(table, "source_uri"),
            stage=self.kind,
        )

    def _assemble(self, table: pa.Table, frames: pa.Array, applied: list[list[BoxT]], method: str) -> pa.Table:
        header = {"policy": self.config.policy_tag, "method": method, "detector": self.detector_name,
                  "threshold": self.config.min_score}
        return with_regions(table, frames, applied, header, TEXT_BOXES, TEXT_DEID)



# -- the sampling grid ------------------------------------------------------------------------
def grid_step(t_ns: int, ocr_fps: float | Fraction) -> int:
    """Index ``k`` of the OCR grid step ``[k / ocr_fps, (k + 1) / ocr_fps)`` holding ``t_ns``
    (exact rational arithmetic: the same time always falls in the same step)."""
    return math.floor(int(t_ns) * Fraction(ocr_fps) / NS_PER_S)


def sample_rows(t_ns: np.ndarray | None, valid: np.ndarray, ocr_fps: float,
                last_step: int | None = None) -> tuple[list[int], int | None]:
    """Rows to OCR and the grid step of the last valid row: a valid row is sampled when it is
    the first at or after a new ``1/ocr_fps`` step of the stream, ``last_step`` being the step
    of the stream's previous valid row (None: none yet). Without ``t_ns`` every valid row is
    sampled (the step counts valid rows)."""
    fps = Fraction(ocr_fps)
    picked = []
    for i in range(len(valid)):
        if not valid[i]:
            continue
        step = (last_step + 1 if last_step is not None else 0) if t_ns is None else grid_step(int(t_ns[i]), fps)
        if last_step is None or step > last_step:
            picked.append(i)
        last_step = step if last_step is None else max(step, last_step)
    return picked, last_step


def merge_boxes(boxes: list[BoxT]) -> list[BoxT]:
    """Union near-identical boxes (IoU > MERGE_IOU, or one inside the other); others stay apart
    so that two PII lines do not grow into one box over the non-PII text between them."""
    boxes = sorted(set(boxes))
    changed = True
    while changed and len(boxes) > 1:
        changed = False
        for i in range(len(boxes)):
            for j in range(i + 1, len(boxes)):
                a, b = boxes[i], boxes[j]
                ix = max(0, min(a[2], b[2]) - max(a[0], b[0]))
                iy = max(0, min(a[3], b[3]) - max(a[1], b[1]))
                inter = ix * iy
                if inter == 0:
                    continue
                aa = (a[2] - a[0]) * (a[3] - a[1])
                ab = (b[2] - b[0]) * (b[3] - b[1])
                if inter / (aa + ab - inter) > MERGE_IOU or inter >= 0.95 * min(aa, ab):
                    u = (min(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), max(a[3], b[3]), max(a[4], b[4]))
                    boxes = [x for m, x in enumerate(boxes) if m not in (i, j)] + [u]
                    changed = True
                    break
            if changed:
                break
    return sorted(boxes)


# -- the change test ------------------------------------------------------------------------
def change_thumbnail(rgb: np.ndarray) -> np.ndarray:
    """Grayscale (BT.601) means of ``REUSE_CELL`` x ``REUSE_CELL`` pixel cells, rounded, as int16
    (differences do not wrap); a partial edge cell repeats the edge pixels, so every pixel counts."""
    import cv2

    gray = cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2GRAY)
    h, w = gray.shape
    ch, cw = -(-h // REUSE_CELL), -(-w // REUSE_CELL)
    pad = np.pad(gray, ((0, ch * REUSE_CELL - h), (0, cw * REUSE_CELL - w)), mode="edge")
    return pad.reshape(ch, REUSE_CELL, cw, REUSE_CELL).mean(axis=(1, 3), dtype=np.float32).round().astype(np.int16)


def reread_rect(changed: np.ndarray, w: int, h: int) -> tuple[int, int, int, int]:
    """Pixel rectangle (x0, y0, x1, y1, on the cell grid, inside the frame) around the changed
    cells: their bounding box, ``REREAD_MARGIN_PX`` wider on each side."""
    ys, xs = np.nonzero(changed)
    c, m = REUSE_CELL, REREAD_MARGIN_PX
    return (max(0, (int(xs.min()) * c - m) // c * c), max(0, (int(ys.min()) * c - m) // c * c),
            min(w, (int(xs.max()) + 1) * c + m), min(h, (int(ys.max()) + 1) * c + m))


def _touches(wd: OcrWord, rect: tuple[int, int, int, int]) -> bool:
    return wd.x0 < rect[2] and wd.x1 > rect[0] and wd.y0 < rect[3] and wd.y1 > rect[1]


def _text_blocks_touch(words: list[tuple[tuple[int, int, int], OcrWord]], rect: tuple[int, int, int, int]) -> bool:
    """Whether ``rect`` touches a block of read text: one holding a word with 3 letters or digits
    in a row (tesseract also "reads" marks such as ``>.`` or ``we'`` in a face or a plant)."""
    text = {k[0] for k, wd in words if _WORDLIKE.search(wd.text)}
    boxes: dict[int, list[int]] = {}
    for (b, _, _), wd in words:
        if b in text:
            bb = boxes.setdefault(b, [wd.x0, wd.y0, wd.x1, wd.y1])
            bb[0], bb[1], bb[2], bb[3] = min(bb[0], wd.x0), min(bb[1], wd.y0), max(bb[2], wd.x1), max(bb[3], wd.y1)
    return any(x0 < rect[2] and x1 > rect[0] and y0 < rect[3] and y1 > rect[1] for x0, y0, x1, y1 in boxes.values())


def max_cell_change(a: np.ndarray, b: np.ndarray) -> int:
    """The largest absolute difference between two thumbnails, over all cells."""
    return int(np.abs(a - b).max()) if a.size else 0


# -- OCR helpers ------------------------------------------------------------------------------
def ocr_scale_for(w: int, h: int, scale: float, max_pixels: int) -> float:
    """``scale``, lowered so that the upscaled image has at most ``max_pixels``; never below 1."""
    return max(1.0, min(scale, math.sqrt(max_pixels / max(1, w * h))))


def ocr_gray(rgb: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """What tesseract reads of a frame: grayscale (BT.601 luma), upscaled by ``scale`` (cubic)."""
    import cv2

    gray = cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2GRAY)
    if scale != 1.0:
        gray = cv2.resize(gray, None, fx=scale, fy=scale, interpolation=cv2.INTER_CUBIC)
    return gray


def encode_pgm(rgb: np.ndarray, scale: float = 1.0) -> bytes:
    """Binary PGM (P5) of ``ocr_gray(rgb, scale)``: the tesseract binary's stdin."""
    gray = ocr_gray(rgb, scale)
    h, w = gray.shape
    return b"P5\n%d %d\n255\n" % (w, h) + gray.tobytes()


def tessdata_dir(tesseract: str | None) -> str | None:
    """The folder of the installed language data: ``$TESSDATA_PREFIX``, else where the tesseract
    binary says it reads it (``--list-langs``), else None (libtesseract's own default)."""
    if os.environ.get("TESSDATA_PREFIX"):
        return os.environ["TESSDATA_PREFIX"]
    try:
        out = subprocess.run([tesseract or "tesseract", "--list-langs"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r'languages in "([^"]+)"', out.stdout + out.stderr)
    return m.group(1) if m else None


def open_library(lang: str, psm: int, tessdata: str | None) -> tuple[Any, str]:
    """(an initialised ``tesserocr.PyTessBaseAPI``, its libtesseract version); raises
    ``DependencyMissingError`` when tesserocr or the language data is not there."""
    tesserocr = require("tesserocr")
    try:
        api = tesserocr.PyTessBaseAPI(**({"path": tessdata} if tessdata else {}), lang=lang,
                                      psm=psm, oem=tesserocr.OEM.DEFAULT)
    except RuntimeError:
        raise missing("tesserocr", what=f"libtesseract with the language data {lang!r} (tessdata {tessdata})") from None
    m = re.search(r"tesseract\s+v?(\S+)", tesserocr.tesseract_version())
    return api, m.group(1) if m else "?"


def parse_tsv(tsv: bytes, scale: float, min_conf: float,
              header: bool = True) -> list[tuple[tuple[int, int, int], OcrWord]]:
    """Words of a tesseract TSV with their (block, paragraph, line) key; boxes divided by ``scale``
    (outward rounding) into frame pixels. ``header``: the first line is the column names (the
    binary's output; libtesseract's ``GetTSVText`` has none)."""
    out = []
    for row in tsv.decode("utf-8", "replace").splitlines()[1 if header else 0:]:
        cols = row.split("\t", 11)
        if len(cols) < 12 or cols[0] != "5" or not cols[11].strip():
            continue
        conf = float(cols[10])
        if conf < min_conf:
            continue
        x, y, bw, bh = (int(c) for c in cols[6:10])
        word = OcrWord(cols[11].strip(), int(math.floor(x / scale)), int(math.floor(y / scale)),
                       int(math.ceil((x + bw) / scale)), int(math.ceil((y + bh) / scale)), conf)
        out.append(((int(cols[2]), int(cols[3]), int(cols[4])), word))
    return out


def _group_blocks(words: list[tuple[tuple[int, int, int], OcrWord]]) -> list[list[list[OcrWord]]]:
    """Blocks (tesseract's) of lines of words, in reading order."""
    blocks: dict[int, dict[tuple[int, int], list[OcrWord]]] = {}
    for (b, p, ln), word in words:
        blocks.setdefault(b, {}).setdefault((p, ln), []).append(word)
    return [list(lines.values()) for lines in blocks.values()]


def _block_text(lines: list[list[OcrWord]]) -> tuple[str, list[tuple[int, int, int, OcrWord]]]:
    """The block's text (words joined by spaces, lines by newlines) and each word's
    (start, end, line number, word) in that text."""
    parts: list[str] = []
    spans: list[tuple[int, int, int, OcrWord]] = []
    pos = 0
    for ln, line in enumerate(lines):
        if ln:
            parts.append("\n")
            pos += 1
        for k, word in enumerate(line):
            if k:
                parts.append(" ")
                pos += 1
            parts.append(word.text)
            spans.append((pos, pos + len(word.text), ln, word))
            pos += len(word.text)
    return "".join(parts), spans


def _span_boxes(spans: list[tuple[int, int, int, OcrWord]], start: int, end: int, score: float, pad: int,
                w: int, h: int) -> list[BoxT]:
    """One padded box per line touched by the character span ``[start, end)``: the union of
    the boxes of the words it overlaps (a partly covered word is covered whole)."""
    per_line: dict[int, list[int]] = {}
    for s, e, ln, word in spans:
        if s < end and e > start:
            cur = per_line.get(ln)
            if cur is None:
                per_line[ln] = [word.x0, word.y0, word.x1, word.y1]
            else:
                cur[0], cur[1] = min(cur[0], word.x0), min(cur[1], word.y0)
                cur[2], cur[3] = max(cur[2], word.x1), max(cur[3], word.y1)
    out = []
    for x0, y0, x1, y1 in per_line.values():
        bx0, by0 = max(0, x0 - pad), max(0, y0 - pad)
        bx1, by1 = min(w, x1 + pad), min(h, y1 + pad)
        if bx1 > bx0 and by1 > by0:
            out.append((bx0, by0, bx1, by1, score))
    return out


__all__ = ["FrameTextConfig", "FrameTextOperator", "change_thumbnail", "config_from_policy", "encode_pgm", "grid_step",
           "max_cell_change", "merge_boxes", "ocr_scale_for", "parse_tsv", "sample_rows"]
