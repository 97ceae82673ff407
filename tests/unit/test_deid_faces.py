"""FaceBlurOperator: real face (skimage astronaut) detected, blurred+permuted in a new buffer."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from modalign.operators.deid.faces import FaceBlurConfig, FaceBlurOperator, anonymise_region
from modalign.schemas.errors import ComplianceError, InputError
from modalign.schemas.policy import FacePolicy
from modalign.schemas.tables import Box

from modalign.schemas.policy import DEFAULT_POLICY_TAG

pytestmark = pytest.mark.unit

H, W = 360, 640
SECRET = b"s" * 32
FACE_CENTRE = (300, 90)  # x, y of the astronaut's face on the canvas below


@pytest.fixture(scope="session")
def canvas() -> np.ndarray:
    import cv2
    from skimage.data import astronaut

    img = np.full((H, W, 3), 90, np.uint8)
    img[10:350, 150:490] = cv2.resize(astronaut(), (340, 340), interpolation=cv2.INTER_AREA)
    return img


@pytest.fixture(scope="session")
def blacked(canvas) -> np.ndarray:
    img = canvas.copy()
    img[20:170, 230:370] = 0  # the face is hidden: the detector finds nothing here
    return img


@pytest.fixture(scope="module")
def op() -> FaceBlurOperator:
    o = FaceBlurOperator(FaceBlurConfig(secret=SECRET))
    o.setup()
    return o


def frames_table(frames: list[np.ndarray], start: int = 0, stream: str = "s1/cam") -> pa.Table:
    arr = pa.FixedShapeTensorArray.from_numpy_ndarray(np.stack(frames))
    n = len(frames)
    return pa.table(
        {
            "event_id": [f"{stream}/video/{start + i}" for i in range(n)],
            "t_ns": pa.array([(start + i) * 40_000_000 for i in range(n)], pa.int64()),
            "frame": arr,
        }
    )


def run(op: FaceBlurOperator, *tables: pa.Table) -> pa.Table:
    """All rows the operator gives for ``tables`` as one stream: each table's ``process``,
    then ``flush`` (rows wait there for look-ahead), in order."""
    outs = [op.process(t) for t in tables] + op.flush()
    return pa.concat_tables([o for o in outs if o.num_rows] or outs[:1])


def out_frames(table: pa.Table) -> np.ndarray:
    return table.column("frame").combine_chunks().to_numpy_ndarray()


def box_mask(b: dict) -> np.ndarray:
    m = np.zeros((H, W), bool)
    m[b["y0"] : b["y1"], b["x0"] : b["x1"]] = True
    return m


def test_face_detected_blurred_inside_identical_outside(op, canvas):
    op.reset()
    out = run(op, frames_table([canvas]))
    boxes = out.column("face_boxes")[0].as_py()
    assert len(boxes) == 1
    b = boxes[0]
    assert b["x0"] < FACE_CENTRE[0] < b["x1"] and b["y0"] < FACE_CENTRE[1] < b["y1"]
    assert b["score"] >= 0.5
    got = out_frames(out)[0]
    diff = np.abs(got.astype(np.int16) - canvas.astype(np.int16))
    inside = box_mask(b)
    assert diff[inside].mean() > 30
    assert np.array_equal(got[~inside], canvas[~inside])  # bit-identical outside the box
    assert out.column("deid")[0].as_py() == {
        "policy": DEFAULT_POLICY_TAG,
        "method": "blur_permute",
        "detector": "mediapipe-face-detection@0.10.21/full-range/tiles2+short-range+mtcnn@facenet-pytorch-2.6.0/0.9",
        "count": 1,
        "threshold": 0.5,
    }
    # other columns pass through untouched
    assert out.column("event_id").to_pylist() == ["s1/cam/video/0"]
    assert out.column("t_ns").to_pylist() == [0]
    assert out.schema == op.output_schema(frames_table([canvas]).schema)


def test_box_grows_to_the_head_more_above_and_below_than_to_the_sides(op, canvas):
    """Head-shaped padding: the detector's box spans brows to mouth; the anonymised box reaches
    the hair above it and the chin and neck below it (``pad_above_ratio``, ``pad_below_ratio``
    of its height) but only ``pad_ratio`` of its width to each side. With the old symmetric
    0.35 the bands half a face height above and below the detection were left as they were."""
    pol = FacePolicy()
    assert pol.pad_above_ratio > pol.pad_ratio and pol.pad_below_ratio > pol.pad_ratio
    raw = max(op._detector.detect(canvas), key=lambda b: b[4])
    rw, rh = raw[2] - raw[0], raw[3] - raw[1]
    op.reset()
    out = run(op, frames_table([canvas]))
    (b,) = out.column("face_boxes")[0].as_py()
    assert b["y1"] - raw[3] >= (pol.pad_below_ratio - 0.05) * rh and raw[1] - b["y0"] >= (pol.pad_above_ratio - 0.1) * rh
    assert raw[0] - b["x0"] <= (pol.pad_ratio + 0.1) * rw and b["x1"] - raw[2] <= (pol.pad_ratio + 0.1) * rw
    got = out_frames(out)[0]
    cols = slice(int(raw[0] + 0.25 * rw), int(raw[2] - 0.25 * rw))
    for rows in (slice(int(raw[3] + 0.45 * rh), int(raw[3] + 0.55 * rh)),  # chin and neck
                 slice(max(0, int(raw[1] - 0.55 * rh)), int(raw[1] - 0.45 * rh))):  # forehead and hair
        assert np.abs(got[rows, cols].astype(np.int16) - canvas[rows, cols]).mean() > 20
    side = slice(int(raw[2] + (pol.pad_ratio + 0.1) * rw), int(raw[2] + (pol.pad_ratio + 0.2) * rw))
    mid = slice(int(raw[1]), int(raw[3]))
    assert np.array_equal(got[mid, side], canvas[mid, side])  # beyond the side padding: untouched


def test_input_buffer_never_written(op, canvas):
    op.reset()
    table = frames_table([canvas, canvas])
    before = out_frames(table).copy()
    out = run(op, table)
    view_in = out_frames(table)
    assert np.array_equal(view_in, before)
    assert not np.shares_memory(view_in, out_frames(out))


def test_output_deterministic_for_a_secret_and_keyed(op, canvas):
    op.reset()
    t = frames_table([canvas])
    a = out_frames(run(op, t))[0]
    op.reset()
    b = out_frames(run(op, t))[0]
    assert np.array_equal(a, b)
    other = FaceBlurOperator(FaceBlurConfig(secret=b"x" * 32))
    other._detector = op._detector  # share the loaded model
    other.setup()
    c = out_frames(run(other, t))[0]
    assert not np.array_equal(a, c)  # a different key permutes differently
    assert np.array_equal(np.sort(a.reshape(-1, 3), axis=0), np.sort(c.reshape(-1, 3), axis=0))


def test_missed_detection_inside_window_still_covered(op, canvas, blacked):
    assert op._detector.detect(blacked) == []  # precondition: nothing found on this frame
    op.reset()
    out = run(op, frames_table([canvas, canvas, blacked, canvas, canvas]))
    counts = [h["count"] for h in out.column("deid").to_pylist()]
    assert counts == [1, 1, 1, 1, 1]
    b = out.column("face_boxes")[2].as_py()[0]
    assert b["x0"] < FACE_CENTRE[0] < b["x1"] and b["y0"] < FACE_CENTRE[1] < b["y1"]
    got = out_frames(out)[2]
    inside = box_mask(b)
    assert np.array_equal(got[~inside], blacked[~inside])


def test_window_zero_without_tracking_does_not_spread(op, canvas, blacked):
    o = FaceBlurOperator(FaceBlurConfig(secret=SECRET, face=FacePolicy(temporal_window=0, tile_every=1,
                                                                       track_hold_s=0)))
    o._detector = op._detector
    o.setup()
    out = run(o, frames_table([canvas, blacked, canvas]))
    assert [h["count"] for h in out.column("deid").to_pylist()] == [1, 0, 1]
    assert np.array_equal(out_frames(out)[1], blacked)


def test_boxes_carry_into_next_call(op, canvas, blacked):
    op = FaceBlurOperator(FaceBlurConfig(secret=SECRET, face=FacePolicy(track_hold_s=0)))  # the window alone
    op.setup()
    op.reset()
    first = op.process(frames_table([canvas, canvas], start=0))
    assert first.num_rows == 0  # both wait: the window (2 frames) looks ahead into the next table
    out = run(op, frames_table([blacked, blacked, blacked], start=2))
    assert out.column("event_id").to_pylist() == [f"s1/cam/video/{i}" for i in range(5)]
    # the last face was frame 1: it covers frames 2 and 3 (window 2), not 4
    assert [h["count"] for h in out.column("deid").to_pylist()] == [1, 1, 1, 1, 0]
    # and a face in the next table covers the last frames of this one (window 2), not earlier ones
    op.process(frames_table([blacked] * 3, start=0))
    out = run(op, frames_table([canvas], start=3))
    assert [h["count"] for h in out.column("deid").to_pylist()] == [0, 1, 1, 1]
    # another stream, or a reset, gets no carry
    run(op, frames_table([canvas, canvas], start=0))
    other = run(op, frames_table([blacked], start=2, stream="s1/other"))
    assert other.column("deid")[0].as_py()["count"] == 0
    op.process(frames_table([canvas, canvas], start=0))
    op.reset()
    again = run(op, frames_table([blacked], start=2))
    assert again.column("deid")[0].as_py()["count"] == 0
    # re-processing an earlier table does not pick up the carry (deterministic output)
    op.reset()
    t = frames_table([blacked], start=0)
    first = run(op, t)
    run(op, frames_table([canvas], start=0))
    assert run(op, t).equals(first)


def test_an_unflushed_stream_is_withheld_not_emitted_elsewhere(op, canvas, caplog):
    import logging

    op.reset()
    assert op.process(frames_table([canvas] * 3)).num_rows == 0  # held: their look-ahead is not complete
    with caplog.at_level(logging.WARNING, logger="modalign.operators.deid.faces"):
        out = run(op, frames_table([canvas] * 2, stream="s2/cam"))
    assert out.column("event_id").to_pylist() == ["s2/cam/video/0", "s2/cam/video/1"]
    assert "3 held frame(s)" in caplog.text


def test_keep_action_passes_frames_through(canvas):
    o = FaceBlurOperator(FaceBlurConfig(face=FacePolicy(action="keep")))
    table = frames_table([canvas])
    out = o.process(table)
    assert o._detector is None  # no model loaded for keep
    assert np.array_equal(out_frames(out)[0], canvas)
    assert out.column("face_boxes")[0].as_py() == []
    h = out.column("deid")[0].as_py()
    assert (h["method"], h["count"], h["detector"]) == ("keep", 0, "none")


def test_detection_failure_withholds_frame(op, canvas):
    class Broken:
        name = "broken@0"

        def detect(self, img):
            raise RuntimeError("graph error")

    o = FaceBlurOperator(FaceBlurConfig(secret=SECRET))
    o._detector = Broken()  # setup() keeps an injected detector
    with pytest.raises(ComplianceError) as exc:
        run(o, frames_table([canvas], start=7))
    assert "s1/cam/video/7" in str(exc.value)
    assert exc.value.code == "deid_failed"


def test_bad_frame_column_rejected(op):
    with pytest.raises(InputError):
        op.process(pa.table({"frame": pa.array([b"\x00" * 12])}))


def test_anonymise_region_touches_only_the_box():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (120, 160, 3), dtype=np.uint8)
    src = img.copy()
    anonymise_region(img, Box(x0=40, y0=30, x1=100, y1=90), b"k" * 32, "page-1")
    inside = np.zeros(img.shape[:2], bool)
    inside[30:90, 40:100] = True
    assert np.array_equal(img[~inside], src[~inside])
    assert not np.array_equal(img[inside], src[inside])
    # the same key and salt reproduce the output; a box partly outside the image is clipped
    again = src.copy()
    anonymise_region(again, (40, 30, 100, 90), b"k" * 32, "page-1")
    assert np.array_equal(again, img)
    edge = src.copy()
    anonymise_region(edge, (150, 110, 400, 400), b"k" * 32, "page-1")
    assert np.array_equal(edge[:110], src[:110]) and np.array_equal(edge[:, :150], src[:, :150])
    with pytest.raises(ValueError):
        ro = src.copy()
        ro.flags.writeable = False
        anonymise_region(ro, (0, 0, 10, 10), b"k" * 32, "x")


def test_deid_modules_import_no_heavy_packages():
    code = (
        "import sys, modalign.operators.deid.faces, modalign.operators.deid.text, modalign.operators.deid.voice, modalign.operators.deid.keystore\n"
        "heavy = {'cv2', 'mediapipe', 'spacy', 'torch', 'ray'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- small faces, tiling, mask ---------------------------------------------------------------
def test_small_faces_in_720p_found_with_tiles(op):
    """Cluttered 1280x720 frames with faces 55-146 px wide: the whole-frame pass misses some."""
    from modalign.pipeline.deid_eval import make_face_samples

    samples = make_face_samples(12, seed=4, size=(1280, 720))
    whole = FaceBlurOperator(FaceBlurConfig(secret=SECRET, face=FacePolicy(tiles=1, still_model="none")))
    whole.setup()
    still = FaceBlurOperator(FaceBlurConfig(secret=SECRET, face=FacePolicy(tiles=1)))  # + the still model
    still.setup()

    def covered(o, s) -> bool:
        o.reset()
        out = run(o, frames_table([s.image]))
        fx0, fy0, fx1, fy1 = s.box
        boxes = out.column("face_boxes")[0].as_py()
        hit = any(b["x0"] <= fx0 and b["y0"] <= fy0 and b["x1"] >= fx1 and b["y1"] >= fy1 for b in boxes)
        if hit:  # and the face pixels really changed
            got = out_frames(out)[0]
            assert np.abs(got[fy0:fy1, fx0:fx1].astype(np.int16) - s.image[fy0:fy1, fx0:fx1]).mean() > 30
        return hit

    assert sum(covered(whole, s) for s in samples) <= 10  # the gap the tiles close
    assert all(covered(op, s) for s in samples)
    assert all(covered(still, s) for s in samples)  # and, on a still, the still model (MTCNN) alone


def test_tile_regions_cover_the_frame_with_overlap():
    from modalign.operators.deid.faces import tile_regions

    regions = tile_regions(1280, 720, 2)
    assert regions[0] == (0, 0, 1280, 720) and len(regions) == 5
    tiles = regions[1:]
    assert min(t[0] for t in tiles) == 0 and max(t[2] for t in tiles) == 1280
    assert min(t[1] for t in tiles) == 0 and max(t[3] for t in tiles) == 720
    assert tiles[0][2] - tiles[1][0] >= 0.25 * (tiles[0][2] - tiles[0][0]) - 1  # neighbours overlap by a quarter
    assert tile_regions(320, 240, 2) == [(0, 0, 320, 240)]  # small frames: whole frame only


def test_tiled_pass_every_other_frame_only_in_dense_streams(canvas):
    class Counting:
        name = "counting@0"

        def __init__(self):
            self.calls = []

        def detect(self, img, tiled=True, fine=True):
            self.calls.append("TF" if tiled and fine else "T" if tiled else "F" if fine else "-")
            return []

    o = FaceBlurOperator(FaceBlurConfig(secret=SECRET))
    o._detector = Counting()
    run(o, frames_table([canvas] * 5))  # 40 ms apart
    run(o, frames_table([canvas] * 7))
    # every other frame is scanned (the frames between are not detected at all: the tracks carry
    # their faces): every other scan with the tiles and the second model's finer grid, the scans
    # between with the whole frame (and a closer look where a track was missed); the stream's last
    # frame gets both passes
    assert o._detector.calls[:3] == ["TF", "-", "TF"]  # frames 0, 2, 4
    assert o._detector.calls[3:] == ["TF", "-", "TF", "TF"]  # frames 0, 2, 4, 6
    # by position in the stream, not in the table: 12 frames in tables of 5 and 7 are one stream of 12
    o._detector.calls.clear()
    one_stream = ["TF", "-", "TF", "-", "TF", "-", "TF"]  # frames 0, 2, 4, 6, 8, 10, 11
    run(o, frames_table([canvas] * 5), frames_table([canvas] * 7, start=5))
    assert o._detector.calls == one_stream
    o = FaceBlurOperator(FaceBlurConfig(secret=SECRET))  # tables of one row
    o._detector = Counting()
    run(o, *[frames_table([canvas], start=i) for i in range(12)])
    assert o._detector.calls == one_stream
    # the static window (no tracking) covers only its neighbours: every scanned frame gets the tiles
    o = FaceBlurOperator(FaceBlurConfig(secret=SECRET, face=FacePolicy(track_hold_s=0, temporal_window=1)))
    o._detector = Counting()
    run(o, *[frames_table([canvas], start=i) for i in range(12)])
    assert o._detector.calls == ["TF", "-", "T", "-", "TF", "-", "T", "-", "TF", "-", "T", "TF"]
    o._detector.calls.clear()
    sparse = frames_table([canvas] * 3).set_column(1, "t_ns", pa.array([0, 1_000_000_000, 2_000_000_000], pa.int64()))
    run(o, sparse)  # 1 s apart (sampled frames): the tracks cannot bridge, every frame is tiled
    assert o._detector.calls == ["TF"] * 3
    # full_every 4: with tracking, every 4th scan (every 8th frame) gets the tiles and the fine grid;
    # by stream position, for any batching
    four = ["TF", "-", "-", "-", "TF", "-", "-", "-", "TF", "TF"]  # frames 0, 2, ..., 16, 17
    for tables in ([frames_table([canvas] * 5), frames_table([canvas] * 13, start=5)],
                   [frames_table([canvas], start=i) for i in range(18)]):
        o = FaceBlurOperator(FaceBlurConfig(secret=SECRET, face=FacePolicy(full_every=4)))
        o._detector = Counting()
        run(o, *tables)
        assert o._detector.calls == four


def test_mask_action_fills_the_box_with_one_colour(op, canvas):
    o = FaceBlurOperator(FaceBlurConfig(secret=SECRET, face=FacePolicy(action="mask")))
    o._detector = op._detector
    o.setup()
    out = run(o, frames_table([canvas]))
    b = out.column("face_boxes")[0].as_py()[0]
    got = out_frames(out)[0]
    region = got[b["y0"]:b["y1"], b["x0"]:b["x1"]].reshape(-1, 3)
    assert (region == region[0]).all()
    assert np.array_equal(got[~box_mask(b)], canvas[~box_mask(b)])
    assert out.column("deid")[0].as_py()["method"] == "mask"


def test_face_the_first_detector_misses_is_caught_by_the_second_pass():
    """LFW subset face 70 (25x25, upscaled to 160 px): the full-range model misses it whole and
    on every tile; the short-range model on the tiles finds it, and the operator blurs it."""
    import cv2
    from skimage.data import lfw_subset

    from modalign.operators.deid.faces import _MediapipeDetector

    img = np.full((720, 1280, 3), 110, np.uint8)
    face = cv2.resize((lfw_subset()[70] * 255).round().astype(np.uint8), (160, 160), interpolation=cv2.INTER_CUBIC)
    img[280:440, 560:720] = face[..., None]
    assert _MediapipeDetector(1, 0.5, 2, second=False).detect(img) == []  # the first pass alone misses it
    o = FaceBlurOperator(FaceBlurConfig(secret=SECRET))
    o.setup()
    out = run(o, frames_table([img]))
    (b,) = out.column("face_boxes")[0].as_py()
    assert b["x0"] <= 580 and b["y0"] <= 300 and b["x1"] >= 700 and b["y1"] >= 420  # the face's centre 120 px
    got = out_frames(out)[0]
    assert np.abs(got[300:420, 580:700].astype(np.int16) - img[300:420, 580:700]).mean() > 20
    assert run(o, frames_table([img])).equals(out)  # deterministic


def test_second_look_near_a_lost_track_refinds_the_face(op, canvas):
    """``detect_near`` on a crop around a tracked face's predicted box finds the face there."""
    (b,) = [x for x in op._detector.detect(canvas) if x[4] >= 0.5][:1]
    near = op._detector.detect_near(canvas, [(b[0] - 20, b[1] - 20, b[2] + 20, b[3] + 20)])
    assert near and any(n[0] < FACE_CENTRE[0] < n[2] and n[1] < FACE_CENTRE[1] < n[3] for n in near)


