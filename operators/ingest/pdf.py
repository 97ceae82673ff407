"""PDF ingest: text blocks with word boxes per page, from the text layer or by OCR.

First stage of the document path (source -> page text -> PII pseudonymise -> embed).

Per page, cheapest path first (``extraction`` column):

- ``text_layer``: a born-digital page (at least ``text_layer_min_chars`` non-space
  characters in its text layer) is read with poppler's ``pdftotext -bbox-layout`` (XHTML
  on stdout): blocks, lines and words with boxes, no rendering, no OCR. Boxes are scaled
  from PDF points to pixels at ``dpi`` (``px = pt * dpi / 72``), so they are comparable to
  OCR boxes of the same page; word ``conf`` is 100. Words outside the page box are dropped.
  Text inside images is not read on this path.
- ``ocr``: other pages are rendered (``pdftoppm``, greyscale PGM on stdout) and read by
  tesseract (PGM on stdin, TSV on stdout). Neither the page image nor the text ever
  touches the disk; pytesseract/pdf2image are not used as they round-trip through files.

Pages run ``ocr_workers`` at a time (threads driving the subprocesses, where the work
is); at most ``ocr_workers`` pages are in flight, and pages are yielded in page order.

Limits, checked before the expensive step: ``max_pages`` (pdfinfo, before any page),
``max_page_pixels`` (page size from pdfinfo x dpi, before any extraction), and
``max_image_pixels`` (declared size of each embedded image, from ``pdfimages -list``,
before rendering: a decompression bomb is never decoded). Every poppler/tesseract process
runs under an address-space ceiling (``subprocess_memory_mb``, RLIMIT_AS set by ``ulimit -v``
in a ``sh`` that then execs the tool; ``preexec_fn`` is not thread-safe; see
``modalign.operators.sandbox``) and a timeout (``render_timeout_s`` for poppler,
``ocr_timeout_s`` for tesseract).

Timing (sample-and-hold): page i is shown from ``t_ns`` until the next page's ``t_ns``
(``end_t_ns``; None for the last page). With ``spec.page_schedule_ns`` page i starts at
``schedule[i]`` (local ns, mapped by the source clock; ``timing="schedule"``); without a
schedule page i starts at ``i * page_duration_ns``; pages past the end of a short schedule
follow the last scheduled page every ``page_duration_ns`` (``timing="sequential"``).

Quality: each block's ``quality.ocr_confidence`` is the mean tesseract confidence of its words
(``modalign.operators.quality.text``; None for a text-layer block), taken before pseudonymisation.

Reason codes. Whole document (nothing yielded): ``file_missing``, ``not_pdf``,
``pdf_encrypted``, ``pdf_corrupt``, ``pdf_empty``, ``pages_exceeded``, ``info_timeout``.
Per page (the good pages are yielded, then one ``InputError`` lists the failed page
indices and spans their time range; one code if they agree, else ``pages_failed``):
``page_too_large`` / ``image_too_large`` / ``blocks_exceeded`` (LimitExceededError),
``memory_exceeded`` (LimitExceededError: a tool hit the memory ceiling),
``render_timeout`` / ``ocr_timeout`` (InputTimeoutError), ``render_failed`` /
``ocr_failed`` (UnreadableInputError).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from modalign.operators.dependencies import POPPLER_TOOLS, binary, require_tesseract_langs
from modalign.operators.ingest.base import SourceContext, SourceOperator, event_id
from modalign.operators.quality.text import ocr_confidence
from modalign.operators.sandbox import out_of_memory, run_limited
from modalign.schemas.errors import InputError, InputTimeoutError, LimitExceededError, UnreadableInputError
from modalign.schemas.config import PdfIngestConfig
from modalign.schemas.tables import LineageColumns, TextBlockRow

MAX_BLOCKS_PER_PAGE = 1000  # event index = page * 1000 + block
XHTML = "{http://www.w3.org/1999/xhtml}"
# Characters XML 1.0 forbids; a hostile text layer may contain them and break the parser.
_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")
_PGM_HEADER = re.compile(rb"P5\s+(\d+)\s+(\d+)\s+(\d+)\s")


# The operator's config is the run config's section: one declaration of every field.
PdfTextConfig = PdfIngestConfig


def pdf_text_schema() -> pa.Schema:
    """``TextBlockRow``'s columns minus the lineage columns and ``deid`` (added downstream)."""
    drop = set(LineageColumns.model_fields) | {"deid"}
    full = TextBlockRow.schema()
    return pa.schema([f for f in full if f.name not in drop], metadata=full.metadata)


