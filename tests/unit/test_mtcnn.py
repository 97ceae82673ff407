"""The NumPy MTCNN (``operators.deid.mtcnn``): facenet-pytorch's boxes and scores on real faces,
its weights read without torch, and the face operator's still model running without importing torch."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from modalign.operators.deid.mtcnn import Mtcnn, default_weights, read_state_dict

cv2 = pytest.importorskip("cv2")
skdata = pytest.importorskip("skimage.data")


def _lfw_canvas() -> np.ndarray:
    """Six real LFW faces of 80-130 px on a 640x360 grey frame, and a stretch of a real photo."""
    canvas = np.full((360, 640, 3), 90, np.uint8)
    for k, face in enumerate(skdata.lfw_subset()[:6]):
        side = 80 + 10 * k
        g = cv2.resize((face * 255).astype(np.uint8), (side, side))
        y, x = 20 + (k // 3) * 150, 20 + (k % 3) * 200
        canvas[y:y + side, x:x + side] = g[..., None]
    return canvas


IMAGES = {
    "lfw-canvas": _lfw_canvas,
    "astronaut": skdata.astronaut,
    "astronaut-720p": lambda: cv2.resize(skdata.astronaut(), (1280, 720)),
    "coffee (no face)": skdata.coffee,
}


@pytest.fixture(scope="module")
def reference():
    """facenet-pytorch's own MTCNN (torch), the still model's settings: the reference only."""
    torch = pytest.importorskip("torch")
    fp = pytest.importorskip("facenet_pytorch")
    m = fp.MTCNN(keep_all=True, min_face_size=40, thresholds=[0.6, 0.7, 0.9], post_process=False, device="cpu")

    def detect(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with torch.inference_mode():
            boxes, probs = m.detect(np.ascontiguousarray(rgb))
        if boxes is None:
            return np.zeros((0, 4)), np.zeros(0)
        return np.asarray(boxes, float), np.asarray(probs, float)

    return detect


def test_the_weights_read_without_torch_are_torch_s():
    torch = pytest.importorskip("torch")
    for name in ("pnet", "rnet", "onet"):
        ours = read_state_dict(default_weights() / f"{name}.pt")
        theirs = torch.load(default_weights() / f"{name}.pt", weights_only=True)
        assert sorted(ours) == sorted(theirs)
        for k, v in theirs.items():
            assert ours[k].dtype == np.float32 and np.array_equal(ours[k], v.numpy()), (name, k)


@pytest.mark.parametrize("name", IMAGES)
def test_boxes_and_scores_are_facenet_pytorch_s(name, reference):
    rgb = IMAGES[name]()
    boxes, scores = Mtcnn(min_face=40, thresholds=(0.6, 0.7, 0.9)).detect(rgb)
    want_boxes, want_scores = reference(rgb)
    assert len(boxes) == len(want_boxes)
    if name == "lfw-canvas":
        assert len(boxes) >= 5  # real faces are found (the reference finds the same)
    if name.startswith("coffee"):
        assert len(boxes) == 0
    np.testing.assert_allclose(boxes, want_boxes, atol=1e-2)
    np.testing.assert_allclose(scores, want_scores, atol=1e-4)


def test_a_weights_file_naming_any_other_class_is_refused(tmp_path):
    """The weights are unpickled with only what a state dict holds: a file that names anything
    else (here ``os.system``) fails before it can run."""

    class Evil:
        def __reduce__(self):
            import os

            return os.system, ("touch " + str(tmp_path / "ran"),)

    bad = tmp_path / "pnet.pt"
    with open(bad, "wb") as f:
        for header in (0x1950A86A20F9469CFC6C, 1001, {}):
            pickle.dump(header, f)
        pickle.dump(Evil(), f)
    with pytest.raises(pickle.UnpicklingError, match="unexpected posix.system|unexpected os.system"):
        read_state_dict(bad)
    assert not (tmp_path / "ran").exists()


def test_the_face_operator_s_still_model_runs_without_importing_torch():
    """A stream's last frame gets the still model; the process never imports torch for it."""
    code = textwrap.dedent("""
        import sys
        import cv2
        import numpy as np
        import pyarrow as pa
        from skimage.data import astronaut
        from modalign.operators.deid.faces import FaceBlurConfig, FaceBlurOperator
        img = np.full((360, 640, 3), 90, np.uint8)
        img[10:350, 150:490] = cv2.resize(astronaut(), (340, 340), interpolation=cv2.INTER_AREA)
        table = pa.table({"event_id": [f"s/cam/video/{k}" for k in range(3)],
                          "t_ns": pa.array([k * 40_000_000 for k in range(3)], pa.int64()),
                          "frame": pa.FixedShapeTensorArray.from_numpy_ndarray(np.stack([img] * 3))})
        op = FaceBlurOperator(FaceBlurConfig(secret=b"k" * 32))
        op.setup()
        out = [op.process(table)] + op.flush()
        assert op._still is not None, "the still model did not run"
        assert sum(t.num_rows for t in out) == 3
        print("torch" in sys.modules)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "False"


def test_your_own_weights_folder_is_used_and_a_missing_file_is_named_at_setup(tmp_path, monkeypatch):
    """``$MODALIGN_MTCNN_WEIGHTS``: a folder of the three nets' files (here facenet-pytorch's, copied);
    the face operator's setup names a missing one before any frame is read."""
    import shutil

    from modalign.operators.deid import mtcnn
    from modalign.operators.deid.faces import FaceBlurConfig, FaceBlurOperator
    from modalign.schemas.errors import DependencyMissingError

    own = tmp_path / "my-mtcnn"
    shutil.copytree(default_weights(), own)
    monkeypatch.setenv(mtcnn.WEIGHTS_ENV, str(own))
    assert default_weights() == own
    boxes, _ = Mtcnn(min_face=40, thresholds=(0.6, 0.7, 0.9)).detect(skdata.astronaut())
    assert len(boxes) == 1
    (own / "rnet.pt").unlink()
    with pytest.raises(DependencyMissingError, match=r"MTCNN weights rnet\.pt in .*my-mtcnn .*MODALIGN_MTCNN_WEIGHTS"):
        FaceBlurOperator(FaceBlurConfig(secret=b"k" * 32)).setup()


def test_frames_too_small_for_the_pyramid_and_frames_over_8_megapixels(reference):
    """A frame under the smallest face gives no box (no pyramid level); one over 8.4 Mpx, whose
    pixel sums no longer fit int32, takes the float64 path and still gives facenet-pytorch's box."""
    m = Mtcnn(min_face=40, thresholds=(0.6, 0.7, 0.9))
    for side in (1, 8, 39):
        boxes, scores = m.detect(np.full((side, side + 3, 3), 128, np.uint8))
        assert boxes.shape == (0, 4) and scores.shape == (0,)
    big = cv2.resize(skdata.astronaut(), (3000, 3000))
    boxes, scores = m.detect(big)
    want_boxes, want_scores = reference(big)
    assert len(boxes) == len(want_boxes) >= 1
    np.testing.assert_allclose(boxes, want_boxes, atol=1e-2)
    np.testing.assert_allclose(scores, want_scores, atol=1e-4)