# -- low-resolution faces filling their crop; low-detail faces linked by their tones -------------
def _lfw_still(index: int, side: int, x: int, y: int, background: str | None = None) -> np.ndarray:
    """LFW subset face ``index`` (25x25 grey, a tight crop: the face fills it) upscaled to
    ``side`` px and pasted at (x, y) on a 1280x720 frame: a skimage photo ``background``, or
    mid-grey with some texture."""
    import cv2
    from skimage import data
    from skimage.data import lfw_subset

    if background is None:
        rng = np.random.default_rng(index)
        img = np.clip(rng.normal(120, 12, (720, 1280, 3)), 0, 255).astype(np.uint8)
    else:
        b = getattr(data, background)()
        b = np.stack([b] * 3, -1) if b.ndim == 2 else b[..., :3]
        img = cv2.resize(b, (1280, 720), interpolation=cv2.INTER_AREA)
    face = cv2.resize((lfw_subset()[index] * 255).round().astype(np.uint8), (side, side), interpolation=cv2.INTER_CUBIC)
    img[y:y + side, x:x + side] = face[..., None]
    return img


# (background, LFW index, side, x, y): faces the whole frame, the 2x2 tiles and the 3x3 grid miss
CLOSE_CASES = [("coffee", 62, 107, 1013, 50), ("coffee", 89, 134, 521, 169), ("camera", 76, 105, 890, 91),
               ("grass", 26, 132, 410, 395)]


