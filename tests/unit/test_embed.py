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

from modalign.operators.cache.keys import BOX_TYPE, feature_schema
from modalign.operators.embed.audio import AudioEmbedConfig, AudioEmbedOperator
from modalign.operators.embed.device import pick_device
from modalign.operators.embed.image import (
    FrameEmbedConfig,
    FrameEmbedOperator,
    ImageEmbedConfig,
    ImageEncoder,
    _box_cell_weights,
    packaged_lite0_weights,
)
from modalign.operators.embed.text import TextBlockEmbedConfig, TextEmbedOperator
from modalign.schemas.errors import ConfigError, InputError

pytestmark = pytest.mark.unit

# mediapipe's face box (x0, y0, x1, y1) on skimage's 512 x 512 astronaut photo
FACE_BOX = (174, 68, 278, 172)
# other regions of the same photo: flag, helmet, shuttle model, mission patch
OTHER_BOXES = {"flag": (0, 0, 90, 250), "helmet": (280, 340, 500, 512), "shuttle": (350, 0, 470, 280),
               "patch": (130, 340, 215, 430)}


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
        "import modalign.operators.embed.image, modalign.operators.embed.text, modalign.operators.embed.audio, modalign.operators.embed.device\n"
        "import modalign.operators.cache.keys, modalign.operators.cache.store, modalign.operators.cache.index\n"
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


def test_folded_encoder_computes_the_packaged_models_features(image_encoder, astronaut, coffee):
    """The encoder runs EfficientNet-Lite0 with its BatchNorms folded into the convs and
    symmetric padding inside them (``fold_batchnorm``): the grid is the package's own model's,
    built and loaded by hand from the same weights and run unfolded, to float32 rounding."""
    import torch
    from efficientnet_lite_pytorch import EfficientNet

    from modalign.operators.embed.image import packaged_lite0_weights

    reference = EfficientNet.from_name("efficientnet-lite0", num_classes=1000, image_size=224)
    reference.load_state_dict(torch.load(str(packaged_lite0_weights()), map_location="cpu", weights_only=True))
    reference.eval()
    frames = np.stack([astronaut, coffee])
    grid = image_encoder.patch_grids(frames)
    with torch.inference_mode():
        want = reference.extract_features(image_encoder._preprocess(frames)).permute(0, 2, 3, 1).numpy()
    model = image_encoder._ensure_model()
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())  # folded, not bypassed
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in reference.modules())
    assert grid.shape == want.shape == (2, 7, 7, 1280)
    assert np.abs(grid - want).max() < 1e-3 * np.abs(want).max()
    assert cos(grid[0].ravel(), want[0].ravel()) > 0.99999 and cos(grid[1].ravel(), want[1].ravel()) > 0.99999


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


def test_plain_torch_minilm_gives_sentence_transformers_vectors(text_encoder):
    """The packaged MiniLM runs in plain torch (operators/embed/bert.py); its vectors are
    sentence-transformers' own for texts of every kind: empty, padded with spaces, non-Latin,
    longer than max_seq_length (cut at 256 word pieces), in one batch of mixed lengths."""
    from modalign.operators.embed.bert import BertSentenceEncoder
    from modalign.operators.embed.text import TextEmbedConfig, TextEncoder

    texts = SENTENCES + ["", "   leading and trailing spaces   ", "Ünïcödé naïve café, 東京タワー, Øyvind Løken",
                         "budget " * 400, "PERSON_3f9a wrote to EMAIL_77c1 on 2024-03-01."]
    ours = text_encoder.embed_texts(texts)
    assert isinstance(text_encoder._model, BertSentenceEncoder)
    reference = TextEncoder(TextEmbedConfig(device="cpu", backend="sentence-transformers"))
    theirs = reference.embed_texts(texts)
    assert type(reference._model).__name__ == "SentenceTransformer"
    assert reference.model_id == text_encoder.model_id  # same weights, same cache keys
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
    # the long text is cut: the same vector as its first 300 words
    assert np.allclose(text_encoder.embed_texts(["budget " * 300])[0], ours[-2], atol=1e-6)