@dataclass
class Block:
    """One text block of a page: its lines of words (``modalign.schemas.tables.Word`` dicts)."""

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
    """Text blocks of a PDF, page by page: text layer where present, else OCR."""

    kind = "pdf_text"
    version = "0.3.0"  # 0.3.0: the quality column
    modality = "pdf"
    config_model = PdfTextConfig

    def output_schema(self) -> pa.Schema:
        return pdf_text_schema()

    def setup(self) -> None:
        self._bin = {tool: binary(tool) for tool in (*POPPLER_TOOLS, "tesseract")}
        langs = subprocess.run([self._bin["tesseract"], "--list-langs"], capture_output=True, text=True,
                               timeout=30).stdout
        require_tesseract_langs(langs.split(), [self.config.lang])
        self._env = {**os.environ, "OMP_THREAD_LIMIT": "1"}  # tesseract's own threads are slower here
        self._ready = True

    def read(self, ctx: SourceContext) -> Iterator[pa.Table]:
        self.ensure_setup()
        sizes = self._page_sizes(ctx)
        images = self._image_pixels(ctx, len(sizes))
        times = page_times(ctx, len(sizes))
        failures: list[tuple[int, InputError]] = []
        work = lambda i: self._extract(ctx, i, sizes[i], images.get(i, 0))  # noqa: E731
        for i, result in self._in_page_order(len(sizes), work):
            if isinstance(result, InputError):
                failures.append((i, result))
            elif result[0]:
                yield self._table(ctx, i, times[i], *result)
        if failures:
            raise self._failure(ctx, failures, times)

    def _in_page_order(self, n: int, work: Callable[[int], Any]) -> Iterator[tuple[int, Any]]:
        """``(i, work(i) or its InputError)`` for i < n in order, ``ocr_workers`` at a time."""

        def safe(i: int) -> Any:
            try:
                return work(i)
            except InputError as e:
                return e

        workers = min(self.config.ocr_workers, n)
        if workers <= 1:
            for i in range(n):
                yield i, safe(i)
            return
        pool = ThreadPoolExecutor(workers, thread_name_prefix="pdf-page")
        inflight: deque = deque()
        try:
            for i in range(n):
                inflight.append((i, pool.submit(safe, i)))
                if len(inflight) == workers:  # bounded: wait for the oldest before submitting more
                    j, fut = inflight.popleft()
                    yield j, fut.result()
            while inflight:
                j, fut = inflight.popleft()
                yield j, fut.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    # ---- document steps --------------------------------------------------------------

    def _err(self, cls: type[InputError], ctx: SourceContext, msg: str, code: str, page: int | None = None,
             **kw: Any) -> InputError:
        where = "" if page is None else f"page_index {page}: "
        return cls(where + msg, source_uri=ctx.uri, stage=self.kind, code=code, **kw)

    def _poppler(self, tool: str, args: list[str], ctx: SourceContext, page: int | None = None,
                 timeout_code: str = "info_timeout") -> subprocess.CompletedProcess:
        cfg = self.config
        try:
            return run_limited([self._bin[tool], *args, str(ctx.path)] + (["-"] if tool == "pdftotext" else []),
                               timeout=cfg.render_timeout_s, memory_mb=cfg.subprocess_memory_mb)
        except subprocess.TimeoutExpired:
            raise self._err(InputTimeoutError, ctx, f"{tool} ran over {cfg.render_timeout_s:.0f} s", timeout_code,
                            page) from None

    def _page_sizes(self, ctx: SourceContext) -> list[tuple[float, float] | None]:
        """Page sizes in points as displayed (/Rotate applied; None where pdfinfo gives none);
        the length is the page count."""
        path, cfg = ctx.path, self.config
        if not path.is_file():
            raise self._err(UnreadableInputError, ctx, "file not found; check the manifest path", "file_missing")
        with open(path, "rb") as f:
            head = f.read(1024)
        if b"%PDF-" not in head:
            raise self._err(UnreadableInputError, ctx, "not a PDF (no %PDF header); check the file", "not_pdf")
        # one call: the page count and each page's size (pdfinfo clamps the range to the document)
        proc = self._poppler("pdfinfo", ["-f", "1", "-l", str(cfg.max_pages + 1)], ctx)
        if proc.returncode != 0:
            if b"password" in proc.stderr.lower():
                raise self._err(UnreadableInputError, ctx, "the PDF is encrypted; supply an unencrypted copy",
                                "pdf_encrypted")
            if out_of_memory(proc):
                raise self._err(LimitExceededError, ctx, f"pdfinfo hit the memory ceiling of "
                                f"{cfg.subprocess_memory_mb} MB", "memory_exceeded")
            raise self._err(UnreadableInputError, ctx, "corrupt or unreadable PDF; re-export it", "pdf_corrupt")
        info: dict[str, str] = {}
        for line in proc.stdout.decode("utf-8", "replace").splitlines():
            key, sep, value = line.partition(":")
            if sep:
                info[key.strip()] = value.strip()
        try:
            n = int(info["Pages"])
        except (KeyError, ValueError):
            raise self._err(UnreadableInputError, ctx, "corrupt or unreadable PDF; re-export it",
                            "pdf_corrupt") from None
        if n > cfg.max_pages:
            raise self._err(LimitExceededError, ctx, f"{n} pages, over max_pages={cfg.max_pages}; split the "
                            "document or raise the limit", "pages_exceeded")
        if n == 0:
            raise self._err(UnreadableInputError, ctx, "the PDF has no pages", "pdf_empty")
        sizes = []
        for i in range(n):
            size = _points(info.get(f"Page {i + 1:4d} size"))
            try:
                rot = int(info.get(f"Page {i + 1:4d} rot", "0")) % 360
            except ValueError:
                rot = 0
            if size is not None and rot in (90, 270):  # as displayed (and rendered, and in pdftotext boxes)
                size = (size[1], size[0])
            sizes.append(size)
        return sizes

    def _image_pixels(self, ctx: SourceContext, n: int) -> dict[int, int]:
        """Largest declared embedded-image area (px) per page index, read without decoding
        any image (``pdfimages -list``). Empty when the listing fails: the render then
        still runs under the memory ceiling."""
        proc = self._poppler("pdfimages", ["-list", "-f", "1", "-l", str(n)], ctx)
        out: dict[int, int] = {}
        if proc.returncode != 0:
            return out
        for line in proc.stdout.decode("ascii", "replace").splitlines()[2:]:
            cols = line.split()
            try:
                page, w, h = int(cols[0]), int(cols[3]), int(cols[4])
            except (IndexError, ValueError):
                continue
            out[page - 1] = max(out.get(page - 1, 0), w * h)
        return out

    # ---- page steps (run in worker threads) ------------------------------------------

    def _extract(self, ctx: SourceContext, page: int, size: tuple[float, float] | None,
                 image_pixels: int) -> tuple[list[Block], str]:
        """Blocks of one page and how they were extracted (``text_layer`` | ``ocr``)."""
        cfg = self.config
        if size is not None:
            pixels = (size[0] * cfg.dpi / 72) * (size[1] * cfg.dpi / 72)
            if pixels > cfg.max_page_pixels:
                raise self._err(LimitExceededError, ctx, f"page renders to {pixels:.0f} px at {cfg.dpi} dpi, over "
                                f"max_page_pixels={cfg.max_page_pixels}; lower dpi or raise the limit",
                                "page_too_large", page)
        if cfg.text_layer:
            blocks = self._text_layer(ctx, page, size)
            if blocks is not None:
                return blocks, "text_layer"
        if image_pixels > cfg.max_image_pixels:
            raise self._err(LimitExceededError, ctx, f"an embedded image declares {image_pixels} px, over "
                            f"max_image_pixels={cfg.max_image_pixels} (a decompression bomb?); the page is not "
                            "rendered", "image_too_large", page)
        return self._ocr(ctx, page, self._render(ctx, page)), "ocr"

    def _text_layer(self, ctx: SourceContext, page: int, size: tuple[float, float] | None) -> list[Block] | None:
        """Blocks from the page's text layer, or None when it has too little text (or
        pdftotext fails: the page is then OCRed)."""
        import xml.etree.ElementTree as ET

        cfg = self.config
        proc = self._poppler("pdftotext", ["-bbox-layout", "-f", str(page + 1), "-l", str(page + 1)], ctx, page,
                             timeout_code="render_timeout")
        if proc.returncode != 0:
            return None
        try:
            root = ET.fromstring(_XML_INVALID.sub("", proc.stdout.decode("utf-8", "replace")))
        except ET.ParseError:
            return None
        page_el = root.find(f".//{XHTML}page")
        if page_el is None:
            return None
        try:
            pw, ph = float(page_el.get("width", "inf")), float(page_el.get("height", "inf"))
        except ValueError:
            return None
        if size is not None:  # pdftotext gives the unrotated size but boxes in the displayed frame
            pw, ph = size
        scale = cfg.dpi / 72
        blocks, chars = [], 0
        for block in page_el.iter(f"{XHTML}block"):
            lines = []
            for line in block.iter(f"{XHTML}line"):
                words = []
                for w in line.iter(f"{XHTML}word"):
                    text = (w.text or "").strip()
                    try:
                        x0, y0, x1, y1 = (float(w.get(k, "nan")) for k in ("xMin", "yMin", "xMax", "yMax"))
                    except ValueError:
                        continue
                    x0, y0, x1, y1 = max(x0, 0.0), max(y0, 0.0), min(x1, pw), min(y1, ph)
                    if not text or not (x1 > x0 and y1 > y0):  # empty, NaN, or outside the page box
                        continue
                    px0, py0 = math.floor(x0 * scale), math.floor(y0 * scale)
                    words.append({"text": text, "x0": px0, "y0": py0, "x1": max(math.ceil(x1 * scale), px0 + 1),
                                  "y1": max(math.ceil(y1 * scale), py0 + 1), "conf": 100.0, "entity": None})
                    chars += len("".join(text.split()))
                if words:
                    lines.append(words)
            if lines:
                blocks.append(Block(lines))
        if chars < cfg.text_layer_min_chars:
            return None
        if len(blocks) > MAX_BLOCKS_PER_PAGE:
            raise self._err(LimitExceededError, ctx, f"{len(blocks)} text blocks, over {MAX_BLOCKS_PER_PAGE}",
                            "blocks_exceeded", page)
        return blocks

    def _render(self, ctx: SourceContext, page: int) -> bytes:
        """The page as a greyscale PGM (bytes, in memory) at ``dpi``."""
        cfg = self.config
        proc = self._poppler("pdftoppm", ["-f", str(page + 1), "-l", str(page + 1), "-r", str(cfg.dpi), "-gray"],
                             ctx, page, timeout_code="render_timeout")
        if out_of_memory(proc):  # pdftoppm may exit 0 after "Out of memory", with a blank or short image
            raise self._err(LimitExceededError, ctx, f"rendering hit the memory ceiling of "
                            f"{cfg.subprocess_memory_mb} MB", "memory_exceeded", page)
        m = _PGM_HEADER.match(proc.stdout)
        if proc.returncode != 0 or m is None or len(proc.stdout) != m.end() + int(m[1]) * int(m[2]):
            raise self._err(UnreadableInputError, ctx, "the page could not be rendered", "render_failed", page)
        return proc.stdout

    def _ocr(self, ctx: SourceContext, page: int, pgm: bytes) -> list[Block]:
        """Tesseract TSV of one page image (stdin -> stdout), grouped by block, then line."""
        cfg = self.config
        cmd = [self._bin["tesseract"], "stdin", "stdout", "-l", cfg.lang, "--dpi", str(cfg.dpi), "tsv"]
        try:
            proc = run_limited(cmd, input=pgm, timeout=cfg.ocr_timeout_s, memory_mb=cfg.subprocess_memory_mb,
                               env=self._env)
        except subprocess.TimeoutExpired:
            raise self._err(InputTimeoutError, ctx, f"OCR ran over {cfg.ocr_timeout_s:.0f} s", "ocr_timeout",
                            page) from None
        if proc.returncode != 0:
            if out_of_memory(proc):
                raise self._err(LimitExceededError, ctx, f"OCR hit the memory ceiling of "
                                f"{cfg.subprocess_memory_mb} MB", "memory_exceeded", page)
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

    # ---- output ----------------------------------------------------------------------

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
                "timing": time.timing, "quality": {"ocr_confidence": ocr_confidence(words, extraction)},
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
        listed = ", ".join(map(str, pages[:20])) + (f" and {len(pages) - 20} more" if len(pages) > 20 else "")
        return cls(f"page_index {listed} failed ({', '.join(codes)}); {good} other page(s) "
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