def test_low_resolution_face_filling_its_crop_found_on_the_close_grid():
    """A 25 px face upscaled to ~100-130 px (no margin around it): the short-range model sees it
    at 25-32 px on its 3x3 grid and misses it; on the close grid's square tiles (36-46 px) it
    finds it, and the operator covers the whole square."""
    from modalign.operators.deid.faces import _MediapipeDetector, close_regions

    det = _MediapipeDetector(1, 0.5, 2, second=True)
    o = FaceBlurOperator(FaceBlurConfig(secret=SECRET))
    o._detector = det
    regions = close_regions(1280, 720)
    assert len(regions) == 15 and all(r[2] - r[0] == r[3] - r[1] == 360 for r in regions)
    found = 0
    for background, index, side, x, y in CLOSE_CASES:
        img = _lfw_still(index, side, x, y, background)
        assert not any(b[4] >= 0.5 and b[0] < x + side / 2 < b[2] and b[1] < y + side / 2 < b[3]
                       for b in det.detect(img)), index  # precondition: the grids before miss it
        o.reset()
        out = run(o, frames_table([img]))
        mask = np.zeros((720, 1280), bool)
        for b in out.column("face_boxes")[0].as_py():
            mask[b["y0"]:b["y1"], b["x0"]:b["x1"]] = True
        cover = mask[y:y + side, x:x + side].mean()
        found += cover >= 0.9
        if cover >= 0.9:
            got = out_frames(out)[0]
            assert np.abs(got[y:y + side, x:x + side].astype(np.int16) - img[y:y + side, x:x + side]).mean() > 20
    assert found == len(CLOSE_CASES)