def test_text_backend_native_refuses_a_folder_it_cannot_run_exactly(tmp_path):
    """A sentence-transformers folder whose pooling is not the mean (here CLS) is not run by the
    plain-torch encoder: 'auto' gives it to sentence-transformers, 'native' says why not."""
    import shutil

    from modalign.operators.embed import bert
    from modalign.operators.embed.text import TextEmbedConfig, TextEncoder, packaged_minilm_path

    folder = tmp_path / "cls-model"
    shutil.copytree(packaged_minilm_path(), folder)
    assert bert.readable(folder)
    pooling = folder / "1_Pooling" / "config.json"
    pooling.write_text(pooling.read_text().replace('"pooling_mode_cls_token": false', '"pooling_mode_cls_token": true')
                       .replace('"pooling_mode_mean_tokens": true', '"pooling_mode_mean_tokens": false'))
    assert not bert.readable(folder)
    with pytest.raises(ConfigError, match="backend 'native'"):
        TextEncoder(TextEmbedConfig(model_path=folder, backend="native", device="cpu")).load()
    auto = TextEncoder(TextEmbedConfig(model_path=folder, device="cpu"))
    auto.load()
    assert type(auto._model).__name__ == "SentenceTransformer"


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


# -- user encoders from local files (operators/embed/loaders.py) --------------------------------

TINY_NET_SOURCE = '''
import torch


class TinyMap(torch.nn.Module):
    """(N, 3, S, S) -> (N, C, S/32, S/32): one strided conv, a feature map."""

    def __init__(self, channels: int = 8):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, channels, kernel_size=32, stride=32)

    def forward(self, x):
        return torch.relu(self.conv(x))


class TinyVector(torch.nn.Module):
    """(N, 3, S, S) -> (N, C): the same conv, globally max-pooled."""

    def __init__(self, channels: int = 16):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, channels, kernel_size=32, stride=32)

    def forward(self, x):
        return torch.relu(self.conv(x)).amax(dim=(2, 3))


class TinyTokens(torch.nn.Module):
    def forward(self, x):
        return x.flatten(2)


def build(kind: str = "map", channels: int = 8):
    return TinyMap(channels) if kind == "map" else TinyVector(channels)
'''


@pytest.fixture(scope="module")
def tiny_nets(tmp_path_factory):
    """A module with tiny networks (importable as ``tinynets``), their TorchScript files and a checkpoint."""
    import importlib
    import torch

    d = tmp_path_factory.mktemp("tinynets")
    (d / "tinynets.py").write_text(TINY_NET_SOURCE)
    sys.path.insert(0, str(d))
    try:
        mod = importlib.import_module("tinynets")
        torch.manual_seed(0)
        nets = {"map": mod.TinyMap(8).eval(), "vector": mod.TinyVector(16).eval()}
        for name, net in nets.items():
            torch.jit.script(net).save(str(d / f"{name}.pt"))
        torch.jit.script(mod.TinyTokens()).save(str(d / "tokens.pt"))
        # a Lightning/DataParallel-style checkpoint of the map network's weights
        torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in nets["map"].state_dict().items()}},
                   d / "map_ckpt.pth")
        yield d, nets
    finally:
        sys.path.remove(str(d))
        sys.modules.pop("tinynets", None)


def reference_grid(net, frame: np.ndarray, size: int = 224) -> np.ndarray:
    """The contract's preprocessing written out: resize, /255, ImageNet mean/std; (h, w, C) output."""
    import torch
    import torch.nn.functional as F

    x = torch.from_numpy(frame).permute(2, 0, 1)[None].float() / 255.0
    x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    mean = torch.tensor((0.485, 0.456, 0.406)).view(1, 3, 1, 1)
    std = torch.tensor((0.229, 0.224, 0.225)).view(1, 3, 1, 1)
    with torch.inference_mode():
        y = net((x - mean) / std)
    return (y[0].permute(1, 2, 0) if y.ndim == 4 else y[0][None, None]).numpy()


