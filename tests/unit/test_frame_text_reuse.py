"""Frame-text OCR runs only when the frame's content changes (``modalign.operators.deid.frame_text``,
"Reuse"): a sample whose thumbnail matches the stream's last OCRed sample reuses its words.

Tesseract calls are counted by wrapping the operator's own ``_ocr`` (tesseract really runs).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from modalign.operators.deid import frame_text as ft
from modalign.operators.deid.frame_text import FrameTextConfig, FrameTextOperator
from test_deid_frame_text import SECRET, TEXT_A, VALUES, deid, frames_table, norm, ocr_text, out_frames, render, value_region

pytestmark = pytest.mark.unit

# TEXT_A with another name on the same line: what a presenter editing the slide would show
TEXT_A2 = tuple(line.replace("Clara Hartmann", "Marcus Whitfield") for line in TEXT_A)
N = 25  # 1 s at 25 fps: grid samples on rows 0, 7, 13, 19, the flush reads row 24


def reencoded(img: np.ndarray, i: int) -> np.ndarray:
    """``img`` through JPEG at a quality that changes per frame: different artefacts each frame."""
    import cv2

    ok, buf = cv2.imencode(".jpg", img[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, (70, 80, 90)[i % 3]])
    assert ok
    return np.ascontiguousarray(cv2.imdecode(buf, cv2.IMREAD_COLOR)[..., ::-1])


def counted(reuse: int) -> tuple[FrameTextOperator, list[str]]:
    """An operator whose tesseract runs are recorded (event ids) in the returned list."""
    op = FrameTextOperator(FrameTextConfig(secret=SECRET, reuse_threshold=reuse))
    op.setup()
    calls: list[str] = []
    inner = op._ocr

    def ocr(rgb, event_id, table, **kw):
        calls.append(event_id)
        return inner(rgb, event_id, table, **kw)

    op._ocr = ocr  # type: ignore[method-assign]
    return op, calls


def without_detector(out: pa.Table) -> list[dict]:
    return [{k: v for k, v in h.items() if k != "detector"} for h in out.column("text_deid").to_pylist()]


def test_thumbnail_separates_reencoding_noise_from_a_changed_name():
    """The premise of the default threshold: JPEG noise stays under it, one changed name does not."""
    thr = FrameTextConfig().reuse_threshold
    a = render(TEXT_A)
    ref = ft.change_thumbnail(a)
    noise = max(ft.max_cell_change(ref, ft.change_thumbnail(reencoded(a, i))) for i in range(3))
    name = ft.max_cell_change(ref, ft.change_thumbnail(reencoded(render(TEXT_A2), 0)))
    assert noise < thr <= name, (noise, name)
    assert ft.change_thumbnail(a[:359, :639]).shape == (90, 160)  # a partial edge cell still counts


def test_identical_slide_is_ocred_once_with_the_same_output_as_reuse_off():
    table = frames_table([render(TEXT_A)] * N)
    on, on_calls = counted(FrameTextConfig().reuse_threshold)
    off, off_calls = counted(0)
    got, ref = deid(on, table), deid(off, table)
    assert on_calls == ["s1/cam/video/0"] and len(off_calls) == 5
    assert out_frames(got).tobytes() == out_frames(ref).tobytes()
    assert got.column("text_boxes").equals(ref.column("text_boxes"))
    assert without_detector(got) == without_detector(ref)
    assert "/reuse<24+" in got.column("text_deid")[0].as_py()["detector"]
    assert "/reuse" not in ref.column("text_deid")[0].as_py()["detector"]


def test_reencoded_static_slide_is_ocred_once_and_every_value_blurred():
    frames = [reencoded(render(TEXT_A), i) for i in range(N)]
    table = frames_table(frames)
    op, calls = counted(FrameTextConfig().reuse_threshold)
    out = deid(op, table)
    assert calls == ["s1/cam/video/0"]
    got = out_frames(out)
    for i in range(N):
        for j, value in VALUES["A"].items():
            rs, cs = value_region(TEXT_A, j, value)
            assert np.abs(got[i][rs, cs].astype(int) - frames[i][rs, cs].astype(int)).mean() > 30, (i, j)
    read = ocr_text(got[N - 1])
    assert not [v for v in VALUES["A"].values() if norm(v) in read]
    assert "storageandnetworkupgrades" in read


def test_a_changed_name_on_the_same_slide_is_ocred_again_and_blurred():
    shown = [TEXT_A] * 13 + [TEXT_A2] * 12  # the new name appears at row 13, a grid sample
    frames = [reencoded(render(t), i) for i, t in enumerate(shown)]
    op, calls = counted(FrameTextConfig().reuse_threshold)
    got = out_frames(deid(op, frames_table(frames)))
    assert calls == ["s1/cam/video/0", "s1/cam/video/13"]  # rows 7 and 19 and 24 reuse
    rs, cs = value_region(TEXT_A2, 4, "Marcus Whitfield")
    for i in range(13, N):
        assert np.abs(got[i][rs, cs].astype(int) - frames[i][rs, cs].astype(int)).mean() > 30, i
    assert "marcuswhitfield" in ocr_text(frames[20]) and "marcuswhitfield" not in ocr_text(got[20])


def test_output_byte_identical_for_any_batching_with_reuse_on():
    shown = [TEXT_A] * 13 + [TEXT_A2] * 12
    stream = frames_table([reencoded(render(t), i) for i, t in enumerate(shown)])
    op, calls = counted(FrameTextConfig().reuse_threshold)
    outs, ocrs = [], []
    for sizes in ([N], [1] * N, [7, 7, 7, 4], [12, 13]):
        calls.clear()
        parts, lo = [], 0
        for size in sizes:
            parts.append(op.process(stream.slice(lo, size)))
            lo += size
        outs.append(pa.concat_tables(parts + op.flush()))
        ocrs.append(list(calls))
    assert all(o.equals(outs[0]) for o in outs) and out_frames(outs[0]).tobytes() == out_frames(outs[-1]).tobytes()
    assert all(c == ["s1/cam/video/0", "s1/cam/video/13"] for c in ocrs), ocrs


def with_box(img: np.ndarray, i: int, y: int, x0: int, dx: int) -> np.ndarray:
    """``img`` with a 60x100 px dark block (a person) at ``x0 + dx * i``, rows ``y`` to ``y + 100``."""
    out = img.copy()
    out[y : y + 100, x0 + dx * i : x0 + dx * i + 60] = (90, 60, 40)
    return out


def test_a_moving_object_is_reread_alone_and_the_slide_words_kept():
    slide = render(TEXT_A)
    frames = [with_box(slide, i, 220, 380, 8) for i in range(N)]  # moves right through the room, below the panel
    on, on_calls = counted(FrameTextConfig().reuse_threshold)
    shapes: list[tuple[int, ...]] = []
    inner = on._ocr
    on._ocr = lambda rgb, e, t, **kw: (shapes.append(rgb.shape[:2]), inner(rgb, e, t, **kw))[1]  # type: ignore
    off, _ = counted(0)
    table = frames_table(frames)
    got, ref = deid(on, table), deid(off, table)
    assert shapes[0] == (360, 640) and len(shapes) == 5
    assert all(h * w < 360 * 640 // 4 for h, w in shapes[1:]), shapes  # only around the moving block
    assert out_frames(got).tobytes() == out_frames(ref).tobytes()
    assert got.column("text_boxes").equals(ref.column("text_boxes"))


def test_a_change_on_read_text_rereads_the_whole_frame():
    """A change touching a word of the reference is not read from a crop (tesseract reads text
    areas less well cropped): the block moving over the name line means a whole-frame OCR."""
    slide = render(TEXT_A)
    frames = [with_box(slide, i, 150, 240, 0) if i >= 7 else slide for i in range(N)]  # from row 7, on line 4
    op, _ = counted(FrameTextConfig().reuse_threshold)
    shapes: list[tuple[int, ...]] = []
    inner = op._ocr
    op._ocr = lambda rgb, e, t, **kw: (shapes.append(rgb.shape[:2]), inner(rgb, e, t, **kw))[1]  # type: ignore
    deid(op, frames_table(frames))
    assert shapes == [(360, 640), (360, 640)]  # row 0, row 7 (changed over text); rows 13, 19, 24 reuse row 7


def test_reread_rect_and_the_words_it_touches():
    word = ft.OcrWord
    words = [((1, 1, 1), word("Hartmann", 145, 160, 226, 173, 90.0)), ((2, 1, 1), word("Budget", 30, 40, 90, 60, 90.0))]
    changed = np.zeros((90, 160), bool)
    changed[42, 50] = changed[44, 52] = True  # cells at x 200-204 and 208-212, y 168-172 and 176-180
    assert ft.reread_rect(changed, 640, 360) == (184, 152, 228, 196)
    assert ft._text_blocks_touch(words, (184, 152, 228, 196)) and not ft._text_blocks_touch(words, (300, 200, 400, 300))
    marks = [((3, 1, 1), word(">.", 300, 220, 340, 240, 78.0)), ((4, 1, 1), word("we’", 500, 100, 560, 140, 66.0))]
    assert not ft._text_blocks_touch(marks, (290, 210, 600, 250))  # stray marks in a face are no text
    assert ft._text_blocks_touch([((3, 1, 1), word("by", 300, 220, 320, 240, 90.0))] + words[:1], (0, 150, 330, 200))
    changed[0, 0] = changed[89, 159] = True
    assert ft.reread_rect(changed, 640, 360) == (0, 0, 640, 360)


def test_a_pair_of_samples_that_read_the_last_pairs_texts_gets_its_detections_again(monkeypatch):
    """Detection is a pure function of the texts: on a static slide only the first sample (alone)
    and the first pair are detected; a changed name starts new pairs; the boxes are those of a
    detection on every pair (every value blurred in every frame)."""
    calls: list[int] = []
    real = ft.detect_batch
    monkeypatch.setattr(ft, "detect_batch", lambda texts, *a: calls.append(len(texts)) or real(texts, *a))
    frames = [reencoded(render(TEXT_A), i) for i in range(N)]
    op, _ = counted(FrameTextConfig().reuse_threshold)
    got = out_frames(deid(op, frames_table(frames)))
    assert len(calls) == 2 and calls[1] == 2 * calls[0]  # sample 0 alone, then (0, 7); (7, 13) ... reuse it
    for i in range(N):
        for j, value in VALUES["A"].items():
            rs, cs = value_region(TEXT_A, j, value)
            assert np.abs(got[i][rs, cs].astype(int) - frames[i][rs, cs].astype(int)).mean() > 30, (i, j)
    calls.clear()
    shown = [TEXT_A] * 13 + [TEXT_A2] * 12  # the new name at row 13: pairs (7, 13) and (13, 19) are new
    op, _ = counted(FrameTextConfig().reuse_threshold)
    deid(op, frames_table([reencoded(render(t), i) for i, t in enumerate(shown)]))
    assert len(calls) == 4
