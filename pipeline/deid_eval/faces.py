"""Faces: real face photos anonymised by the product's operator, checked by independent detectors and dlib."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from modalign.pipeline.deid_eval.common import need as _need, pct as _pct
from modalign.schemas.errors import DependencyMissingError
from modalign.schemas.policy import DeidPolicy

DLIB_LINK_DISTANCE = 0.6
ASTRONAUT_FACE = (175, 76, 265, 166)  # dlib HOG detection of the face in skimage.data.astronaut()
ASTRONAUT_PATCH = (95, 0, 345, 250)  # head and shoulders pasted into samples
BACKGROUNDS = ("coffee", "chelsea", "rocket", "camera", "brick", "grass", "gravel", "hubble_deep_field",
               "immunohistochemistry", "moon")


@dataclass
class FaceSample:
    image: np.ndarray  # HxWx3 uint8 RGB
    box: tuple[int, int, int, int]  # the face (dlib-style tight box), pixels


def make_face_samples(n: int = 80, seed: int = 0, size: tuple[int, int] = (640, 480)) -> list[FaceSample]:
    """The astronaut's head, flipped/scaled/colour-jittered, pasted onto skimage backgrounds."""
    skdata = _need("skimage.data", "scikit-image")
    import cv2

    rng = np.random.default_rng(seed)
    w_img, h_img = size
    ast = skdata.astronaut()[..., :3]
    px0, py0, px1, py1 = ASTRONAUT_PATCH
    patch0 = ast[py0:py1, px0:px1]
    fx0, fy0, fx1, fy1 = (ASTRONAUT_FACE[0] - px0, ASTRONAUT_FACE[1] - py0, ASTRONAUT_FACE[2] - px0,
                          ASTRONAUT_FACE[3] - py0)
    backs = []
    for name in BACKGROUNDS:
        b = getattr(skdata, name)()
        b = np.stack([b] * 3, -1) if b.ndim == 2 else b[..., :3]
        backs.append(cv2.resize(b, size, interpolation=cv2.INTER_AREA))
    out = []
    for i in range(n):
        face_w = float(rng.uniform(48, 150))
        s = face_w / (fx1 - fx0)
        ph, pw = int(round(patch0.shape[0] * s)), int(round(patch0.shape[1] * s))
        patch = cv2.resize(patch0, (pw, ph), interpolation=cv2.INTER_AREA if s < 1 else cv2.INTER_LINEAR)
        bx0, by0, bx1, by1 = fx0 * s, fy0 * s, fx1 * s, fy1 * s
        if rng.random() < 0.5:
            patch = np.ascontiguousarray(patch[:, ::-1])
            bx0, bx1 = pw - bx1, pw - bx0
        gain = rng.uniform(0.8, 1.2) * rng.uniform(0.9, 1.1, 3)
        patch = np.clip(patch.astype(np.float32) * gain + rng.uniform(-25, 25), 0, 255).astype(np.uint8)
        img = backs[i % len(backs)].copy()
        ox, oy = int(rng.integers(0, w_img - pw + 1)), int(rng.integers(0, h_img - ph + 1))
        img[oy:oy + ph, ox:ox + pw] = patch
        out.append(FaceSample(img, (int(round(ox + bx0)), int(round(oy + by0)), int(round(ox + bx1)),
                                    int(round(oy + by1)))))
    return out