# (LFW index, side, x, y, background): weak detections (under CONFIRM_SCORE) of real faces
# (LFW 59, 107 px at (155, 446) on "camera" was a third case: its closer look scores 0.70 +- 0.05 as
# the crop moves by a pixel, on VERIFY_SCORE's edge, and the head-shaped padding moved it under)
VERIFY_CASES = [(9, 102, 901, 450, None), (9, 102, 901, 450, "grass")]


@pytest.mark.parametrize("index,side,x,y,background", VERIFY_CASES)
def test_weak_detection_of_a_real_face_is_verified_at_the_face_scale_not_the_padded_box(index, side, x, y, background,
                                                                                       monkeypatch):
    """Defect: the closer look that keeps a weak detection cropped twice the *padded* box (3.4
    face sides with the head-sized padding), where the short-range model scores these LFW faces
    under VERIFY_SCORE, so they were dropped and left bare. Looked at in crops of 1.5 and 2
    face sides they verify, and the face is covered and changed."""
    from modalign.operators.deid import faces as mod
    from modalign.operators.deid.face_tracks import CONFIRM_SCORE

    monkeypatch.setattr(mod, "CLOSE_SIDES", (0.5,))  # the second close grid finds one of these faces surely
    img = _lfw_still(index, side, x, y, background)
    o = FaceBlurOperator(FaceBlurConfig(secret=SECRET))
    o.setup()
    raw = [b for b in o._detector.detect(img) + o._detector.detect_close(img)
           if b[0] < x + side / 2 < b[2] and b[1] < y + side / 2 < b[3] and b[4] >= 0.5]
    assert raw and max(b[4] for b in raw) < CONFIRM_SCORE  # precondition: only weak detections
    out = run(o, frames_table([img]))
    mask = np.zeros((720, 1280), bool)
    for b in out.column("face_boxes")[0].as_py():
        mask[b["y0"]:b["y1"], b["x0"]:b["x1"]] = True
    assert mask[y:y + side, x:x + side].mean() >= 0.9
    got = out_frames(out)[0]
    assert np.abs(got[y:y + side, x:x + side].astype(np.int16) - img[y:y + side, x:x + side]).mean() > 20


