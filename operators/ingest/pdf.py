"""PDF ingest: render each page, OCR it, and emit text blocks timed by the page schedule.

First stage of the document path (source -> page render -> OCR blocks -> PII pseudonymise
-> embed). Pages are processed one at a time (pdf2image renders page i alone, greyscale,
in memory; tesseract reads it from stdin and writes TSV to stdout), so memory holds one
page image and no page image or OCR text ever touches the disk. pytesseract is not used
because it round-trips both through temporary files.

Timing (sample-and-hold): page i is shown from ``t_ns`` until the next page's ``t_ns``
(``end_t_ns``; None for the last page). With ``spec.page_schedule_ns`` page i starts at
``schedule[i]`` (local ns, mapped by the source clock; ``timing="schedule"``); without a
schedule page i starts at ``i * page_duration_ns``; pages past the end of a short schedule
follow the last scheduled page every ``page_duration_ns`` (``timing="sequential"``).

A failed page (timeout, over the pixel limit, OCR error) does not stop the others: the
good pages are yielded, then one ``InputError`` lists the failed page indices and spans
their time range. Extraction is per page behind ``_extract`` so a text-layer fast path
for born-digital PDFs can be added there (``extraction="text_layer"``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from io import BytesIO
from typing import Any

import pyarrow as pa

from operators.base import OperatorConfig
from operators.ingest.base import SourceContext, SourceOperator, event_id
from pipeline.errors import (DependencyMissingError, InputError, InputTimeoutError, LimitExceededError,
                             UnreadableInputError)
from schemas.tables import LineageColumns, TextBlockRow

MAX_BLOCKS_PER_PAGE = 1000  # event index = page * 1000 + block


class PdfTextConfig(OperatorConfig):
    """Render/OCR settings and per-document / per-page limits (timeouts in seconds)."""

    dpi: int = 200
    lang: str = "eng"
    max_pages: int = 500
    render_timeout_s: float = 60
    ocr_timeout_s: float = 120
    max_page_pixels: int = 10000 * 10000


def pdf_text_schema() -> pa.Schema:
    """``TextBlockRow``'s columns minus the lineage columns and ``deid`` (added downstream)."""
    drop = set(LineageColumns.model_fields) | {"deid"}
    full = TextBlockRow.schema()
    return pa.schema([f for f in full if f.name not in drop], metadata=full.metadata)


@dataclass
class Block:
    """One text block of a page: its lines of words (``schemas.tables.Word`` dicts)."""

    lines: list[list[dict[str, Any]]] = field(default_factory=list)

    @property
    def words(self) -> list[dict[str, Any]]:
        return [w for line in self.lines for w in line]


@dataclass(frozen=True)
class PageTime:
    t_ns: int
    end_t_ns: int | None
    timing: str


def page_times(ctx: SourceContext, n_pages: int) -> list[PageTime]:
    """Session start/end of each page (see the module docstring for the rules)."""
    spec, clock = ctx.spec, ctx.clock
    sched = spec.page_schedule_ns or []
    local, timing = [], []
    for i in range(n_pages):
        scheduled = i < len(sched)
        if scheduled:
            local.append(sched[i])
        elif sched:
            local.append(sched[-1] + (i - len(sched) + 1) * spec.page_duration_ns)
        else:
            local.append(i * spec.page_duration_ns)
        timing.append("schedule" if scheduled else "sequential")
    starts = [clock.to_session(t) for t in local]
    return [PageTime(s, starts[i + 1] if i + 1 < n_pages else None, timing[i]) for i, s in enumerate(starts)]


