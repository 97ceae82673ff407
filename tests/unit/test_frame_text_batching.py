"""Frame-text de-identification does not depend on where the tables of a stream begin and end.

The OCR samples sit on a grid of the session clock and the frames after a table's last
sample wait for the next one (``modalign.operators.deid.frame_text``, "Look-ahead"), so
the same frames fed as one table, or tables of 1, 7 or 25, give byte-identical frames and
boxes, and text on screen for one OCR interval is covered in every frame across a border.
"""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
import pytest

from modalign.operators.deid.frame_text import FrameTextConfig, FrameTextOperator
from modalign.schemas.errors import ComplianceError, UnreadableInputError
from test_deid_frame_text import SECRET, TEXT_A, TEXT_B, VALUES, frames_table, out_frames, render, value_region

pytestmark = pytest.mark.unit

CLEAN = ("Quarterly Planning Review", "Storage and network upgrades", "Vendor contracts renewed")
# 40 frames at 25 fps: a slide without personal data, then text A for exactly 7 frames (280 ms,
# one 250 ms OCR interval plus a frame) across the borders of the batchings below, then text B
# to the end of the stream. Grid samples: rows 0, 7, 13, 19, 25, 32, 38; the flush reads row 39.
SHOWN = ["-"] * 22 + ["A"] * 7 + ["B"] * 11
BATCHINGS = {"one table": [40], "tables of 1": [1] * 40, "tables of 7": [7] * 5 + [5], "tables of 25": [25, 15]}


@pytest.fixture(scope="module")
def op() -> FrameTextOperator:
    o = FrameTextOperator(FrameTextConfig(secret=SECRET))
    o.setup()
    return o


@pytest.fixture(scope="module")
def stream() -> pa.Table:
    pages = {"-": render(CLEAN), "A": render(TEXT_A), "B": render(TEXT_B)}
    return frames_table([pages[k] for k in SHOWN])


def run(op: FrameTextOperator, stream: pa.Table, sizes: list[int]) -> tuple[pa.Table, list[int]]:
    """(the whole output, rows returned by each call and the flush) for ``stream`` cut into ``sizes``."""
    outs, lo = [], 0
    for size in sizes:
        outs.append(op.process(stream.slice(lo, size)))
        lo += size
    outs += op.flush()
    assert all(o.schema.names == outs[0].schema.names for o in outs)
    return pa.concat_tables(outs), [o.num_rows for o in outs]


@pytest.fixture(scope="module")
def outputs(op, stream) -> dict[str, tuple[pa.Table, list[int]]]:
    return {name: run(op, stream, sizes) for name, sizes in BATCHINGS.items()}


def test_every_batching_gives_byte_identical_frames_and_boxes(outputs, stream):
    ref, _ = outputs["one table"]
    assert ref.column("event_id").to_pylist() == stream.column("event_id").to_pylist()  # all, in order
    ref_px = out_frames(ref).tobytes()
    for name, (out, _) in outputs.items():
        assert out.equals(ref), name  # every column: frames, text_boxes, text_deid
        assert out_frames(out).tobytes() == ref_px, name
    assert sum(len(b) > 0 for b in ref.column("text_boxes").to_pylist()) >= 18  # the check is not vacuous


def test_text_shown_one_interval_is_covered_in_every_frame_across_borders(outputs, stream):
    before = out_frames(stream)
    for name, (out, _) in outputs.items():
        got = out_frames(out)
        for i, key in enumerate(SHOWN):
            if key == "-":  # before sample 19 no sample around a frame saw personal data: bit-identical
                assert np.array_equal(got[i], before[i]) == (i < 19), (name, i)
                continue
            lines = TEXT_A if key == "A" else TEXT_B
            for j, value in VALUES[key].items():
                rs, cs = value_region(lines, j, value)
                diff = np.abs(got[i][rs, cs].astype(int) - before[i][rs, cs].astype(int)).mean()
                assert diff > 30, (name, i, j, diff)