class _FaceChecks:
    """The independent detectors (Haar, dlib HOG) and dlib's 128-d descriptor."""

    def __init__(self) -> None:
        import importlib.resources

        import cv2

        dlib = _need("dlib", "dlib-bin==20.0.1.post1")
        _need("face_recognition_models", "face-recognition-models==0.3.0")
        models = importlib.resources.files("face_recognition_models") / "models"
        cv2.setNumThreads(1)
        self.cv2, self.dlib = cv2, dlib
        self.haar = cv2.CascadeClassifier(cv2.data.haarcascades + "haarcascade_frontalface_default.xml")
        if self.haar.empty():
            raise DependencyMissingError("OpenCV Haar cascade files", pip="opencv-python-headless==4.14.0.94")
        self.hog = dlib.get_frontal_face_detector()
        self.shape = dlib.shape_predictor(str(models / "shape_predictor_5_face_landmarks.dat"))
        self.net = dlib.face_recognition_model_v1(str(models / "dlib_face_recognition_resnet_model_v1.dat"))

    def haar_boxes(self, img: np.ndarray) -> list[tuple[int, int, int, int]]:
        gray = self.cv2.cvtColor(img, self.cv2.COLOR_RGB2GRAY)
        found = self.haar.detectMultiScale(gray, scaleFactor=1.1, minNeighbors=5, minSize=(24, 24))
        return [(int(x), int(y), int(x + w), int(y + h)) for x, y, w, h in found]

    def hog_boxes(self, img: np.ndarray) -> list[tuple[int, int, int, int]]:
        return [(r.left(), r.top(), r.right(), r.bottom()) for r in self.hog(img, 1)]

    def finds(self, detector, img: np.ndarray, box: tuple[int, int, int, int]) -> bool:
        """Does ``detector`` find the face at ``box``? Run on the face with one face-width of
        context on every side: detections that count as hitting it (IoU >= 0.3 or centre
        inside, up to 3x the face's size) fit in that crop, at a fraction of the cost."""
        h, w = img.shape[:2]
        m = max(box[2] - box[0], box[3] - box[1])
        x0, y0, x1, y1 = max(0, box[0] - m), max(0, box[1] - m), min(w, box[2] + m), min(h, box[3] + m)
        crop = np.ascontiguousarray(img[y0:y1, x0:x1])
        local = (box[0] - x0, box[1] - y0, box[2] - x0, box[3] - y0)
        return _hits(detector(crop), local)

    def descriptor(self, img: np.ndarray, box: tuple[int, int, int, int]) -> np.ndarray:
        rect = self.dlib.rectangle(*map(int, box))
        shape = self.shape(img, rect)
        return np.asarray(self.net.compute_face_descriptor(img, shape))