def test_blur_permute_leaves_no_low_frequency_structure_of_a_low_detail_face():
    """A face upscaled from 25 px has only low-frequency detail. Inside the anonymised box the
    8x8 low-pass image keeps none of the face's layout (correlation with the original's ~0),
    and the tones are pulled to the box's mean (spread a small fraction of the original's),
    so neither where the dark and light parts were nor how much of each is left."""
    import cv2

    img = _lfw_still(70, 160, 560, 280)
    src = img.copy()
    box = (540, 260, 740, 460)  # the face padded, as a detection box would be
    anonymise_region(img, box, SECRET, "s1/cam/video/0", 0.15)
    x0, y0, x1, y1 = box
    lo = lambda a: cv2.resize(a[y0:y1, x0:x1, 0].astype(np.float32), (8, 8), interpolation=cv2.INTER_AREA)  # noqa: E731
    lo_src, lo_out = lo(src), lo(img)
    structure = lo_src - lo_src.mean()
    assert np.abs(structure).mean() > 15  # precondition: the face has low-frequency structure
    assert np.abs(lo_out - lo_out.mean()).mean() < 0.1 * np.abs(structure).mean()
    assert abs(np.corrcoef(lo_src.ravel(), lo_out.ravel())[0, 1]) < 0.5
    assert np.abs(lo_out - lo_src).mean() >= 0.8 * np.abs(structure).mean()  # differs by the face's own structure
    assert img[y0:y1, x0:x1].std() < 0.35 * src[y0:y1, x0:x1].std()  # the tones' spread mostly gone
    assert np.array_equal(np.delete(img, np.s_[y0:y1], 0), np.delete(src, np.s_[y0:y1], 0))