def test_frames_wait_for_the_next_sample(outputs):
    """Rows come out once the sample after them is read: the first table of 7 returns none (row 0,
    its only sample, waits for row 7), the second rows 0-12 (samples 7 and 13 read) ...; the flush
    gives rows 38-39 (row 39 is read as the stream's last sample)."""
    assert outputs["tables of 7"][1] == [0, 13, 6, 6, 7, 6, 2]
    assert outputs["tables of 25"][1] == [19, 19, 2]
    assert outputs["one table"][1] == [38, 2]


def test_a_new_frame_shape_ends_a_segment(op):
    """Frames of two shapes in one stream: all come out, in order, one table per shape."""
    small = [np.full((120, 200, 3), 200, np.uint8)] * 3
    big = frames_table([render(CLEAN)] * 4, start=3)
    out1 = op.process(frames_table(small))
    out2 = op.process(big)
    rest = op.flush()
    got = [t for t in [out1, out2, *rest] if t.num_rows]
    assert [t.column("frame").type.shape[:2] for t in got] == [[120, 200], [360, 640]]
    assert [e for t in got for e in t.column("event_id").to_pylist()] == [f"s1/cam/video/{i}" for i in range(7)]


def test_an_unflushed_stream_is_withheld_not_emitted_elsewhere(op, caplog):
    op.process(frames_table([render(CLEAN)] * 3))  # rows 0-2 held: no sample after them yet
    other = frames_table([render(CLEAN)] * 2)
    other = other.set_column(0, "event_id", pa.array(["s2/cam/video/0", "s2/cam/video/1"]))
    with caplog.at_level(logging.WARNING, logger="modalign.operators.deid.frame_text"):
        op.process(other)
    out = [t for t in op.flush() if t.num_rows]
    assert [e for t in out for e in t.column("event_id").to_pylist()] == ["s2/cam/video/0", "s2/cam/video/1"]
    assert "3 held frame(s)" in caplog.text


def test_worker_flushes_held_rows_before_a_source_error_and_resets_on_failure():
    """The ingest worker's chain: held-back rows come out at the end of the stream (also when the
    source breaks off with damage, before the error); after an operator error they are dropped."""
    from modalign.pipeline.worker import IngestWorker

    class Source:
        def __init__(self, fail: Exception | None):
            self.fail = fail

        def read(self, ctx):
            yield pa.table({"x": [1, 2]})
            yield pa.table({"x": [3]})
            if self.fail is not None:
                raise self.fail

    class HoldLast:  # emits all but the last row; flush() gives that row
        def __init__(self):
            self.held, self.resets = None, 0

        def process(self, t):
            t = t if self.held is None else pa.concat_tables([self.held, t])
            self.held = t.slice(t.num_rows - 1)
            return t.slice(0, t.num_rows - 1)

        def flush(self):
            out, self.held = [self.held], None
            return out

        def reset(self):
            self.held, self.resets = None, self.resets + 1

    class Double:
        def process(self, t):
            return t.set_column(0, "x", pa.compute.multiply(t.column("x"), 2))

        def flush(self):
            return []

        def reset(self):
            pass

    hold = HoldLast()
    got = list(IngestWorker._deidentified([Source(None), hold, Double()], None))
    assert [t.column("x").to_pylist() for t in got] == [[2], [4], [6]]  # the flushed row went through Double

    damaged = UnreadableInputError("corrupt", code="corrupt_frames")
    seen = []
    with pytest.raises(UnreadableInputError):
        for t in IngestWorker._deidentified([Source(damaged), hold, Double()], None):
            seen.append(t.column("x").to_pylist())
    assert seen == [[2], [4], [6]] and hold.held is None

    class Broken(Double):
        def process(self, t):
            if t.column("x")[0].as_py() == 3:
                raise ComplianceError("ocr failed", stage="frame_text")
            return t

    hold = HoldLast()
    with pytest.raises(ComplianceError):
        list(IngestWorker._deidentified([Source(None), Broken(), hold], None))
    assert hold.held is None and hold.resets == 1  # row 2, held, is withheld
