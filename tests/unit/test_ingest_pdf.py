"""PdfTextOperator: text layer and OCR (text, boxes), parallel pages, schedule timing,
per-page failures and limits, bad files."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from modalign.operators.ingest.base import SourceContext
from modalign.operators.ingest.pdf import PdfTextConfig, PdfTextOperator, page_times, pdf_text_schema
from modalign.schemas.errors import InputTimeoutError, LimitExceededError, UnreadableInputError
from modalign.schemas.manifest import ClockMapping, SourceSpec

pytestmark = pytest.mark.unit

A4_PT = (595.276, 841.89)
DPI = 200
PAGE_PX = (round(A4_PT[0] * DPI / 72), round(A4_PT[1] * DPI / 72))
TITLE = "Quarterly Review Meeting"
SENTENCE_1 = "The quick brown fox jumps over the lazy dog"
SENTENCE_2 = "Modalign aligns slides with speech"
OFFSET_NS = 1_500_000_000
SCHEDULE = [0, 4_000_000_000, 9_000_000_000]


def make_pdf(path: Path, pages: list[list[tuple[float, float, str]]], size=A4_PT, encrypt=None) -> Path:
    """Each page: (x_pt, y_pt from the bottom, text) in 24 pt Helvetica; [] is an empty page."""
    from reportlab.pdfgen import canvas

    c = canvas.Canvas(str(path), pagesize=size, encrypt=encrypt)
    for page in pages:
        c.setFont("Helvetica", 24)
        for x, y, text in page:
            c.drawString(x, y, text)
        c.showPage()
    c.save()
    return path


def ctx_for(path: Path, schedule=None, offset_ns: int = OFFSET_NS, **spec_kw) -> SourceContext:
    spec = SourceSpec(id="slides", uri=path.name, modality="pdf", page_schedule_ns=schedule,
                      clock=ClockMapping(offset_ns=offset_ns), **spec_kw)
    return SourceContext(session_id="s1", spec=spec, path=path, uri=f"file://{path}", version="v1")


@pytest.fixture(scope="session")
def deck(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pdf")
    return make_pdf(d / "deck.pdf", [
        [(72, 760, TITLE), (72, 400, SENTENCE_1)],  # two blocks, far apart
        [(72, 700, SENTENCE_2)],
        [],  # an empty page: no rows, no failure
    ])


OCR = PdfTextConfig(text_layer=False)  # the deck is born-digital: force the OCR path


@pytest.fixture(scope="session")
def deck_tables(deck) -> list[pa.Table]:
    return list(PdfTextOperator(OCR).read(ctx_for(deck, schedule=SCHEDULE)))


@pytest.fixture(scope="session")
def deck_text_layer(deck) -> list[pa.Table]:
    return list(PdfTextOperator().read(ctx_for(deck, schedule=SCHEDULE)))


def test_ocr_finds_the_sentences_as_blocks_with_words(deck_tables):
    assert len(deck_tables) == 2  # the empty page yields no table
    table = pa.concat_tables(deck_tables)
    assert table.schema == pdf_text_schema()
    rows = table.to_pylist()
    page0 = [r for r in rows if r["page_index"] == 0]
    texts0 = [r["text"] for r in page0]
    assert TITLE in texts0 and SENTENCE_1 in texts0 and len(page0) == 2
    assert [r["text"] for r in rows if r["page_index"] == 1] == [SENTENCE_2]
    sentence = next(r for r in rows if r["text"] == SENTENCE_1)
    assert [w["text"] for w in sentence["words"]] == SENTENCE_1.split()
    assert all(50 < w["conf"] <= 100 and w["entity"] is None for w in sentence["words"])
    assert [r["block_index"] for r in page0] == [0, 1]
    assert [r["event_id"] for r in rows] == ["s1/slides/block/0", "s1/slides/block/1", "s1/slides/block/1000"]
    assert {r["extraction"] for r in rows} == {"ocr"} and {r["dpi"] for r in rows} == {DPI}


def test_block_and_word_boxes_lie_on_the_page_where_the_text_was_drawn(deck_tables):
    for r in pa.concat_tables(deck_tables).to_pylist():
        b = r["box"]
        assert 0 <= b["x0"] < b["x1"] <= PAGE_PX[0] and 0 <= b["y0"] < b["y1"] <= PAGE_PX[1]
        assert 0.5 < b["score"] <= 1.0
        for w in r["words"]:
            assert b["x0"] <= w["x0"] < w["x1"] <= b["x1"] and b["y0"] <= w["y0"] < w["y1"] <= b["y1"]
        # drawn at x = 72 pt, baseline y pt from the bottom: pixels = pt * dpi / 72
        y_pt = {TITLE: 760, SENTENCE_1: 400, SENTENCE_2: 700}[r["text"]]
        baseline_px = (A4_PT[1] - y_pt) * DPI / 72
        assert abs(b["x0"] - 72 * DPI / 72) < 10
        assert b["y0"] < baseline_px <= b["y1"] + 25  # letters sit on the baseline, descenders below


def test_times_follow_the_schedule_on_the_session_clock(deck_tables):
    rows = pa.concat_tables(deck_tables).to_pylist()
    for r in rows:
        i = r["page_index"]
        assert r["t_ns"] == OFFSET_NS + SCHEDULE[i] and r["timing"] == "schedule"
        assert r["end_t_ns"] == OFFSET_NS + SCHEDULE[i + 1]  # page 1 ends when the (empty) page 2 starts


def test_page_times_without_or_with_a_short_schedule(tmp_path):
    dur = 5_000_000_000
    no_sched = page_times(ctx_for(tmp_path / "x.pdf", offset_ns=7), 3)
    assert [(p.t_ns, p.end_t_ns, p.timing) for p in no_sched] == [
        (7, 7 + dur, "sequential"), (7 + dur, 7 + 2 * dur, "sequential"), (7 + 2 * dur, None, "sequential")]
    short = page_times(ctx_for(tmp_path / "x.pdf", schedule=[1_000, 4_000_000_000], offset_ns=0,
                               page_duration_ns=dur), 4)
    assert [p.t_ns for p in short] == [1_000, 4_000_000_000, 4_000_000_000 + dur, 4_000_000_000 + 2 * dur]
    assert [p.timing for p in short] == ["schedule", "schedule", "sequential", "sequential"]
    assert [p.end_t_ns for p in short] == [p.t_ns for p in short[1:]] + [None]


@pytest.mark.parametrize("content", ["garbage", "header_then_garbage", "encrypted", "missing"])
def test_unreadable_pdfs_name_the_uri(tmp_path, content):
    path = tmp_path / "bad.pdf"
    if content == "garbage":
        path.write_bytes(b"\x00\x13garbage bytes, not a document" * 50)
    elif content == "header_then_garbage":
        path.write_bytes(b"%PDF-1.4\n" + b"garbage " * 200)
    elif content == "encrypted":
        from reportlab.lib.pdfencrypt import StandardEncryption

        make_pdf(path, [[(72, 700, SENTENCE_2)]], encrypt=StandardEncryption("user-pw", "owner-pw"))
    ctx = ctx_for(path)
    with pytest.raises(UnreadableInputError) as e:
        list(PdfTextOperator().read(ctx))
    assert ctx.uri in str(e.value)
    expected = {"garbage": "not_pdf", "header_then_garbage": "pdf_corrupt", "encrypted": "pdf_encrypted",
                "missing": "file_missing"}[content]
    assert e.value.code == expected


def test_too_many_pages_is_rejected_before_rendering(deck):
    with pytest.raises(LimitExceededError) as e:
        list(PdfTextOperator(PdfTextConfig(max_pages=2)).read(ctx_for(deck)))
    assert e.value.code == "pages_exceeded"


def test_an_oversized_page_fails_alone_after_the_good_pages(tmp_path):
    from reportlab.pdfgen import canvas

    path = tmp_path / "mixed.pdf"
    c = canvas.Canvas(str(path), pagesize=(300, 200))
    c.setFont("Helvetica", 24)
    c.drawString(20, 100, "Hello world")
    c.showPage()
    c.setPageSize((3000, 3000))  # 4167 x 4167 px at 100 dpi
    c.showPage()
    c.save()
    op = PdfTextOperator(PdfTextConfig(dpi=100, max_page_pixels=4000 * 4000))
    got = []
    with pytest.raises(LimitExceededError) as e:
        for t in op.read(ctx_for(path, offset_ns=0)):
            got.append(t)
    assert [r["text"] for r in pa.concat_tables(got).to_pylist()] == ["Hello world"]
    assert e.value.code == "page_too_large" and "page_index 1 " in str(e.value)
    assert e.value.start_t_ns == 5_000_000_000 and e.value.end_t_ns is None


def test_ocr_timeouts_are_reported_per_page(deck):
    op = PdfTextOperator(PdfTextConfig(ocr_timeout_s=0.001, text_layer=False))
    with pytest.raises(InputTimeoutError) as e:
        list(op.read(ctx_for(deck, schedule=SCHEDULE)))
    assert e.value.code == "ocr_timeout" and "page_index 0, 1, 2 " in str(e.value)
    assert e.value.start_t_ns == OFFSET_NS and e.value.end_t_ns is None


# ---- text layer first ----------------------------------------------------------------------

def scanned_image(lines: list[str], size=(420, 297), dpi: int = 150, seed: int = 0):
    """A page image that looks scanned: the text rendered to pixels, noise and dust added."""
    import subprocess
    import tempfile
    from io import BytesIO

    import numpy as np
    from PIL import Image

    with tempfile.TemporaryDirectory() as d:
        src = make_pdf(Path(d) / "src.pdf", [[(30, size[1] - 60 - 40 * i, t) for i, t in enumerate(lines)]], size=size)
        pgm = subprocess.run(["pdftoppm", "-r", str(dpi), "-gray", str(src)], capture_output=True, check=True).stdout
    img = np.array(Image.open(BytesIO(pgm)), dtype=np.float64)
    rng = np.random.default_rng(seed)
    img = np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)
    img[rng.random(img.shape) < 0.002] = 0  # dust
    return Image.fromarray(img)


def mixed_pdf(path: Path, pages: list[tuple[str, list[str]]], size=(420, 297)) -> Path:
    """Pages of ("text", lines) drawn as text or ("scan", lines) embedded as a scanned image."""
    from reportlab.lib.utils import ImageReader
    from reportlab.pdfgen import canvas

    c = canvas.Canvas(str(path), pagesize=size)
    for i, (kind, lines) in enumerate(pages):
        if kind == "scan":
            c.drawImage(ImageReader(scanned_image(lines, size, seed=i)), 0, 0, width=size[0], height=size[1])
        else:
            c.setFont("Helvetica", 24)
            for j, text in enumerate(lines):
                c.drawString(30, size[1] - 60 - 40 * j, text)
        c.showPage()
    c.save()
    return path


def test_born_digital_pages_use_the_text_layer_with_ocr_comparable_boxes(deck_text_layer, deck_tables):
    tl = pa.concat_tables(deck_text_layer)
    ocr = pa.concat_tables(deck_tables)
    assert tl.schema == pdf_text_schema() and set(tl.column("extraction").to_pylist()) == {"text_layer"}
    # the same blocks, event ids, times; exact text (no OCR errors) and full confidence
    for col in ("event_id", "t_ns", "end_t_ns", "page_index", "block_index", "text", "timing", "dpi"):
        assert tl.column(col).to_pylist() == ocr.column(col).to_pylist(), col
    for r_tl, r_ocr in zip(tl.to_pylist(), ocr.to_pylist()):
        assert [w["text"] for w in r_tl["words"]] == [w["text"] for w in r_ocr["words"]]
        assert all(w["conf"] == 100.0 for w in r_tl["words"]) and r_tl["box"]["score"] == 1.0
        for a, b in zip(r_tl["words"], r_ocr["words"]):  # points scaled to pixels at dpi: same place
            assert abs(a["x0"] - b["x0"]) <= 12 and abs(a["x1"] - b["x1"]) <= 12
            assert a["y0"] - 15 <= b["y0"] and b["y1"] <= a["y1"] + 15  # font box vs ink box


MIXED = [("text", ["Budget planning for the next quarter"]), ("scan", ["Scanned minutes of the meeting"]),
         ("text", ["Roadmap and milestones overview"]), ("scan", ["Signed contract appendix page"])]


@pytest.fixture(scope="session")
def mixed(tmp_path_factory) -> Path:
    return mixed_pdf(tmp_path_factory.mktemp("mixed") / "mixed.pdf", MIXED)


def test_pages_without_a_text_layer_are_ocred_and_recorded_per_page(mixed):
    rows = pa.concat_tables(PdfTextOperator(PdfTextConfig(ocr_workers=1)).read(ctx_for(mixed))).to_pylist()
    by_page = {r["page_index"]: r for r in rows}
    assert sorted(by_page) == [0, 1, 2, 3] and len(rows) == 4
    for i, (kind, lines) in enumerate(MIXED):
        assert by_page[i]["extraction"] == ("text_layer" if kind == "text" else "ocr")
        assert by_page[i]["text"] == lines[0]  # OCR of the noisy scan still reads it


def test_ocr_workers_run_pages_concurrently_bounded_and_in_order(mixed, monkeypatch):
    import threading
    import time

    ops = {n: PdfTextOperator(PdfTextConfig(ocr_workers=n)) for n in (1, 3)}
    state = {"now": 0, "peak": 0}
    lock = threading.Lock()
    real = PdfTextOperator._extract

    def counting(self, *a, **k):
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
        try:
            time.sleep(0.05)
            return real(self, *a, **k)
        finally:
            with lock:
                state["now"] -= 1

    one = pa.concat_tables(ops[1].read(ctx_for(mixed)))
    monkeypatch.setattr(PdfTextOperator, "_extract", counting)
    tables = list(ops[3].read(ctx_for(mixed)))
    assert state["peak"] == 3  # never more than ocr_workers pages in flight
    assert [t.column("page_index")[0].as_py() for t in tables] == [0, 1, 2, 3]  # page order
    assert pa.concat_tables(tables).equals(one)


def test_a_rotated_page_has_boxes_in_its_displayed_frame(tmp_path):
    """/Rotate 90: both paths report boxes in the page as rendered (width and height swapped)."""
    path = make_pdf(tmp_path / "r.pdf", [[(72, 700, TITLE), (72, 400, SENTENCE_2)]])
    data = path.read_bytes()
    assert b"/Rotate 0 /Trans" in data
    path.write_bytes(data.replace(b"/Rotate 0 /Trans", b"/Rotate 90/Trans"))  # same length: xref stays valid
    tl = pa.concat_tables(PdfTextOperator().read(ctx_for(path))).to_pylist()
    ocr = pa.concat_tables(PdfTextOperator(OCR).read(ctx_for(path))).to_pylist()
    assert sorted(r["text"] for r in tl) == sorted([TITLE, SENTENCE_2])
    assert {r["extraction"] for r in tl} == {"text_layer"}
    for r in tl:
        b = r["box"]
        assert 0 <= b["x0"] < b["x1"] <= PAGE_PX[1] and 0 <= b["y0"] < b["y1"] <= PAGE_PX[0]  # landscape now
        other = next(o for o in ocr if o["text"] == r["text"])["box"]
        assert abs(b["x0"] - other["x0"]) <= 25 and abs(b["y0"] - other["y0"]) <= 25


def test_too_little_text_layer_falls_back_to_ocr(tmp_path):
    path = make_pdf(tmp_path / "short.pdf", [[(72, 700, "Hi")]])
    rows = pa.concat_tables(PdfTextOperator(PdfTextConfig(text_layer_min_chars=16)).read(ctx_for(path))).to_pylist()
    assert [(r["text"], r["extraction"]) for r in rows] == [("Hi", "ocr")]
    rows = pa.concat_tables(PdfTextOperator(PdfTextConfig(text_layer_min_chars=2)).read(ctx_for(path))).to_pylist()
    assert [(r["text"], r["extraction"]) for r in rows] == [("Hi", "text_layer")]


def test_the_memory_ceiling_stops_a_render_that_needs_more(tmp_path):
    """A 3000 pt page at 300 dpi is a 156 MB bitmap: under a 100 MB ceiling pdftoppm cannot
    allocate it; the page is quarantined as memory_exceeded, the process is unharmed."""
    from reportlab.pdfgen import canvas

    path = tmp_path / "big.pdf"
    c = canvas.Canvas(str(path), pagesize=(3000, 3000))
    c.showPage()
    c.save()
    op = PdfTextOperator(PdfTextConfig(dpi=300, max_page_pixels=20000 * 20000, subprocess_memory_mb=100))
    with pytest.raises(LimitExceededError) as e:
        list(op.read(ctx_for(path)))
    assert e.value.code == "memory_exceeded" and "page_index 0 " in str(e.value)


def test_run_limited_sets_the_address_space_ceiling():
    from modalign.operators.sandbox import run_limited

    proc = run_limited(["sh", "-c", "ulimit -v"], timeout=10, memory_mb=321)
    assert proc.stdout.decode().strip() == str(321 * 1024)


def test_born_digital_and_scanned_versions_of_a_page_give_the_same_words(tmp_path):
    import difflib

    lines = ["Quarterly budget review",  # short enough for the page at 24 pt
             "Vendor contracts renewed",
             "Storage upgrades in March",
             "Questions after the meeting"]
    pdf = mixed_pdf(tmp_path / "both.pdf", [("text", lines), ("scan", lines)])
    rows = pa.concat_tables(PdfTextOperator(PdfTextConfig(ocr_workers=1)).read(ctx_for(pdf))).to_pylist()
    words = {p: [w["text"] for r in rows if r["page_index"] == p for w in r["words"]] for p in (0, 1)}
    assert {r["extraction"] for r in rows if r["page_index"] == 0} == {"text_layer"}
    assert {r["extraction"] for r in rows if r["page_index"] == 1} == {"ocr"}
    assert words[0] == " ".join(lines).split()
    match = difflib.SequenceMatcher(a=words[0], b=words[1], autojunk=False).ratio()
    assert match >= 0.98, (match, words[1])