def test_close_up_filling_the_frame_found_by_the_zoom_out_pass(monkeypatch):
    """A real LFW face upscaled to fill a 640x360 frame's height is missed by every grid (no
    context around it); the zoom-out pass (frame padded to 1.5 sides, both models agree) finds it."""
    import cv2
    from skimage.data import coffee, lfw_subset

    from modalign.operators.deid import faces as mod

    face = (lfw_subset()[1] * 255).round().astype(np.uint8)
    img = cv2.resize(coffee(), (W, H), interpolation=cv2.INTER_AREA)
    x = (W - H) // 2
    img[:, x:x + H] = cv2.resize(face, (H, H), interpolation=cv2.INTER_CUBIC)[..., None]

    def boxes(face: FacePolicy = FacePolicy(still_model="none")) -> list:  # MediaPipe's passes alone
        o = FaceBlurOperator(FaceBlurConfig(secret=SECRET, face=face))
        o.setup()
        out = [o.process(frames_table([img]))] + o.flush()
        return [b for t in out for bs in t.column("face_boxes").to_pylist() for b in bs]

    found = boxes()
    assert found, "the close-up was not covered"
    b = found[0]
    assert b["x0"] <= x + H * 0.3 and b["x1"] >= x + H * 0.7 and b["y0"] <= H * 0.3 and b["y1"] >= H * 0.7
    assert boxes(FacePolicy()), "the default policy (the still model too) lost the close-up"
    monkeypatch.setattr(mod, "ZOOM_OUT", 0)
    assert boxes() == []