class PdfTextOperator(SourceOperator[PdfTextConfig]):
    """OCRs a PDF page by page into text blocks with word boxes and confidences."""

    kind = "pdf_text"
    version = "0.1.0"
    modality = "pdf"
    config_model = PdfTextConfig

    def output_schema(self) -> pa.Schema:
        return pdf_text_schema()

    def setup(self) -> None:
        import pdf2image  # noqa: F401

        self._tesseract = shutil.which("tesseract")
        if self._tesseract is None:
            raise DependencyMissingError("the tesseract binary", apt="tesseract-ocr tesseract-ocr-eng")
        langs = subprocess.run([self._tesseract, "--list-langs"], capture_output=True, text=True, timeout=30).stdout
        if self.config.lang not in langs.split():
            raise DependencyMissingError(f"tesseract language data {self.config.lang!r}",
                                         apt=f"tesseract-ocr-{self.config.lang}")
        self._env = {**os.environ, "OMP_THREAD_LIMIT": "1"}  # tesseract's own threads are slower here
        self._ready = True

    def read(self, ctx: SourceContext) -> Iterator[pa.Table]:
        self.ensure_setup()
        sizes = self._page_sizes(ctx)
        times = page_times(ctx, len(sizes))
        failures: list[tuple[int, InputError]] = []
        for i, size in enumerate(sizes):
            try:
                blocks, extraction = self._extract(ctx, i, size)
            except InputError as e:
                failures.append((i, e))
                continue
            if blocks:
                yield self._table(ctx, i, times[i], blocks, extraction)
        if failures:
            raise self._failure(ctx, failures, times)

    # ---- document and page steps -----------------------------------------------------

    def _err(self, cls: type[InputError], ctx: SourceContext, msg: str, code: str, page: int | None = None,
             **kw: Any) -> InputError:
        where = "" if page is None else f"page_index {page}: "
        return cls(where + msg, source_uri=ctx.uri, stage=self.kind, code=code, **kw)

    def _page_sizes(self, ctx: SourceContext) -> list[tuple[float, float] | None]:
        """Page sizes in points (None where pdfinfo gives none); the length is the page count."""
        from pdf2image import pdfinfo_from_path
        from pdf2image.exceptions import PDFInfoNotInstalledError, PDFPopplerTimeoutError

        path, cfg = ctx.path, self.config
        if not path.is_file():
            raise self._err(UnreadableInputError, ctx, "file not found; check the manifest path", "file_missing")
        with open(path, "rb") as f:
            head = f.read(1024)
        if b"%PDF-" not in head:
            raise self._err(UnreadableInputError, ctx, "not a PDF (no %PDF header); check the file", "not_pdf")
        try:
            # one call: the page count and each page's size (pdfinfo clamps the range to the document)
            info = pdfinfo_from_path(str(path), timeout=cfg.render_timeout_s, first_page=1,
                                     last_page=cfg.max_pages + 1)
            n = int(info["Pages"])
            if n > cfg.max_pages:
                raise self._err(LimitExceededError, ctx, f"{n} pages, over max_pages={cfg.max_pages}; split the "
                                "document or raise the limit", "pages_exceeded")
        except PDFInfoNotInstalledError:
            raise DependencyMissingError("poppler's pdfinfo", apt="poppler-utils") from None
        except PDFPopplerTimeoutError:
            raise self._err(InputTimeoutError, ctx, f"pdfinfo ran over {cfg.render_timeout_s:.0f} s", "info_timeout") from None
        except InputError:
            raise
        except Exception as e:  # pdf2image raises plain Exception subclasses with poppler's stderr
            if "password" in str(e).lower():
                raise self._err(UnreadableInputError, ctx, "the PDF is encrypted; supply an unencrypted copy",
                                "pdf_encrypted") from None
            raise self._err(UnreadableInputError, ctx, "corrupt or unreadable PDF; re-export it", "pdf_corrupt") from None
        if n == 0:
            raise self._err(UnreadableInputError, ctx, "the PDF has no pages", "pdf_empty")
        return [_points(info.get(f"Page {i + 1:4d} size")) for i in range(n)]

    def _extract(self, ctx: SourceContext, page: int, size: tuple[float, float] | None) -> tuple[list[Block], str]:
        """Blocks of one page and how they were extracted (the place for a text-layer path)."""
        cfg = self.config
        if size is not None:
            pixels = (size[0] * cfg.dpi / 72) * (size[1] * cfg.dpi / 72)
            if pixels > cfg.max_page_pixels:
                raise self._err(LimitExceededError, ctx, f"renders to {pixels:.0f} px at {cfg.dpi} dpi, over "
                                f"max_page_pixels={cfg.max_page_pixels}; lower dpi or raise the limit",
                                "page_too_large", page)
        image = self._render(ctx, page)
        return self._ocr(ctx, page, image), "ocr"

    def _render(self, ctx: SourceContext, page: int) -> Any:
        from pdf2image import convert_from_path
        from pdf2image.exceptions import PDFPopplerTimeoutError

        cfg = self.config
        try:
            images = convert_from_path(str(ctx.path), dpi=cfg.dpi, first_page=page + 1, last_page=page + 1,
                                       grayscale=True, timeout=cfg.render_timeout_s)
        except PDFPopplerTimeoutError:
            raise self._err(InputTimeoutError, ctx, f"rendering ran over {cfg.render_timeout_s:.0f} s",
                            "render_timeout", page) from None
        except Exception:
            images = []
        if not images:
            raise self._err(UnreadableInputError, ctx, "the page could not be rendered", "render_failed", page)
        return images[0]

    def _ocr(self, ctx: SourceContext, page: int, image: Any) -> list[Block]:
        """Tesseract TSV of one page image (stdin -> stdout), grouped by block, then line."""
        cfg = self.config
        buf = BytesIO()
        image.save(buf, format="PPM")  # greyscale -> PGM, read by tesseract from stdin
        cmd = [self._tesseract, "stdin", "stdout", "-l", cfg.lang, "--dpi", str(cfg.dpi), "tsv"]
        try:
            proc = subprocess.run(cmd, input=buf.getvalue(), capture_output=True, timeout=cfg.ocr_timeout_s,
                                  env=self._env)
        except subprocess.TimeoutExpired:
            raise self._err(InputTimeoutError, ctx, f"OCR ran over {cfg.ocr_timeout_s:.0f} s", "ocr_timeout",
                            page) from None
        if proc.returncode != 0:
            raise self._err(UnreadableInputError, ctx, f"tesseract exited with {proc.returncode}", "ocr_failed", page)
        blocks: dict[int, dict[tuple[int, int], list[dict[str, Any]]]] = {}
        for row in proc.stdout.decode("utf-8", "replace").splitlines()[1:]:
            cols = row.split("\t", 11)
            if len(cols) < 12 or cols[0] != "5" or not cols[11].strip() or float(cols[10]) < 0:
                continue
            x, y, w, h = (int(c) for c in cols[6:10])
            word = {"text": cols[11].strip(), "x0": x, "y0": y, "x1": x + w, "y1": y + h,
                    "conf": float(cols[10]), "entity": None}
            blocks.setdefault(int(cols[2]), {}).setdefault((int(cols[3]), int(cols[4])), []).append(word)
        if len(blocks) > MAX_BLOCKS_PER_PAGE:
            raise self._err(LimitExceededError, ctx, f"{len(blocks)} text blocks, over {MAX_BLOCKS_PER_PAGE}",
                            "blocks_exceeded", page)
        return [Block(list(lines.values())) for lines in blocks.values()]

    def _table(self, ctx: SourceContext, page: int, time: PageTime, blocks: list[Block], extraction: str) -> pa.Table:
        rows = []
        for b, block in enumerate(blocks):
            words = block.words
            box = {"x0": min(w["x0"] for w in words), "y0": min(w["y0"] for w in words),
                   "x1": max(w["x1"] for w in words), "y1": max(w["y1"] for w in words),
                   "score": sum(w["conf"] for w in words) / len(words) / 100}  # mean word confidence, 0..1
            rows.append({
                "event_id": event_id(ctx.session_id, ctx.spec.id, "block", page * MAX_BLOCKS_PER_PAGE + b),
                "t_ns": time.t_ns, "end_t_ns": time.end_t_ns, "page_index": page, "block_index": b,
                "text": "\n".join(" ".join(w["text"] for w in line) for line in block.lines),
                "words": words, "box": box, "extraction": extraction, "dpi": self.config.dpi,
                "timing": time.timing,
            })
        return pa.Table.from_pylist(rows, schema=pdf_text_schema())

    def _failure(self, ctx: SourceContext, failures: list[tuple[int, InputError]], times: list[PageTime]) -> InputError:
        """One error for all failed pages, spanning their time range; never their content."""
        classes = {type(e) for _, e in failures}
        codes = sorted({e.code for _, e in failures})
        cls = classes.pop() if len(classes) == 1 else InputError
        pages = [i for i, _ in failures]
        ends = [times[i].end_t_ns for i in pages]
        good = len(times) - len(pages)
        return cls(f"page_index {', '.join(map(str, pages))} failed ({', '.join(codes)}); {good} other page(s) "
                   "ingested", source_uri=ctx.uri, stage=self.kind,
                   code=codes[0] if len(codes) == 1 else "pages_failed", start_t_ns=times[pages[0]].t_ns,
                   end_t_ns=None if None in ends else max(ends))


def _points(size: str | None) -> tuple[float, float] | None:
    """'595.276 x 841.89 pts (A4)' -> (595.276, 841.89)."""
    try:
        w, _, h = (size or "").split()[:3]
        return float(w), float(h)
    except ValueError:
        return None
