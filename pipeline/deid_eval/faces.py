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
        out = op.process(table)
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