def test_unchanged_regions_get_their_last_detections_changed_ones_are_detected_again(canvas, blacked):
    """``FacePolicy.reuse_threshold``: a region whose 8x8 cells all moved by less than the
    threshold since a model last ran on it gets that run's answer; a changed one is run again."""
    from modalign.operators.deid.faces import SECOND_TILES, _MediapipeDetector, tile_regions

    regions = len(tile_regions(W, H, 2)) + len(tile_regions(W, H, SECOND_TILES)) - 1
    det = _MediapipeDetector(1, 0.5, 2, second=True, reuse_levels=12)
    first = det.detect(canvas)
    assert any(b[0] < FACE_CENTRE[0] < b[2] and b[1] < FACE_CENTRE[1] < b[3] for b in first)
    assert (det.detected, det.reused) == (regions, 0)
    noisy = np.clip(canvas.astype(int) + np.random.default_rng(0).integers(-3, 4, canvas.shape), 0, 255).astype(np.uint8)
    assert det.detect(noisy) == first and det.reused == regions  # re-encoding noise: the same answer
    hidden = det.detect(blacked)  # the face's regions changed: run again, and the face is gone from them
    assert regions < det.detected < 2 * regions
    assert not any(b[0] < FACE_CENTRE[0] < b[2] and b[1] < FACE_CENTRE[1] < b[3] for b in hidden)
    ran, reused = det.detected, det.reused
    det.forget()  # a new stream: nothing is reused
    assert det.detect(canvas) == first and (det.detected - ran, det.reused - reused) == (regions, 0)
    off = _MediapipeDetector(1, 0.5, 2, second=True, reuse_levels=0)
    off.detect(canvas), off.detect(canvas)
    assert off.reused == 0


def test_reuse_gives_the_boxes_of_detecting_every_region(canvas, blacked):
    """A clip of a still face, hidden for a while, then back: the same boxes in every frame with
    reuse on as with it off."""
    clip = [canvas] * 8 + [blacked] * 10 + [canvas] * 8
    boxes = {}
    for levels in (0, 12):
        o = FaceBlurOperator(FaceBlurConfig(secret=SECRET, face=FacePolicy(reuse_threshold=levels)))
        boxes[levels] = run(o, frames_table(clip[:11]), frames_table(clip[11:], start=11)).column("face_boxes").to_pylist()
        if levels:
            assert o._detector.reused > 0
    assert boxes[12] == boxes[0]


def test_weak_face_at_the_frame_edge_is_verified_on_the_detection_not_its_clipped_padded_box(monkeypatch):
    """A weak detection of a real face touching the top of the frame: its padded box is cut off
    there, so taking the padding back off that box put the closer look's crop off the face, it
    did not verify and the face was left bare. The closer look is measured on the detection
    itself and the face is covered (LFW face 96 on a vtest.avi frame, as in deid-eval)."""
    import cv2

    from modalign.operators.deid import faces as mod
    from modalign.pipeline.deid_eval.faces import _backgrounds, _lfw_faces, opencv_video

    if opencv_video("vtest.avi", 1) is None:
        pytest.skip("Debian opencv-doc (vtest.avi) not installed")
    img = _backgrounds(97, (1280, 720))[96].copy()
    x, y, side = 459, 23, 149
    img[y:y + side, x:x + side] = cv2.resize(_lfw_faces()[0][96], (side, side), interpolation=cv2.INTER_CUBIC)[..., None]

    def cover() -> float:  # MediaPipe and its closer look alone (the still model confirms this face too)
        o = FaceBlurOperator(FaceBlurConfig(secret=SECRET, face=FacePolicy(still_model="none")))
        o.setup()
        out = run(o, frames_table([img]))
        mask = np.zeros((720, 1280), bool)
        for b in out.column("face_boxes")[0].as_py():
            assert b["y0"] == 0  # the padded box is clipped at the frame's top
            mask[b["y0"]:b["y1"], b["x0"]:b["x1"]] = True
        return float(mask[y:y + side, x:x + side].mean())

    assert cover() >= 0.9
    pad_clip = mod._pad_clip  # the detections not recorded: the closer look unpads the clipped box, as before
    monkeypatch.setattr(mod, "_pad_clip", lambda raw, pol, w, h, faces=None: pad_clip(raw, pol, w, h))
    assert cover() == 0.0


