"""PdfTextOperator: OCR text and boxes, page schedule timing, per-page failures, bad files."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from operators.ingest.base import SourceContext
from operators.ingest.pdf import PdfTextConfig, PdfTextOperator, page_times, pdf_text_schema
from pipeline.errors import InputTimeoutError, LimitExceededError, UnreadableInputError
from schemas.manifest import ClockMapping, SourceSpec

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


@pytest.fixture(scope="session")
def deck_tables(deck) -> list[pa.Table]:
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
    op = PdfTextOperator(PdfTextConfig(ocr_timeout_s=0.001))
    with pytest.raises(InputTimeoutError) as e:
        list(op.read(ctx_for(deck, schedule=SCHEDULE)))
    assert e.value.code == "ocr_timeout" and "page_index 0, 1, 2 " in str(e.value)
    assert e.value.start_t_ns == OFFSET_NS and e.value.end_t_ns is None
