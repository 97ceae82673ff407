"""Determinism of de-identification: the same input and config give byte-identical event
tables across runs, and the face boxes and frame text across video batch sizes (issue 11, part 4).

One generated 4.5 s sample session (``modalign sample``), one tenant key store, three runs
on the shared local Ray: the default config twice and ``ingest.video.batch_frames = 7``
once (the default tables hold 23 frames of 640x360, set by ``batch_bytes``). Every column
of every event table is compared exactly, except those that differ between two clean runs
by design (``VOLATILE``, as in test_kill_recovery).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import modalign
from modalign.pipeline.runner import EXIT_OK, Runner
from modalign.schemas.config import RunConfig

pytestmark = pytest.mark.integration

VOLATILE = {"run_id", "trace_id", "latency_ms"}
EVENTS = ("events_video", "events_audio", "events_pdf")
MCU = 16  # JPEG block of 4:2:0 chroma: pixels of different blocks are coded apart


@pytest.fixture(scope="module")
def runs(ray_local, tmp_path_factory) -> dict[str, Path]:
    from modalign.pipeline.sample import generate_sample

    d = tmp_path_factory.mktemp("determinism")
    manifest = generate_sample(d / "in", duration_s=4.5, seed=0)
    outs = {}
    for name, video in (("first", {}), ("second", {}), ("batch7", {"batch_frames": 7})):
        cfg = RunConfig.model_validate({"key_store": str(d / "keys"), "ingest": {"video": video}})
        summary = Runner(cfg, d / name, progress=lambda _m: None).run(manifest.parent)
        assert summary["exit_code"] == EXIT_OK, name
        outs[name] = d / name
    return outs


def events(out: Path, name: str) -> pa.Table:
    """One event table of a run, rows in event-id order, volatile columns left out, one chunk."""
    t = modalign.open(out).table(name).to_table()
    t = t.select([c for c in t.column_names if c not in VOLATILE]).sort_by("event_id")
    return t.combine_chunks()


def test_two_runs_give_byte_identical_event_tables(runs):
    for name in EVENTS:
        a, b = events(runs["first"], name), events(runs["second"], name)
        assert a.num_rows > 0 and a.schema == b.schema, name
        for col in a.column_names:
            assert a.column(col).equals(b.column(col)), (name, col)
    video = events(runs["first"], "events_video")
    assert video.num_rows == 112  # 4.5 s at 25 fps: no frame lost at a table's end
    assert sum(bool(b) for b in video.column("text_boxes").to_pylist()) > 50  # slide text was blurred
    assert sum(bool(b) for b in video.column("face_boxes").to_pylist()) > 50  # and the face


def test_video_batch_size_changes_no_frame_text_box(runs):
    a, b = events(runs["first"], "events_video"), events(runs["batch7"], "events_video")
    assert a.column("event_id").equals(b.column("event_id"))
    for col in ("text_boxes", "text_deid", "t_ns", "pts", "frame_index"):
        assert a.column(col).equals(b.column(col)), col
    for name in ("events_audio", "events_pdf"):  # the other sources do not see the video's batching
        assert events(runs["first"], name).equals(events(runs["batch7"], name)), name


def _pixels(jpeg: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"))


def test_video_batch_size_changes_no_pixel_outside_the_face(runs):
    """Every decoded pixel is equal except in the JPEG blocks that touch a face box of either
    run, or border them (the boxes themselves are compared by the next test)."""
    a, b = events(runs["first"], "events_video"), events(runs["batch7"], "events_video")
    compared = 0
    for ja, jb, fa, fb in zip(a.column("frame_jpeg").to_pylist(), b.column("frame_jpeg").to_pylist(),
                              a.column("face_boxes").to_pylist(), b.column("face_boxes").to_pylist()):
        pa_, pb = _pixels(ja), _pixels(jb)
        keep = np.ones(pa_.shape[:2], bool)
        for box in fa + fb:  # the blocks a face box touches and their neighbours (chroma upsampling)
            y0, x0 = max(0, (int(box["y0"]) // MCU - 1) * MCU), max(0, (int(box["x0"]) // MCU - 1) * MCU)
            y1, x1 = (-(-int(box["y1"]) // MCU) + 1) * MCU, (-(-int(box["x1"]) // MCU) + 1) * MCU
            keep[y0:y1, x0:x1] = False
        assert np.array_equal(pa_[keep], pb[keep])
        compared += int(keep.sum())
    assert compared > 0.5 * a.num_rows * 640 * 360


def test_video_batch_size_changes_no_face_box_nor_frame(runs):
    """Face boxes sit on the stream's tiling grid and wait for their look-ahead (faces.py), so
    the face boxes, and with them every frame's JPEG, are the same for any video batching."""
    a, b = events(runs["first"], "events_video"), events(runs["batch7"], "events_video")
    assert a.column("face_boxes").equals(b.column("face_boxes"))
    assert a.column("frame_jpeg").equals(b.column("frame_jpeg"))