def test_face_the_half_height_close_grid_misses_is_found_on_the_second_close_grid(monkeypatch):
    """An LFW face upscaled to 130 px at the bottom edge of a still: the short-range model misses
    it on every tile of the half-height close grid; the second close grid (tiles of 0.4 of the
    frame's height) finds it, it is verified up close, and the whole square is covered and changed."""
    from modalign.operators.deid import faces as mod

    x, y, side = 697, 572, 130
    img = _lfw_still(4, side, x, y, "camera")
    assert mod.CLOSE_SIDES == (0.5, 0.4)

    def cover() -> tuple[float, np.ndarray]:  # MediaPipe's passes alone (the still model finds it too)
        o = FaceBlurOperator(FaceBlurConfig(secret=SECRET, face=FacePolicy(still_model="none")))
        o.setup()
        out = run(o, frames_table([img]))
        mask = np.zeros((720, 1280), bool)
        for b in out.column("face_boxes")[0].as_py():
            mask[b["y0"]:b["y1"], b["x0"]:b["x1"]] = True
        return float(mask[y:y + side, x:x + side].mean()), out_frames(out)[0]

    covered, got = cover()
    assert covered >= 0.9
    assert np.abs(got[y:y + side, x:x + side].astype(np.int16) - img[y:y + side, x:x + side]).mean() > 20
    monkeypatch.setattr(mod, "CLOSE_SIDES", (0.5,))  # the half-height grid alone
    assert cover()[0] == 0.0


def test_a_turned_face_both_mediapipe_models_miss_is_found_by_the_still_model():
    """LFW face 30 (turned, low detail, upscaled x5 onto a photo): neither MediaPipe model finds it
    on any grid, closer look or zoom-out; the still model (MTCNN, another family) does, on a still,
    and the whole face is covered and changed."""
    x, y, side = 300, 200, 120
    img = _lfw_still(30, side, x, y, "camera")

    def cover(face: FacePolicy) -> tuple[float, np.ndarray, str]:
        o = FaceBlurOperator(FaceBlurConfig(secret=SECRET, face=face))
        o.setup()
        out = run(o, frames_table([img]))
        mask = np.zeros((720, 1280), bool)
        for b in out.column("face_boxes")[0].as_py():
            mask[b["y0"]:b["y1"], b["x0"]:b["x1"]] = True
        return float(mask[y:y + side, x:x + side].mean()), out_frames(out)[0], out.column("deid")[0].as_py()["detector"]

    covered, got, detector = cover(FacePolicy())
    assert covered == 1.0 and "+mtcnn@facenet-pytorch-" in detector
    assert np.abs(got[y:y + side, x:x + side].astype(np.int16) - img[y:y + side, x:x + side]).mean() > 20
    assert cover(FacePolicy(still_model="none"))[0] == 0.0


def test_the_still_model_runs_on_sparse_frames_only(monkeypatch):
    """MTCNN costs ~115 ms per 720p frame: in a dense 25 fps stream it sees the stream's last frame
    only (the tracks cover the rest); frames a second apart (sampled) each get it."""
    from modalign.operators.deid import faces as mod

    calls = []
    real = mod._MtcnnDetector.detect
    monkeypatch.setattr(mod._MtcnnDetector, "detect", lambda self, rgb: calls.append(1) or real(self, rgb))
    img = _lfw_still(3, 120, 300, 200, "camera")
    for step_ns, want in ((40_000_000, 1), (1_000_000_000, 6)):
        calls.clear()
        o = FaceBlurOperator(FaceBlurConfig(secret=SECRET))
        o.setup()
        table = frames_table([img] * 6)
        table = table.set_column(table.schema.get_field_index("t_ns"), "t_ns",
                                 pa.array([k * step_ns for k in range(6)], pa.int64()))
        out = run(o, table)
        assert out.num_rows == 6 and len(calls) == want


def test_a_range_cut_is_no_last_frame_and_the_still_model_loads_on_first_use(monkeypatch):
    """A video range that ends in a cut (the next range goes on) flushes with ``cut``: its last
    frame is scanned as the dense frame it is in the whole video, so the still model neither
    runs nor loads (an actor that only decodes such ranges never imports it). The same frames
    flushed as a stream's end get it on the last frame. Both cover the face in every frame."""
    from modalign.operators.deid import faces as mod

    calls = []
    real = mod._MtcnnDetector.detect
    monkeypatch.setattr(mod._MtcnnDetector, "detect", lambda self, rgb: calls.append(1) or real(self, rgb))
    img = _lfw_still(3, 120, 300, 200, "camera")
    table = frames_table([img] * 6)
    table = table.set_column(table.schema.get_field_index("t_ns"), "t_ns",
                             pa.array([k * 40_000_000 for k in range(6)], pa.int64()))
    outs = {}
    for cut in (True, False):
        calls.clear()
        o = FaceBlurOperator(FaceBlurConfig(secret=SECRET))
        o.setup()
        assert o._still is None  # nothing loaded at setup
        got = [o.process(table)] + o.flush(cut=cut)
        outs[cut] = pa.concat_tables([t for t in got if t.num_rows])
        assert outs[cut].num_rows == 6
        assert len(calls) == (0 if cut else 1) and (o._still is None) == cut
        assert o.detector_name.endswith("+mtcnn@facenet-pytorch-2.6.0/0.9")  # the same name, loaded or not
        frames = out_frames(outs[cut])
        assert all((frames[k][200:320, 300:420] != img[200:320, 300:420]).mean() > 0.9 for k in range(6))