def test_torchscript_feature_map_encoder_from_config(tiny_nets, astronaut, coffee):
    d, nets = tiny_nets
    enc = ImageEncoder(ImageEmbedConfig(model="tiny-map", weights_path=d / "map.pt", device="cpu"))
    enc.setup()
    digest = hashlib.sha256((d / "map.pt").read_bytes()).hexdigest()
    assert enc.model_id == f"tiny-map@{digest[:12]}"
    assert not enc.loaded  # setup resolves the id only; the network loads on first use
    out = enc.embed_frames(np.stack([astronaut, coffee]), [[FACE_BOX], []])
    assert enc.loaded and enc.spatial and enc.grid_hw() == (7, 7) and enc.dim == 8
    ref = reference_grid(nets["map"], astronaut)
    assert out["patches"].shape == (2, 7, 7, 8)
    assert np.allclose(out["patches"][0], ref, atol=1e-4)
    mean = ref.reshape(-1, 8).mean(axis=0)
    assert np.allclose(out["frame"][0], mean / np.linalg.norm(mean), atol=1e-5)
    assert np.allclose(out["roi"][0][0], ImageEncoder.pool_roi(ref, FACE_BOX, (512, 512)), atol=1e-5)

    op = FrameEmbedOperator(FrameEmbedConfig(encoder=enc.config), encoder=enc)
    rows = op.process(frames_table(np.stack([astronaut, coffee]), [[FACE_BOX], []])).to_pylist()
    assert [(r["granularity"], r["dim"], r["model_id"]) for r in rows] == [
        ("frame", 8, enc.model_id), ("roi", 8, enc.model_id), ("frame", 8, enc.model_id)]


def test_vector_encoder_takes_roi_vectors_from_crops(tiny_nets, astronaut):
    d, nets = tiny_nets
    enc = ImageEncoder(ImageEmbedConfig(model="tiny-vec", weights_path=d / "vector.pt", device="cpu"))
    out = enc.embed_frames(astronaut[None], [[FACE_BOX, OTHER_BOXES["flag"]]])
    assert not enc.spatial and out["patches"].shape == (1, 1, 1, 16)
    whole = reference_grid(nets["vector"], astronaut)[0, 0]
    assert np.allclose(out["frame"][0], whole / np.linalg.norm(whole), atol=1e-5)
    x0, y0, x1, y1 = FACE_BOX
    face = reference_grid(nets["vector"], np.ascontiguousarray(astronaut[y0:y1, x0:x1]))[0, 0]
    assert np.allclose(out["roi"][0][0], face / np.linalg.norm(face), atol=1e-4)
    assert cos(out["roi"][0][0], out["roi"][0][1]) < 0.999  # each box has its own vector

    # through the operator and a cache: a second run is served without the network
    from modalign.operators.cache.store import FeatureCache

    cache = FeatureCache(None)
    table = frames_table(astronaut[None], [[FACE_BOX]])
    first = FrameEmbedOperator(FrameEmbedConfig(encoder=enc.config), encoder=enc, cache=cache).process(table)
    assert np.allclose(first.column("vector")[1].values.to_numpy(), out["roi"][0][0], atol=1e-5)
    assert cache.stats()["misses"]["roi"] == 1
    calls = enc.forward_calls
    again = FrameEmbedOperator(FrameEmbedConfig(encoder=enc.config), encoder=enc, cache=cache).process(table)
    assert again.equals(first) and enc.forward_calls == calls


def test_factory_with_a_state_dict_checkpoint(tiny_nets, astronaut):
    d, nets = tiny_nets
    cfg = ImageEmbedConfig(model="tiny-fac", weights_path=d / "map_ckpt.pth", factory="tinynets:build",
                           factory_kwargs={"kind": "map", "channels": 8}, device="cpu")
    assert cfg.loader == "factory"
    enc = ImageEncoder(cfg)
    grid = enc.patch_grids(astronaut[None])[0]
    assert np.allclose(grid, reference_grid(nets["map"], astronaut), atol=1e-4)
    weights_only = hashlib.sha256((d / "map_ckpt.pth").read_bytes()).hexdigest()[:12]
    assert enc.model_id.startswith("tiny-fac@") and enc.model_id != f"tiny-fac@{weights_only}"
    other = ImageEncoder(cfg.model_copy(update={"factory_kwargs": {"kind": "map", "channels": 8, "x": 1}}))
    other.setup()
    assert other.model_id != enc.model_id  # the factory's kwargs are part of the identity


