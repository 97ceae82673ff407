"""Image, text and audio embedding operators: vectors, pooling, rows (operators/embed)."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
from skimage import data
from skimage.transform import resize

from operators.cache.keys import BOX_TYPE, feature_schema
from operators.embed.audio import AudioEmbedConfig, AudioEmbedOperator
from operators.embed.device import pick_device
from operators.embed.image import (
    FrameEmbedConfig,
    FrameEmbedOperator,
    ImageEmbedConfig,
    ImageEncoder,
    _box_cell_weights,
    packaged_lite0_weights,
)
from operators.embed.text import TextEmbedConfig, TextEmbedOperator, TextBlockEmbedConfig, TextEncoder
from pipeline.errors import ConfigError, InputError

pytestmark = pytest.mark.unit

# mediapipe's face box (x0, y0, x1, y1) on skimage's 512 x 512 astronaut photo
FACE_BOX = (174, 68, 278, 172)
# other regions of the same photo: flag, helmet, shuttle model, mission patch
OTHER_BOXES = {"flag": (0, 0, 90, 250), "helmet": (280, 340, 500, 512), "shuttle": (350, 0, 470, 280),
               "patch": (130, 340, 215, 430)}


@pytest.fixture(scope="module")
def image_encoder() -> ImageEncoder:
    enc = ImageEncoder(ImageEmbedConfig(device="cpu"))
    enc.setup()
    return enc


@pytest.fixture(scope="module")
def text_encoder() -> TextEncoder:
    enc = TextEncoder(TextEmbedConfig(device="cpu"))
    enc.setup()
    return enc


@pytest.fixture(scope="module")
def astronaut() -> np.ndarray:
    return data.astronaut()


@pytest.fixture(scope="module")
def coffee() -> np.ndarray:
    img = resize(data.coffee()[:400, 100:500], (512, 512), preserve_range=True, anti_aliasing=True)
    return img.round().astype(np.uint8)


def frames_table(frames: np.ndarray, boxes: list[list[tuple]], t0_ns: int = 0) -> pa.Table:
    n = len(frames)
    box_rows = [[{"x0": b[0], "y0": b[1], "x1": b[2], "y1": b[3], "score": 0.9} for b in bs] for bs in boxes]
    return pa.table({
        "event_id": pa.array([f"v-{i}" for i in range(n)]),
        "t_ns": pa.array([t0_ns + i * 40_000_000 for i in range(n)], pa.int64()),
        "frame": pa.FixedShapeTensorArray.from_numpy_ndarray(np.array(frames, copy=True)),
        "face_boxes": pa.array(box_rows, pa.list_(BOX_TYPE)),
    })


def cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


# -- device and imports ------------------------------------------------------------------------


def test_importing_embed_and_cache_modules_loads_no_heavy_package():
    code = (
        "import sys\n"
        "import operators.embed.image, operators.embed.text, operators.embed.audio, operators.embed.device\n"
        "import operators.cache.keys, operators.cache.store, operators.cache.index\n"
        "heavy = [m for m in ('torch', 'faiss', 'sentence_transformers', 'transformers', 'efficientnet_lite_pytorch',"
        " 'ray', 'cv2') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_pick_device_honours_preference():
    import torch

    assert pick_device("cpu") == "cpu"
    assert pick_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert pick_device("cuda") in ("cuda", "cpu")  # falls back to the CPU without a GPU
    with pytest.raises(ConfigError):
        pick_device("tpu")


# -- image encoder -----------------------------------------------------------------------------


def test_model_id_names_model_and_packaged_weights_hash(image_encoder):
    digest = hashlib.sha256(packaged_lite0_weights().read_bytes()).hexdigest()
    assert image_encoder.model_id == f"efficientnet-lite0@{digest[:12]}"
    assert image_encoder.device == "cpu"


def test_same_image_gives_identical_vectors_different_images_differ(image_encoder, astronaut, coffee):
    out = image_encoder.embed_frames(np.stack([astronaut, coffee, astronaut]))
    again = image_encoder.embed_frames(np.stack([astronaut, coffee, astronaut]))
    frame = out["frame"]
    assert np.array_equal(frame[0], frame[2])
    assert np.array_equal(frame, again["frame"])
    assert cos(frame[0], frame[1]) < 0.9
    assert np.allclose(np.linalg.norm(frame, axis=1), 1.0, atol=1e-5)


def test_frame_vector_is_mean_of_patch_grid_and_whole_frame_roi(image_encoder, astronaut):
    out = image_encoder.embed_frames(astronaut[None], [[(0, 0, 512, 512), FACE_BOX]])
    grid = out["patches"][0]
    assert grid.shape == (7, 7, 1280) and grid.dtype == np.float32
    assert grid.min() >= 0.0 and grid.max() <= 6.0  # ReLU6 activations, not normalised
    mean = grid.reshape(-1, 1280).mean(axis=0)
    assert np.allclose(out["frame"][0], mean / np.linalg.norm(mean), atol=1e-6)
    whole, face = out["roi"][0]
    assert np.allclose(whole, out["frame"][0], atol=1e-6)
    assert cos(face, out["frame"][0]) < 0.95  # the face box pools a different part of the grid


def test_box_cell_weights_are_covered_areas():
    # a 224 x 224 frame on a 7 x 7 grid: 32 px per cell
    w = _box_cell_weights((64, 32, 96, 64), (224, 224), (7, 7))
    assert w[1, 2] == pytest.approx(1.0) and w.sum() == pytest.approx(1.0)
    w = _box_cell_weights((48, 0, 80, 32), (224, 224), (7, 7))  # half of cell (0,1), half of (0,2)
    assert w[0, 1] == pytest.approx(0.5) and w[0, 2] == pytest.approx(0.5) and w.sum() == pytest.approx(1.0)
    w = _box_cell_weights((200, 200, 400, 400), (224, 224), (7, 7))  # clipped to the frame
    assert w[6, 6] == pytest.approx(0.75 * 0.75) and w.sum() == pytest.approx(0.75 * 0.75)
    w = _box_cell_weights((100, 100, 100, 100), (224, 224), (7, 7))  # empty: the centre cell
    assert w[3, 3] == 1.0 and w.sum() == 1.0


def test_roi_pooled_from_grid_agrees_with_direct_crop(image_encoder, astronaut):
    regions = {"face": FACE_BOX, **OTHER_BOXES}
    grid = image_encoder.embed_frames(astronaut[None])["patches"][0]
    pooled = {k: image_encoder.pool_roi(grid, b, astronaut.shape[:2]) for k, b in regions.items()}
    crops = {k: image_encoder.embed_crop(astronaut, b) for k, b in regions.items()}
    face_cos = cos(pooled["face"], crops["face"])
    print(f"face roi pooled vs direct crop cosine: {face_cos:.3f}")
    print({k: round(cos(pooled[k], crops[k]), 3) for k in regions})
    # A crop's own forward pass finds its pooled roi first among the photo's regions.
    for k, crop in crops.items():
        best = max(regions, key=lambda r: cos(pooled[r], crop))
        assert best == k, (k, best)
    # Measured 0.28 at 224 px (7 x 7 grid; the face spans ~1.5 cells): well above unrelated regions.
    assert face_cos > 0.2
    assert face_cos > np.mean([cos(pooled[r], crops["face"]) for r in OTHER_BOXES]) + 0.05


def test_out_of_memory_batches_are_split_in_halves(image_encoder, astronaut, coffee, monkeypatch):
    import torch

    frames = np.stack([astronaut, coffee, astronaut[::-1].copy()])
    expected = np.stack([image_encoder.patch_grids(f[None])[0] for f in frames])
    real = image_encoder._forward
    sizes: list[int] = []

    def forward_fitting_one_frame(batch):
        sizes.append(len(batch))
        if len(batch) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(batch)

    monkeypatch.setattr(image_encoder, "_forward", forward_fitting_one_frame)
    grids = image_encoder.patch_grids(frames)
    assert sizes == [3, 1, 2, 1, 1]
    assert np.array_equal(grids, expected)


# -- frame operator ----------------------------------------------------------------------------


def test_frame_embed_operator_rows(image_encoder, astronaut, coffee):
    table = frames_table(np.stack([astronaut, coffee]), [[FACE_BOX], []], t0_ns=5_000_000_000)
    before = table.column("frame").chunk(0).to_numpy_ndarray().copy()
    op = FrameEmbedOperator(FrameEmbedConfig(encoder=image_encoder.config), encoder=image_encoder)
    out = op.process(table)
    assert out.schema.equals(feature_schema()) and op.output_schema(table.schema).equals(out.schema)
    rows = out.to_pylist()
    assert [(r["granularity"], r["event_id"], r["t_ns"]) for r in rows] == [
        ("frame", "v-0", 5_000_000_000), ("roi", "v-0", 5_000_000_000), ("frame", "v-1", 5_040_000_000)]
    assert rows[0]["box"] is None and rows[2]["box"] is None
    assert (rows[1]["box"]["x0"], rows[1]["box"]["y0"], rows[1]["box"]["x1"], rows[1]["box"]["y1"]) == FACE_BOX
    assert all(r["dim"] == 1280 and len(r["vector"]) == 1280 and r["modality"] == "video" for r in rows)
    assert all(r["model_id"] == image_encoder.model_id for r in rows)
    assert len({r["feature_id"] for r in rows}) == 3 and all(0 < r["feature_id"] < 2**63 for r in rows)
    ref = image_encoder.embed_frames(np.stack([astronaut, coffee]), [[FACE_BOX], []])
    vecs = out.column("vector").to_numpy(zero_copy_only=False)
    assert np.allclose(np.stack(vecs[[0, 2]]), ref["frame"], atol=1e-6)
    assert np.allclose(vecs[1], ref["roi"][0][0], atol=1e-6)
    assert np.array_equal(table.column("frame").chunk(0).to_numpy_ndarray(), before)  # input untouched
    assert op.process(table).equals(out)  # deterministic


def test_frame_embed_operator_emits_patches_on_request(image_encoder, astronaut):
    table = frames_table(astronaut[None], [[FACE_BOX]])
    op = FrameEmbedOperator(FrameEmbedConfig(encoder=image_encoder.config, emit_patches=True), encoder=image_encoder)
    rows = op.process(table).to_pylist()
    patches = [r for r in rows if r["granularity"] == "patch"]
    assert len(rows) == 1 + 1 + 49 and len(patches) == 49
    assert patches[8]["box"] == {"x0": 73, "y0": 73, "x1": 146, "y1": 146, "score": 1.0}  # row 1, col 1
    grid = image_encoder.embed_frames(astronaut[None])["patches"][0]
    assert cos(patches[8]["vector"], grid[1, 1]) == pytest.approx(1.0, abs=1e-5)


def test_frame_embed_operator_rejects_a_table_without_frames(image_encoder):
    op = FrameEmbedOperator(FrameEmbedConfig(encoder=image_encoder.config), encoder=image_encoder)
    with pytest.raises(InputError, match="frame"):
        op.process(pa.table({"event_id": ["a"], "t_ns": pa.array([0], pa.int64())}))


# -- text --------------------------------------------------------------------------------------

SENTENCES = [
    "The quarterly revenue grew by twelve percent in Europe.",
    "Our engineers replaced the cooling pump in the data centre.",
    "The cat slept on the warm windowsill all afternoon.",
    "Please submit the travel expense form before Friday.",
    "A heavy storm closed the mountain pass overnight.",
]


def test_text_query_of_a_sentences_words_ranks_it_first(text_encoder):
    emb = text_encoder.embed_texts(SENTENCES)
    assert emb.shape == (5, 384) and emb.dtype == np.float32
    assert np.allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    for i, query in enumerate(["cooling pump engineers data centre", "expense form Friday travel"]):
        target = 1 if i == 0 else 3
        q = text_encoder.embed_texts([query])[0]
        scores = emb @ q
        assert int(np.argmax(scores)) == target, scores
    assert text_encoder.model_id.startswith("all-minilm-l6-v2@") and len(text_encoder.model_id.split("@")[1]) == 12


def test_text_embed_operator_one_roi_row_per_block(text_encoder):
    boxes = [{"x0": 10, "y0": 20, "x1": 300, "y1": 60, "score": 0.97}, {"x0": 10, "y0": 80, "x1": 250, "y1": 120,
                                                                         "score": 0.91}]
    table = pa.table({
        "event_id": ["p0-b0", "p0-b1"],
        "t_ns": pa.array([1_000, 1_000], pa.int64()),
        "text": SENTENCES[:2],
        "box": pa.array(boxes, BOX_TYPE),
    })
    op = TextEmbedOperator(TextBlockEmbedConfig(encoder=text_encoder.config), encoder=text_encoder)
    out = op.process(table)
    assert out.schema.equals(feature_schema())
    rows = out.to_pylist()
    assert [r["granularity"] for r in rows] == ["roi", "roi"] and [r["modality"] for r in rows] == ["pdf", "pdf"]
    assert rows[0]["box"]["x1"] == 300 and rows[1]["box"]["y0"] == 80
    assert all(r["dim"] == 384 for r in rows)
    ref = text_encoder.embed_texts(SENTENCES[:2])
    assert np.allclose(np.array([r["vector"] for r in rows]), ref, atol=1e-5)


# -- audio -------------------------------------------------------------------------------------


def mfcc_table(n_frames: int, n_mfcc: int = 40, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    mfcc = rng.normal(size=(n_frames, n_mfcc)).astype(np.float32) + np.arange(n_mfcc, dtype=np.float32)
    return pa.table({
        "event_id": [f"a-{i}" for i in range(n_frames)],
        "t_ns": pa.array([i * 10_000_000 for i in range(n_frames)], pa.int64()),
        "mfcc": pa.FixedSizeListArray.from_arrays(pa.array(mfcc.reshape(-1)), n_mfcc),
    })


def test_audio_embed_one_row_per_second_of_mean_and_std():
    table = mfcc_table(300, n_mfcc=40)
    out = AudioEmbedOperator().process(table)
    assert out.schema.equals(feature_schema())
    rows = out.to_pylist()
    assert len(rows) == 3
    assert [r["t_ns"] for r in rows] == [0, 1_000_000_000, 2_000_000_000]
    assert [r["event_id"] for r in rows] == ["a-0", "a-100", "a-200"]
    assert all(r["dim"] == 80 and r["granularity"] == "frame" and r["model_id"] == "mfcc-stats@1" for r in rows)
    mfcc = np.stack(table.column("mfcc").to_numpy(zero_copy_only=False)).astype(np.float64)
    second = mfcc[100:200]
    expected = np.concatenate([second.mean(axis=0), second.std(axis=0)])
    assert np.allclose(rows[1]["vector"], expected / np.linalg.norm(expected), atol=1e-6)


def test_audio_embed_trailing_window():
    assert len(AudioEmbedOperator().process(mfcc_table(350, n_mfcc=13))) == 4  # half a second pooled
    assert len(AudioEmbedOperator().process(mfcc_table(310, n_mfcc=13))) == 3  # 100 ms dropped
    out = AudioEmbedOperator(AudioEmbedConfig(window_frames=50)).process(mfcc_table(300, n_mfcc=13))
    assert len(out) == 6 and set(out.column("dim").to_pylist()) == {26}
