"""Faces fail closed: a tracked face keeps a box that follows it through missed detections.

Defects (issue 11): frames with no box while the face moved, and a carried box left behind
where the face had been. The first tests drive the tracker with detections as a detector
reports them; the last ones run the real detector on a real face (skimage's astronaut)
moving over a background, with motion blur that makes the detector miss it.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from modalign.operators.deid.face_tracks import MIN_MISSES, FaceTracks
from modalign.operators.deid.faces import FaceBlurConfig, FaceBlurOperator
from modalign.schemas.policy import FacePolicy

pytestmark = pytest.mark.unit

FRAME_NS = 40_000_000  # 25 fps
H, W = 360, 640
SIDE = 110
SPEED = 300  # px per second, to the right


def face_at(i: int) -> tuple[int, int, int, int]:
    x0 = 60 + SPEED * i * FRAME_NS // 1_000_000_000
    return x0, 120, x0 + SIDE, 120 + SIDE


def covers(box, truth) -> bool:
    return box[0] <= truth[0] and box[1] <= truth[1] and box[2] >= truth[2] and box[3] >= truth[3]


def test_a_missed_moving_face_is_covered_where_it_moved_to():
    tracks = FaceTracks(W, H, hold_s=0.5)
    for i in range(10):  # seen in frames 0..9, moving right
        assert tracks.step(i * FRAME_NS, [(*face_at(i), 0.9)]) == []
    for i in range(10, 20):  # missed for 0.4 s while it keeps moving
        (box,) = tracks.step(i * FRAME_NS, [])
        assert covers(box, face_at(i)), (i, box, face_at(i))
    # a box left where the face was last seen (the old carry) would not have covered it
    assert not covers((*face_at(9), 0.9), face_at(15))


def test_a_track_ends_only_after_enough_misses_for_long_enough():
    tracks = FaceTracks(W, H, hold_s=0.5)
    tracks.step(0, [(*face_at(0), 0.9)])
    carried = [len(tracks.step(i * FRAME_NS, [])) for i in range(1, 20)]
    last = max(i for i, n in enumerate(carried, start=1) if n)
    assert last * FRAME_NS <= 0.5e9 < (last + 1) * FRAME_NS  # held for hold_s, then gone
    assert carried[:last] == [1] * last and not any(carried[last:])
    sparse = FaceTracks(W, H, hold_s=0.5)  # 1 fps: time alone would end it at once
    sparse.step(0, [(*face_at(0), 0.9)])
    assert [len(sparse.step(s * 1_000_000_000, [])) for s in range(1, 5)] == [1] * (MIN_MISSES - 1) + [0, 0]


def test_detections_continue_their_track_and_time_going_back_starts_over():
    tracks = FaceTracks(W, H, hold_s=0.5)
    tracks.step(0, [(*face_at(0), 0.9)])
    tracks.step(FRAME_NS, [(*face_at(1), 0.9), (500, 10, 560, 70, 0.8)])  # the face, and a second one
    assert len(tracks.tracks) == 2 and tracks.tracks[0].vel[0] > 0  # the moving face has a velocity
    assert tracks.step(0, []) == []  # the same times again (a re-processed table): no state from before


def test_a_box_beside_a_tracked_face_continues_nothing_when_the_face_is_found_too():
    """A weak box below a tracked face (a body, reaching into the face's padded box) does not
    continue the face's track while the face's own detection is there: the track takes its best
    match, so the weak box still needs its closer look. Alone, it would continue the track."""
    tracks = FaceTracks(W, H, hold_s=0.5)
    face = (100, 50, 200, 170, 0.95)
    tracks.step(0, [face])
    body = (110, 150, 210, 260, 0.55)  # its top overlaps the face's box by more than MATCH_OVERLAP
    assert tracks.continuing(FRAME_NS, [face, body]) == [face]
    assert tracks.continuing(FRAME_NS, [body]) == [body]
    assert tracks.continuing(0, [face]) == []  # time did not advance: no track is continued
    assert len(tracks.tracks) == 1  # no state change


@pytest.fixture(scope="module")
def moving_face() -> list[np.ndarray]:
    """A real face crossing a grey background at 300 px/s; frames 12-17 motion-blurred (fast pan)."""
    import cv2
    from skimage.data import astronaut

    face = cv2.resize(astronaut()[30:230, 130:300], (SIDE, int(SIDE * 200 / 170)), interpolation=cv2.INTER_AREA)
    frames = []
    for i in range(30):
        img = np.full((H, W, 3), 90, np.uint8)
        x0, y0 = face_at(i)[:2]
        img[y0:y0 + face.shape[0], x0:x0 + face.shape[1]] = face
        if 12 <= i <= 17:
            img = cv2.filter2D(img, -1, np.ones((1, 51), np.float32) / 51)
        frames.append(img)
    return frames


def _table(frames: list[np.ndarray], start: int = 0) -> pa.Table:
    return pa.table({"event_id": [f"s/cam/video/{start + i}" for i in range(len(frames))],
                     "t_ns": pa.array([(start + i) * FRAME_NS for i in range(len(frames))], pa.int64()),
                     "frame": pa.FixedShapeTensorArray.from_numpy_ndarray(np.stack(frames))})


def _stream(op: FaceBlurOperator, frames: list[np.ndarray], sizes: list[int]) -> pa.Table:
    """The operator's whole output for ``frames`` as one stream cut into tables of ``sizes``
    rows (then ``flush``: rows wait for look-ahead), in stream order."""
    outs, lo = [], 0
    for size in sizes:
        outs.append(op.process(_table(frames[lo:lo + size], lo)))
        lo += size
    assert lo == len(frames)
    outs += op.flush()
    out = pa.concat_tables([o for o in outs if o.num_rows])
    assert out.column("event_id").to_pylist() == [f"s/cam/video/{i}" for i in range(len(frames))]
    return out


def _run(frames: list[np.ndarray], policy: FacePolicy, chunk: int = 10) -> list[list[dict]]:
    op = FaceBlurOperator(FaceBlurConfig(secret=b"k" * 32, face=policy))
    sizes = [min(chunk, len(frames) - s) for s in range(0, len(frames), chunk)]
    return _stream(op, frames, sizes).column("face_boxes").to_pylist()


def _uncovered(boxes: list[list[dict]], frames: list[np.ndarray], first: int = 0) -> list[int]:
    """Frames where the face (the detector's unpadded box on the sharp frame 0, moved with the
    photo; ``frames[0]`` shows it at ``face_at(first)``) is not wholly inside the union of the
    frame's anonymised boxes."""
    from modalign.operators.deid.faces import _MediapipeDetector

    fx0, fy0, fx1, fy1, _ = max(_MediapipeDetector(1, 0.5, 1).detect(frames[0]), key=lambda b: b[4])
    bad = []
    for i, bs in enumerate(boxes):
        dx = face_at(first + i)[0] - face_at(first)[0]
        mask = np.zeros((H, W), bool)
        for b in bs:
            mask[b["y0"]:b["y1"], b["x0"]:b["x1"]] = True
        if not mask[int(fy0):int(np.ceil(fy1)), int(fx0) + dx:int(np.ceil(fx1)) + dx].all():
            bad.append(i)
    return bad


def test_the_real_detector_misses_the_blurred_frames_and_tracking_covers_them(moving_face):
    from modalign.operators.deid.faces import _MediapipeDetector

    det = _MediapipeDetector(1, 0.5, 2)
    missed = [i for i in range(12, 18) if not det.detect(moving_face[i])]
    assert len(missed) >= 3  # precondition: a real miss longer than the temporal window
    without = _run(moving_face, FacePolicy(track_hold_s=0))
    assert _uncovered(without, moving_face)  # the window alone lets the face show
    with_tracks = _run(moving_face, FacePolicy())
    assert _uncovered(with_tracks, moving_face) == []
    assert with_tracks == _run(moving_face, FacePolicy())  # deterministic


# -- issue 11, part 1: interpolation, clip end, weak one-off boxes ---------------------------------
def test_misses_between_detections_are_interpolated_where_the_face_is():
    from modalign.operators.deid.face_tracks import interpolate

    tracks = FaceTracks(W, H, hold_s=0.5)
    seen_at = {0, 1, 2, 7, 8, 12, 13, 14}  # missed in 3..6 (4 frames) and 9..11
    frames = [tracks.update(i * FRAME_NS, [(*face_at(i), 0.8)] if i in seen_at else []) for i in range(15)]
    boxes = interpolate(frames, [i * FRAME_NS for i in range(15)], W, H, back=2, hold_s=0.5)
    for i in range(15):
        assert len(boxes[i]) == 1 and covers(boxes[i][0], face_at(i)), (i, boxes[i])
    # interpolated boxes are tighter than the forward guesses they replace
    assert boxes[5][0][2] - boxes[5][0][0] < frames[5][0].box[2] - frames[5][0].box[0]


@pytest.fixture(scope="module")
def face_leaving_blur() -> list[np.ndarray]:
    """The moving face, sharp in frames 0-26, then motion-blurred beyond detection (27-29): the clip ends."""
    import cv2
    from skimage.data import astronaut

    face = cv2.resize(astronaut()[30:230, 130:300], (SIDE, int(SIDE * 200 / 170)), interpolation=cv2.INTER_AREA)
    frames = []
    for i in range(30):
        img = np.full((H, W, 3), 90, np.uint8)
        x0, y0 = face_at(i)[:2]
        img[y0:y0 + face.shape[0], x0:x0 + face.shape[1]] = face
        if i >= 27:
            img = cv2.filter2D(img, -1, np.ones((1, 71), np.float32) / 71)
        frames.append(img)
    return frames


def test_box_follows_the_face_at_clip_end_no_stale_box(face_leaving_blur):
    from modalign.operators.deid.face_tracks import overlap
    from modalign.operators.deid.faces import _MediapipeDetector

    det = _MediapipeDetector(1, 0.5, 2)
    assert all(not det.detect(face_leaving_blur[i]) for i in (28, 29))  # precondition: the end is missed
    window = _run(face_leaving_blur, FacePolicy(track_hold_s=0), chunk=15)
    assert 29 in _uncovered(window, face_leaving_blur)  # the static window's box stays behind
    tracked = _run(face_leaving_blur, FacePolicy(), chunk=15)
    assert _uncovered(tracked, face_leaving_blur) == []
    for i in range(26, 30):  # every box of the last frames is on the face's new place, one box per face
        assert len(tracked[i]) == 1
        b = tracked[i][0]
        assert overlap((b["x0"], b["y0"], b["x1"], b["y1"]), face_at(i)) > 0.5, (i, b, face_at(i))
        assert (b["x0"] + b["x1"]) / 2 > (face_at(26)[0] + face_at(26)[2]) / 2 + (i - 26) * 6  # it moved on


def test_weak_one_off_detection_on_a_texture_is_not_held_but_a_face_is():
    """A weak false detection on a non-face (LFW subset's non-face 115, upscaled): a closer look
    by both models does not confirm it, so it gets no box (before that check: 4 boxed frames,
    held until two fully scanned frames missed it). The real face, seen once, keeps its box
    for track_hold_s."""
    import cv2
    from skimage.data import astronaut, lfw_subset

    bg = np.full((720, 1280, 3), 120, np.uint8)
    texture = bg.copy()
    patch = cv2.resize((lfw_subset()[115] * 255).round().astype(np.uint8), (80, 80), interpolation=cv2.INTER_CUBIC)
    texture[300:380, 500:580] = patch[..., None]
    face = bg.copy()
    face[200:540, 400:740] = cv2.resize(astronaut(), (340, 340), interpolation=cv2.INTER_AREA)
    op = FaceBlurOperator(FaceBlurConfig(secret=b"k" * 32))

    def boxed_frames(first: np.ndarray) -> list[int]:
        op.reset()
        out = _stream(op, [first] + [bg] * 15, [16])
        return [i for i, bs in enumerate(out.column("face_boxes").to_pylist()) if bs]

    op.setup()
    raw = op._detector.detect(texture)
    assert raw and max(b[4] for b in raw) < 0.75  # precondition: the detector fires, weakly, on the texture
    assert boxed_frames(texture) == []
    assert boxed_frames(face) == list(range(13))  # 0.5 s at 25 fps after the last sight


def test_two_faces_missed_in_the_same_frames_both_keep_their_box():
    from modalign.operators.deid.face_tracks import interpolate

    def other(i: int) -> tuple[int, int, int, int]:  # a second face, moving left, lower down
        x0 = 520 - SPEED * i * FRAME_NS // 1_000_000_000
        return x0, 240, x0 + 90, 330

    tracks = FaceTracks(W, H, hold_s=0.5)
    frames = [tracks.update(i * FRAME_NS, [(*face_at(i), 0.9), (*other(i), 0.8)] if i in (0, 1, 5, 6) else [])
              for i in range(7)]
    boxes = interpolate(frames, [i * FRAME_NS for i in range(7)], W, H, back=2, hold_s=0.5)
    for i in range(7):
        assert len(boxes[i]) == 2, (i, boxes[i])
        assert any(covers(b, face_at(i)) for b in boxes[i]) and any(covers(b, other(i)) for b in boxes[i]), i


# -- issue 11: the same stream gives the same boxes and pixels however it is batched -------------
@pytest.fixture(scope="module")
def entering_face(moving_face) -> list[np.ndarray]:
    """Background only (frames 0-2), then the moving face (with its motion-blurred misses), then
    background again for 0.64 s: a face found late, lost for a while, gone before the end."""
    bg = np.full((H, W, 3), 90, np.uint8)
    return [bg] * 3 + moving_face[3:] + [bg] * 16


def test_every_batching_gives_byte_identical_face_boxes_and_pixels(entering_face):
    """One table, or tables of 1, 3 or 7 rows: the tiled rows sit on the stream's grid, the
    tracks carry across tables and the rows whose boxes a later frame could change wait for it,
    so every column of the output is byte-identical (the frames too)."""
    op = FaceBlurOperator(FaceBlurConfig(secret=b"k" * 32))
    n = len(entering_face)
    ref = _stream(op, entering_face, [n])
    ref_px = ref.column("frame").combine_chunks().to_numpy_ndarray().tobytes()
    for size in (1, 3, 7):
        out = _stream(op, entering_face, [size] * (n // size) + ([n % size] if n % size else []))
        assert out.column("face_boxes").equals(ref.column("face_boxes")), size
        assert out.column("frame").combine_chunks().to_numpy_ndarray().tobytes() == ref_px, size
        assert out.equals(ref), size  # every column
    boxed = [bool(b) for b in ref.column("face_boxes").to_pylist()]
    assert boxed[:3] == [True] * 3  # the face found in frame 3 is covered back in time
    assert all(boxed[3:30]) and not any(boxed[-3:])  # covered through its misses; the track ended
    assert _uncovered(ref.column("face_boxes").to_pylist()[3:30], entering_face[3:30], first=3) == []


def test_hindsight_fed_in_any_chunks_equals_the_whole_stream():
    """``Hindsight`` pops a frame only once later frames cannot change its boxes: popping after
    every frame gives exactly the boxes of one pass over the whole stream (random tracks)."""
    from modalign.operators.deid.face_tracks import Hindsight, interpolate

    rng = np.random.default_rng(1)
    for trial in range(30):
        tracks, hs = FaceTracks(W, H, hold_s=0.5), Hindsight(W, H, back=2, hold_s=0.5)
        frames, times, popped = [], [], []
        faces = [[int(rng.integers(0, 500)), int(rng.integers(0, 250)), int(rng.integers(-8, 9))] for _ in range(3)]
        for i in range(60):
            dets = []
            for f in faces:
                f[0] = min(max(0, f[0] + f[2]), 520)
                if rng.random() < 0.6:  # seen in 60 % of frames
                    dets.append((f[0], f[1], f[0] + 80, f[1] + 90, float(rng.choice([0.6, 0.9]))))
            seen = tracks.update(i * FRAME_NS, dets, confident=bool(i % 2 == 0 or rng.random() < 0.5))
            frames.append(seen)
            times.append(i * FRAME_NS)
            hs.add(i * FRAME_NS, seen, tracks.live())
            popped += hs.pop()
        assert len(popped) < 60  # some frames wait for look-ahead
        popped += hs.pop(end=True)
        whole = interpolate(frames, times, W, H, back=2, hold_s=0.5)
        assert [sorted(b) for b in popped] == [sorted(b) for b in whole], trial


def test_frames_between_two_detections_a_jump_apart_get_both_boxes():
    # a cut (or a swing) between two scans: the face is at one end or the other, never on the line
    # between them (Megamind.avi: the box halfway covered 81 % of a face 190 px to the side)
    from modalign.operators.deid.face_tracks import interpolate

    a, b = (340, 40, 600, 300), (160, 30, 420, 290)
    tracks = FaceTracks(W, H, hold_s=0.5)
    frames = [tracks.update(0, [(*a, 0.9)]), tracks.update(FRAME_NS, []), tracks.update(2 * FRAME_NS, [(*b, 0.9)])]
    boxes = interpolate(frames, [0, FRAME_NS, 2 * FRAME_NS], W, H, back=2, hold_s=0.5)
    assert len(boxes[1]) == 1 and covers(boxes[1][0], a[:4]) and covers(boxes[1][0], b[:4])
    # the same two boxes a second apart: a face moving, and the frame halfway has it halfway
    tracks = FaceTracks(W, H, hold_s=2)
    times = [i * FRAME_NS for i in range(26)]
    frames = [tracks.update(t, [(*a, 0.9)] if i == 0 else [(*b, 0.9)] if i == 25 else []) for i, t in enumerate(times)]
    mid = interpolate(frames, times, W, H, back=2, hold_s=2)[12][0]
    assert not covers(mid, a[:4]) and abs((mid[0] + mid[2]) / 2 - (a[0] + a[2] + b[0] + b[2]) / 4) < 10