def test_custom_mean_std_change_vectors_and_cache_keys(tiny_nets, astronaut):
    d, _ = tiny_nets
    base = ImageEmbedConfig(model="tiny-map", weights_path=d / "map.pt", device="cpu")
    grey = base.model_copy(update={"mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)})
    assert base.normalisation == "imagenet" and grey.normalisation.startswith("mean=0.5")
    ops = [FrameEmbedOperator(FrameEmbedConfig(encoder=c)) for c in (base, grey)]
    keys = [op.keys_for(astronaut, [])["frame"] for op in ops]
    assert keys[0] != keys[1]
    vecs = [op.encoder.embed_frames(astronaut[None])["frame"][0] for op in ops]
    assert not np.allclose(vecs[0], vecs[1], atol=1e-4)


@pytest.mark.parametrize("change, match", [
    (dict(weights_path=None), "needs weights_path"),
    (dict(weights_path="missing.pt"), "does not exist"),
    (dict(weights_path="map_ckpt.pth"), "not a TorchScript file"),
    (dict(weights_path="map.pt", factory="no_such_module_xyz:build"), "cannot be imported"),
    (dict(weights_path="map.pt", factory="tinynets:nothing"), "has no attribute"),
    (dict(weights_path="map_ckpt.pth", factory="tinynets:build", factory_kwargs={"channels": 4}), "does not fit"),
    (dict(weights_path="tokens.pt"), "expected a feature map"),
])
def test_user_encoder_config_errors_say_what_to_fix(tiny_nets, astronaut, change, match):
    d, _ = tiny_nets
    fields = dict(model="tiny", device="cpu", **change)
    if fields.get("weights_path"):
        fields["weights_path"] = d / fields["weights_path"]
    with pytest.raises(ConfigError, match=match):
        ImageEncoder(ImageEmbedConfig(**fields)).embed_frames(astronaut[None])


def test_user_encoder_names_and_factories_are_validated():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        ImageEmbedConfig(model="../evil", weights_path="x.pt")
    with pytest.raises(ValidationError):
        ImageEmbedConfig(model="m", weights_path="x.pt", factory="not a path")


def test_no_network_is_loaded_when_every_vector_is_cached(astronaut, text_encoder, tmp_path):
    from modalign.operators.cache.store import FeatureCache

    cache = FeatureCache(tmp_path / "c")
    table = frames_table(astronaut[None], [[FACE_BOX]])
    first = FrameEmbedOperator(FrameEmbedConfig(encoder=ImageEmbedConfig(device="cpu")), cache=cache).process(table)
    blocks = pa.table({"event_id": ["b0"], "t_ns": pa.array([0], pa.int64()), "text": [SENTENCES[0]]})
    text_first = TextEmbedOperator(TextBlockEmbedConfig(encoder=text_encoder.config), cache=cache).process(blocks)
    cache.flush()

    warm = FeatureCache(tmp_path / "c")  # a new process's view: fresh encoders, cache on disk
    op = FrameEmbedOperator(FrameEmbedConfig(encoder=ImageEmbedConfig(device="cpu")), cache=warm)
    top = TextEmbedOperator(TextBlockEmbedConfig(encoder=text_encoder.config), cache=warm)
    assert op.process(table).equals(first) and top.process(blocks).equals(text_first)
    assert not op.encoder.loaded and not top.encoder.loaded


# -- registry by modality ----------------------------------------------------------------------


def test_registry_maps_modalities_to_encoders_and_operators(tiny_nets):
    from modalign.operators.embed.registry import ENCODERS, build_operator, encoder_for, image_embed_config
    from modalign.schemas.config import EmbedConfig, ImageEncoderSpec

    assert set(ENCODERS) == {"image", "text", "audio"}
    assert encoder_for("video").name == "efficientnet-lite0" and encoder_for("image").operator == "frame_embed"
    assert encoder_for("pdf").granularities == ("roi",) and encoder_for("audio").name == "mfcc-stats@1"
    with pytest.raises(ConfigError):
        encoder_for("smell")
    ops = {m: build_operator(m, EmbedConfig()) for m in ("video", "pdf", "audio")}
    assert [type(o).__name__ for o in ops.values()] == ["FrameEmbedOperator", "TextEmbedOperator",
                                                       "AudioEmbedOperator"]
    assert ops["video"].config.encoder == ImageEmbedConfig() and ops["video"].config.modality == "video"

    d, _ = tiny_nets
    embed = EmbedConfig(image_encoder=ImageEncoderSpec(name="tiny-map", weights=d / "map.pt"),
                        image_size=160, batch_size=4, device="cpu", patch_features=True)
    cfg = image_embed_config(embed)
    assert (cfg.model, cfg.weights_path, cfg.loader, cfg.image_size, cfg.batch_size) == (
        "tiny-map", d / "map.pt", "torchscript", 160, 4)
    op = build_operator("video", embed)
    assert op.config.emit_patches and op.config.encoder == cfg


# -- device ------------------------------------------------------------------------------------


def test_embed_actor_resources():
    import torch

    from modalign.operators.embed.device import embed_actor_resources, to_device

    assert embed_actor_resources("cpu", cluster_gpus=4) == {}
    assert embed_actor_resources("auto", cluster_gpus=1) == {"num_gpus": 1}
    assert embed_actor_resources("cuda", cluster_gpus=0) == {}
    assert embed_actor_resources("auto") == ({"num_gpus": 1} if torch.cuda.is_available() else {})
    with pytest.raises(ConfigError):
        embed_actor_resources("tpu")
    t = torch.arange(3)
    assert to_device(t, "cpu") is t


def test_embed_actors_scale_with_the_gpus_or_the_ingest_actors():
    from modalign.operators.embed.device import embed_actor_count

    gpu = {"num_gpus": 1}
    assert embed_actor_count(gpu, cluster_gpus=4, n_ingest=64) == 4  # one per GPU
    assert embed_actor_count(gpu, cluster_gpus=1.5, n_ingest=2) == 1  # whole GPUs only
    assert embed_actor_count({}, cluster_gpus=0, n_ingest=2) == 1  # this machine: 2 cores, one embedder
    assert embed_actor_count({}, cluster_gpus=0, n_ingest=16) == 4  # CPUs: one per 4 ingest actors
    assert embed_actor_count({}, cluster_gpus=4, n_ingest=16) == 4  # device: cpu on a GPU cluster
    assert embed_actor_count(gpu, cluster_gpus=8, n_ingest=2, configured=3) == 3  # runtime.embed_actors


def test_cache_stats_of_several_embed_actors_add_up():
    from modalign.operators.cache.store import FeatureCache, merge_stats

    a, b = FeatureCache(), FeatureCache()
    a.record("frame", hit=True, n=3)
    a.record("frame", hit=False)
    b.record("frame", hit=False, n=2)
    b.record("roi", hit=True)
    m = merge_stats([a.stats(), b.stats()])
    assert m["hits"]["frame"] == 3 and m["misses"]["frame"] == 3 and m["hits"]["roi"] == 1
    assert m["hit_rate"] == pytest.approx(4 / 7)
    assert merge_stats([a.stats()]) == {k: v for k, v in a.stats().items()}


needs_cuda = pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs CUDA (runs on a GPU machine)")


@pytest.mark.gpu
@needs_cuda
def test_cuda_bf16_vectors_agree_with_cpu_fp32(image_encoder, astronaut, coffee):
    gpu = ImageEncoder(ImageEmbedConfig(device="cuda"))
    frames = np.stack([astronaut, coffee])
    out = gpu.embed_frames(frames, [[FACE_BOX], []])
    ref = image_encoder.embed_frames(frames, [[FACE_BOX], []])
    assert gpu.device.startswith("cuda") and out["patches"].dtype == np.float32
    assert gpu.model_id == image_encoder.model_id  # same weights, same id on every device
    for a, b in zip(out["frame"], ref["frame"]):
        assert cos(a, b) > 0.99  # bf16 autocast vs fp32
    assert cos(out["roi"][0][0], ref["roi"][0][0]) > 0.98


@pytest.mark.gpu
@needs_cuda
def test_cuda_copies_are_pinned_and_oom_splits_on_device(astronaut):
    import torch

    from modalign.operators.embed.device import embed_actor_resources, to_device

    x = to_device(torch.from_numpy(astronaut), "cuda")
    torch.cuda.synchronize()
    assert x.is_cuda and torch.equal(x.cpu(), torch.from_numpy(astronaut))
    assert embed_actor_resources("auto") == {"num_gpus": 1}
    enc = ImageEncoder(ImageEmbedConfig(device="cuda", batch_size=64))
    grids = enc.patch_grids(np.stack([astronaut] * 64))
    assert grids.shape == (64, 7, 7, 1280) and np.isfinite(grids).all()