def _iou(a: tuple, b: tuple) -> float:
    ix = max(0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union else 0.0


def _hits(boxes: list[tuple], gt: tuple) -> bool:
    """A detection of ``gt``: IoU >= 0.3 or the detection's centre inside the face box."""
    for b in boxes:
        cx, cy = (b[0] + b[2]) / 2, (b[1] + b[3]) / 2
        if _iou(b, gt) >= 0.3 or (gt[0] <= cx <= gt[2] and gt[1] <= cy <= gt[3]):
            return True
    return False


def eval_faces(n: int = 80, seed: int = 0, policy: DeidPolicy | None = None) -> dict:
    """Independent detection and descriptor linking of faces before and after FaceBlurOperator."""
    import pyarrow as pa

    from modalign.operators.deid.faces import FaceBlurConfig, FaceBlurOperator

    skdata = _need("skimage.data", "scikit-image")
    policy = policy or DeidPolicy()
    checks = _FaceChecks()
    samples = make_face_samples(n, seed)
    op = FaceBlurOperator(FaceBlurConfig(face=policy.face, policy_tag=policy.tag, secret=b"deid-eval" * 4))
    op.setup()
    ref = checks.descriptor(skdata.astronaut()[..., :3].copy(), ASTRONAUT_FACE)
    rows = []
    t_anon = 0.0
    for i, s in enumerate(samples):
        op.reset()  # each sample is its own stream: no temporal spreading between samples
        table = pa.table({"event_id": [f"eval/face/{i}"], "t_ns": pa.array([0], pa.int64()),
                          "frame": pa.FixedShapeTensorArray.from_numpy_ndarray(np.stack([s.image]))})
        t0 = time.perf_counter()
        out = _all_rows(op, [table])
        t_anon += time.perf_counter() - t0
        anon = out.column("frame").chunk(0).to_numpy_ndarray()[0]
        covered = _hits([(b["x0"], b["y0"], b["x1"], b["y1"]) for b in out.column("face_boxes")[0].as_py()], s.box)
        d_orig = checks.descriptor(s.image, s.box)
        d_anon = checks.descriptor(np.ascontiguousarray(anon), s.box)
        x0, y0, x1, y1 = s.box
        region_diff = float(np.abs(anon[y0:y1, x0:x1].astype(np.int16) - s.image[y0:y1, x0:x1].astype(np.int16)).mean())
        rows.append({
            "covered": covered,
            "haar_before": checks.finds(checks.haar_boxes, s.image, s.box),
            "haar_after": checks.finds(checks.haar_boxes, anon, s.box),
            "hog_before": checks.finds(checks.hog_boxes, s.image, s.box),
            "hog_after": checks.finds(checks.hog_boxes, anon, s.box),
            "dist_ref_before": float(np.linalg.norm(d_orig - ref)),
            "dist_after": float(np.linalg.norm(d_anon - d_orig)),
            "dist_ref_after": float(np.linalg.norm(d_anon - ref)),
            "face_w": x1 - x0, "mean_abs_diff": region_diff,
        })
    rate = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    linked_before = sum(r["dist_ref_before"] < DLIB_LINK_DISTANCE for r in rows) / len(rows)
    linked_after = sum(r["dist_after"] < DLIB_LINK_DISTANCE for r in rows) / len(rows)
    return {
        "samples": len(rows), "face_width_px": [min(r["face_w"] for r in rows), max(r["face_w"] for r in rows)],
        "policy": policy.tag, "detector": op.detector_name,
        "anonymiser_detected": rate("covered"),
        "haar_before": rate("haar_before"), "haar_after": rate("haar_after"),
        "hog_before": rate("hog_before"), "hog_after": rate("hog_after"),
        "linked_before": linked_before, "linked_after": linked_after,
        "linked_after_to_reference": sum(r["dist_ref_after"] < DLIB_LINK_DISTANCE for r in rows) / len(rows),
        "dist_before_median": float(np.median([r["dist_ref_before"] for r in rows])),
        "dist_after_median": float(np.median([r["dist_after"] for r in rows])),
        "dist_after_min": float(min(r["dist_after"] for r in rows)),
        "mean_abs_diff_median": float(np.median([r["mean_abs_diff"] for r in rows])),
        "anonymise_ms_per_frame": 1e3 * t_anon / len(rows),
    }


def render_faces(f: dict) -> list[str]:
    """Markdown lines of ``eval_faces``'s dict."""
    lines: list[str] = []
    lines += [
        "## Faces",
        f"{f['samples']} astronaut faces ({f['face_width_px'][0]}-{f['face_width_px'][1]} px wide) on skimage "
        f"backgrounds; anonymiser detector {f['detector']}; {f['anonymise_ms_per_frame']:.1f} ms per 640x480 frame.",
        "",
        "| check | before | after | floor (after) |", "| --- | --- | --- | --- |",
        f"| anonymiser covers the face | | {_pct(f['anonymiser_detected'])} | |",
        f"| OpenCV Haar cascade finds the face | {_pct(f['haar_before'])} | {_pct(f['haar_after'])} | <= 1 % |",
        f"| dlib HOG detector finds the face | {_pct(f['hog_before'])} | {_pct(f['hog_after'])} | |",
        f"| dlib descriptor links (distance < {DLIB_LINK_DISTANCE}) | {_pct(f['linked_before'])} (to the "
        f"reference photo) | {_pct(f['linked_after'])} (to its original) | <= 1 % |",
        f"| median descriptor distance | {f['dist_before_median']:.3f} | {f['dist_after_median']:.3f} "
        f"(min {f['dist_after_min']:.3f}) | |",
        f"| median mean-abs pixel change in the face box | | {f['mean_abs_diff_median']:.1f} | |",
        "",
    ]
    return lines


# -- real footage: clips with motion, scale change, occlusion; opencv-doc videos; LFW -----------------
OPENCV_DATA = "/usr/share/doc/opencv-doc/examples/data"  # Debian opencv-doc: vtest.avi, Megamind.avi
COVERED_FRACTION = 0.9  # a face counts as covered when this much of its region lies in the boxes


@dataclass
class FaceClip:
    """Frames of one stream with the face regions in each (``truth``: how they were obtained)."""

    name: str
    frames: list[np.ndarray]  # HxWx3 uint8 RGB
    faces: list[list[tuple[int, int, int, int]]]  # per frame, pixels
    fps: float
    truth: str  # "composed" (known) or "detected" (union of HOG and Haar on the originals)
    streams: bool = True  # False: every frame is its own still (a photo set)


def opencv_video(name: str, max_frames: int | None = None) -> list[np.ndarray] | None:
    """RGB frames of a video of Debian's opencv-doc examples, None when it is not installed."""
    import os

    import cv2

    path = os.path.join(OPENCV_DATA, name)
    if not os.path.exists(path):
        return None
    cap = cv2.VideoCapture(path)
    frames = []
    while max_frames is None or len(frames) < max_frames:
        ok, bgr = cap.read()
        if not ok:
            break
        frames.append(np.ascontiguousarray(bgr[..., ::-1]))
    cap.release()
    return frames or None


def _backgrounds(n: int, size: tuple[int, int]) -> list[np.ndarray]:
    """n real video frames (opencv-doc vtest.avi pedestrians) at ``size``; a slow pan over a
    skimage photo where that video is not installed."""
    import cv2

    w, h = size
    video = opencv_video("vtest.avi", n)
    if video:
        return [cv2.resize(video[i % len(video)], size, interpolation=cv2.INTER_LINEAR) for i in range(n)]
    skdata = _need("skimage.data", "scikit-image")
    big = cv2.resize(skdata.coffee(), (w + 2 * n + 8, h), interpolation=cv2.INTER_LINEAR)
    return [np.ascontiguousarray(big[:, 2 * i:2 * i + w]) for i in range(n)]


def _lfw_faces() -> tuple[np.ndarray, np.ndarray]:
    """skimage's LFW subset (ships with scikit-image): 100 faces and 100 non-faces, 25x25 grey."""
    skdata = _need("skimage.data", "scikit-image")
    lfw = (skdata.lfw_subset() * 255).round().astype(np.uint8)
    return lfw[:100], lfw[100:]


def _paste(img: np.ndarray, patch: np.ndarray, x: int, y: int) -> None:
    h, w = img.shape[:2]
    ph, pw = patch.shape[:2]
    x0, y0, x1, y1 = max(0, x), max(0, y), min(w, x + pw), min(h, y + ph)
    if x1 > x0 and y1 > y0:
        img[y0:y1, x0:x1] = patch[y0 - y:y1 - y, x0 - x:x1 - x]


def compose_clip(n: int = 75, size: tuple[int, int] = (1280, 720), fps: float = 25.0) -> FaceClip:
    """Real faces moving over real video frames: the astronaut crossing the frame while growing
    from ~70 to ~200 px, an LFW face (upscaled) crossing the other way, a hand-sized skin-toned
    occluder over the astronaut's face for a fifth of the clip, and a fast pan (motion blur) near
    the end. Ground truth is the known face box of each pasted face, clipped to the frame."""
    import cv2

    skdata = _need("skimage.data", "scikit-image")
    w, h = size
    backs = _backgrounds(n, size)
    ast = skdata.astronaut()[..., :3]
    px0, py0, px1, py1 = ASTRONAUT_PATCH
    patch0 = ast[py0:py1, px0:px1]
    fx0, fy0, fx1, fy1 = (ASTRONAUT_FACE[0] - px0, ASTRONAUT_FACE[1] - py0, ASTRONAUT_FACE[2] - px0,
                          ASTRONAUT_FACE[3] - py0)
    lfw = _lfw_faces()[0][7]
    frames, faces = [], []
    for i in range(n):
        f = i / max(1, n - 1)
        img = backs[i].copy()
        boxes = []
        # the astronaut: left to right, growing, bobbing
        face_w = 70 + 130 * f
        s = face_w / (fx1 - fx0)
        patch = cv2.resize(patch0, (int(round(patch0.shape[1] * s)), int(round(patch0.shape[0] * s))),
                           interpolation=cv2.INTER_AREA if s < 1 else cv2.INTER_LINEAR)
        ox, oy = int(40 + (w - 360) * f), int(h * 0.25 + 40 * np.sin(6.0 * f))
        _paste(img, patch, ox, oy)
        a = (ox + int(fx0 * s), oy + int(fy0 * s), ox + int(round(fx1 * s)), oy + int(round(fy1 * s)))
        if 0.35 <= f <= 0.55:  # a hand-sized occluder over the lower half of the face
            hx0, hy0 = a[0] - int(0.2 * face_w), (a[1] + a[3]) // 2
            cv2.ellipse(img, (hx0 + int(0.6 * face_w), hy0 + int(0.3 * face_w)), (int(0.6 * face_w), int(0.35 * face_w)),
                        15, 0, 360, (205, 160, 135), -1)
        boxes.append(a)
        # an LFW face: right to left, 110 -> 150 px
        side = int(110 + 40 * f)
        lp = cv2.resize(lfw, (side, side), interpolation=cv2.INTER_CUBIC)
        lx, ly = int(w - side - 40 - (w - side - 80) * f), int(h * 0.55)
        _paste(img, np.repeat(lp[..., None], 3, -1), lx, ly)
        boxes.append((lx, ly, lx + side, ly + side))
        if 0.8 <= f <= 0.87:  # fast pan: horizontal motion blur
            img = cv2.filter2D(img, -1, np.ones((1, 25), np.float32) / 25)
        frames.append(img)
        faces.append([b for b in (_clip_box(b, w, h) for b in boxes) if b is not None])
    return FaceClip("composed: astronaut + LFW face moving over vtest.avi", frames, faces, fps, "composed")


def lfw_stills(size: tuple[int, int] = (1280, 720), seed: int = 0) -> tuple[FaceClip, FaceClip]:
    """skimage's LFW subset as stills: each 25x25 face (and, separately, each non-face) upscaled to
    100-160 px and pasted on a video frame. Faces: ground truth the pasted square; non-faces:
    no face at all (every box is a false box)."""
    import cv2

    rng = np.random.default_rng(seed)
    faces, others = _lfw_faces()
    backs = _backgrounds(len(faces), size)
    clips = []
    for name, imgs, truth in (("LFW faces", faces, True), ("LFW non-faces", others, False)):
        frames, boxes = [], []
        for i, g in enumerate(imgs):
            side = int(rng.integers(100, 161))
            p = cv2.resize(g, (side, side), interpolation=cv2.INTER_CUBIC)
            x, y = int(rng.integers(0, size[0] - side)), int(rng.integers(0, size[1] - side))
            img = backs[i].copy()
            _paste(img, np.repeat(p[..., None], 3, -1), x, y)
            frames.append(img)
            boxes.append([(x, y, x + side, y + side)] if truth else [])
        clips.append(FaceClip(f"{name} (skimage lfw_subset, x4-6)", frames, boxes, 1.0, "composed", streams=False))
    return clips[0], clips[1]


def _clip_box(b: tuple[int, int, int, int], w: int, h: int) -> tuple[int, int, int, int] | None:
    x0, y0, x1, y1 = max(0, b[0]), max(0, b[1]), min(w, b[2]), min(h, b[3])
    return (x0, y0, x1, y1) if x1 - x0 >= 8 and y1 - y0 >= 8 else None


def detected_truth(name: str, frames: list[np.ndarray], fps: float, checks: "_FaceChecks", stride: int = 1) -> FaceClip:
    """A video without labels: the face regions of each checked frame (every ``stride``-th) are
    the union of the independent detectors' (dlib HOG, OpenCV Haar) detections on the original
    frame: what they find before anonymisation and must not find after. The anonymiser's own
    raw detections are not truth: on Megamind.avi those it rejects on a closer look are
    hands, ears, hair and the backs of heads."""
    from modalign.operators.deid.face_tracks import overlap

    faces: list[list[tuple[int, int, int, int]]] = []
    for i, img in enumerate(frames):
        if i % stride:
            faces.append([])
            continue
        found = checks.hog_boxes(img) + checks.haar_boxes(img)
        regions: list[tuple[int, int, int, int]] = []
        for b in found:  # union of overlapping detections: one region per face
            b = _clip_box(b, img.shape[1], img.shape[0])
            if b is None:
                continue
            for k, r in enumerate(regions):
                if overlap(r, b) > 0.3:
                    regions[k] = (min(r[0], b[0]), min(r[1], b[1]), max(r[2], b[2]), max(r[3], b[3]))
                    break
            else:
                regions.append(b)
        faces.append(regions)
    return FaceClip(name, frames, faces, fps, "detected")


def _all_rows(op, tables: list):
    """Every row ``op`` gives for ``tables`` as one stream: each ``process``, then ``flush``
    (the face operator holds rows back for look-ahead), in order."""
    import pyarrow as pa

    outs = [op.process(t) for t in tables] + op.flush()
    return pa.concat_tables([o for o in outs if o.num_rows] or outs[:1])


def eval_clip(clip: FaceClip, checks: "_FaceChecks", op, stride: int = 1, chunk: int = 16) -> dict:
    """Anonymise ``clip`` with ``op`` (tables of ``chunk`` frames of one stream, or one still
    each) and check every ``stride``-th frame: is each face region covered, does Haar or dlib
    HOG find a face in it, does dlib's descriptor link it to the original (< 0.6); boxes that
    touch no face region are false boxes."""
    import pyarrow as pa

    from modalign.operators.deid.face_tracks import overlap

    n = len(clip.frames)
    frame_ns = int(round(1e9 / clip.fps))
    outs: list[np.ndarray] = []
    boxes: list[list[tuple[int, int, int, int]]] = []
    op.reset()
    t_anon = 0.0
    step = chunk if clip.streams else 1
    tables = []
    for s in range(0, n, step):
        part = clip.frames[s:s + step]
        tables.append(pa.table({"event_id": [f"eval/{clip.name}/video/{s + i}" for i in range(len(part))],
                                "t_ns": pa.array([(s + i) * frame_ns for i in range(len(part))], pa.int64()),
                                "frame": pa.FixedShapeTensorArray.from_numpy_ndarray(np.stack(part))}))
    t0 = time.perf_counter()
    # one stream of tables; stills: each its own stream (no tracking from one to the next)
    anonymised = [_all_rows(op, tables)] if clip.streams else [_all_rows(op, [t]) for t in tables]
    t_anon += time.perf_counter() - t0
    for out in anonymised:
        outs += list(out.column("frame").combine_chunks().to_numpy_ndarray())
        boxes += [[(b["x0"], b["y0"], b["x1"], b["y1"]) for b in bs] for bs in out.column("face_boxes").to_pylist()]
    checked = [i for i in range(n) if i % stride == 0]
    r = {"dataset": clip.name, "truth": clip.truth, "frames": n, "checked_frames": len(checked),
         "face_frames": 0, "faces": 0, "uncovered_frames": 0, "haar_before": 0, "hog_before": 0,
         "haar_after": 0, "hog_after": 0, "redetected_frames": 0, "linked_before_frames": 0, "linked_frames": 0,
         "linked_floor_frames": 0, "boxes": 0, "false_boxes": 0, "dist_after_min": float("nan")}
    dists = []
    for i in checked:
        gt, anon, orig = clip.faces[i], np.ascontiguousarray(outs[i]), clip.frames[i]
        r["boxes"] += len(boxes[i])
        r["false_boxes"] += sum(not any(overlap(b, g) >= 0.1 for g in gt) for b in boxes[i])
        if not gt:
            continue
        r["face_frames"] += 1
        r["faces"] += len(gt)
        mask = np.zeros(orig.shape[:2], bool)
        for b in boxes[i]:
            mask[b[1]:b[3], b[0]:b[2]] = True
        flags = {k: False for k in ("uncovered", "haar_before", "hog_before", "haar_after", "hog_after", "lf", "la")}
        for g in gt:
            flags["uncovered"] |= mask[g[1]:g[3], g[0]:g[2]].mean() < COVERED_FRACTION
            flags["haar_before"] |= checks.finds(checks.haar_boxes, orig, g)
            flags["hog_before"] |= checks.finds(checks.hog_boxes, orig, g)
            flags["haar_after"] |= checks.finds(checks.haar_boxes, anon, g)
            flags["hog_after"] |= checks.finds(checks.hog_boxes, anon, g)
            d = float(np.linalg.norm(checks.descriptor(anon, g) - checks.descriptor(orig, g)))
            dists.append(d)
            flags["la"] |= d < DLIB_LINK_DISTANCE
            filled = orig.copy()  # the floor: the region filled with its mean colour, nothing of the face left
            filled[g[1]:g[3], g[0]:g[2]] = orig[g[1]:g[3], g[0]:g[2]].reshape(-1, 3).mean(axis=0).astype(np.uint8)
            flags["lf"] |= float(np.linalg.norm(checks.descriptor(filled, g) - checks.descriptor(orig, g))) < DLIB_LINK_DISTANCE
        for k in ("uncovered", "haar_before", "hog_before", "haar_after", "hog_after"):
            r[f"{k}_frames" if k == "uncovered" else k] += flags[k]
        r["redetected_frames"] += flags["haar_after"] or flags["hog_after"]
        r["linked_frames"] += flags["la"]
        r["linked_floor_frames"] += flags["lf"]
    r["dist_after_min"] = float(min(dists)) if dists else float("nan")
    r["boxes_per_frame"] = r["boxes"] / max(1, len(checked))
    r["faces_per_frame"] = r["faces"] / max(1, len(checked))
    r["anonymise_ms_per_frame"] = 1e3 * t_anon / max(1, n)
    return r


def eval_face_clips(quick: bool = False, policy: DeidPolicy | None = None, videos: bool = True) -> dict:
    """The real-footage figures: the composed clip, and (not ``quick``) the LFW stills and the
    opencv-doc videos (where installed) with detected ground truth."""
    from modalign.operators.deid.faces import FaceBlurConfig, FaceBlurOperator

    policy = policy or DeidPolicy()
    checks = _FaceChecks()
    op = FaceBlurOperator(FaceBlurConfig(face=policy.face, policy_tag=policy.tag, secret=b"deid-eval" * 4))
    op.setup()
    rows = [eval_clip(compose_clip(n=24 if quick else 75), checks, op, stride=4 if quick else 1)]
    if not quick:
        rows += [eval_clip(c, checks, op) for c in lfw_stills()]
        if videos:
            for name, stride, limit in (("Megamind.avi", 3, None), ("vtest.avi", 5, None)):
                frames = opencv_video(name, limit)
                if frames:
                    fps = 10.0 if name == "vtest.avi" else 23.976
                    clip = detected_truth(f"{name} (opencv-doc)", frames, fps, checks, stride)
                    rows.append(eval_clip(clip, checks, op, stride=stride))
    return {"policy": policy.tag, "detector": op.detector_name, "clips": rows}


def render_face_clips(f: dict) -> list[str]:
    """Markdown lines of ``eval_face_clips``'s dict."""
    lines = [
        "## Faces on real footage",
        f"Anonymiser detector {f['detector']}. Face regions: known for composed clips; for the videos, the union "
        "of the independent detectors (dlib HOG, OpenCV Haar) on the original frames. Re-detected: Haar or "
        f"HOG finds a face in a face region after anonymisation; linked: dlib descriptor distance < "
        f"{DLIB_LINK_DISTANCE} to the original (floor: frames where the region filled with its mean colour is "
        "still linked, i.e. the descriptor cannot tell); false boxes touch no face region.",
        "",
        "| dataset | checked frames (with faces) | uncovered | Haar/HOG before | re-detected after | linked after "
        "(floor) | boxes / faces per frame | false boxes | ms / frame |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in f["clips"]:
        lines.append(
            f"| {r['dataset']} | {r['checked_frames']} ({r['face_frames']}) | {r['uncovered_frames']} | "
            f"{r['haar_before']}/{r['hog_before']} | {r['redetected_frames']} | {r['linked_frames']} "
            f"({r['linked_floor_frames']}) | "
            f"{r['boxes_per_frame']:.2f} / {r['faces_per_frame']:.2f} | {r['false_boxes']} | "
            f"{r['anonymise_ms_per_frame']:.1f} |")
    return lines + [""]
