"""``modalign search`` over an output folder built in-process (pipeline/search.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from skimage import data
from skimage.transform import resize

from modalign.operators.cache.keys import BOX_TYPE
from modalign.schemas.errors import ConfigError, UnreadableInputError
from modalign.pipeline.search import find_record, render_results, search

pytestmark = pytest.mark.unit

FACE_BOX = (174, 68, 278, 172)  # the astronaut's face
BLOCKS = [
    "Quarterly revenue grew by twelve percent in Europe",
    "Engineers replaced the cooling pump in the data centre",
    "Submit the travel expense form before Friday",
]


def _photo(img: np.ndarray) -> np.ndarray:
    return resize(img, (512, 512), preserve_range=True, anti_aliasing=True).round().astype(np.uint8)


@pytest.fixture(scope="module")
def photos() -> dict[str, np.ndarray]:
    return {"astronaut": data.astronaut(), "coffee": _photo(data.coffee()[:400, 100:500]),
            "chelsea": _photo(data.chelsea()), "rocket": _photo(data.rocket())}


@pytest.fixture(scope="module")
def out(tmp_path_factory, photos) -> Path:
    """An output folder as a run leaves it: features, indexes, PDF events, committed with the run summary."""
    from modalign.pipeline.commits import CommitLog
    from modalign.pipeline.embedding import Embedder
    from modalign.pipeline.layout import OutputLayout
    from modalign.pipeline.runner import build_indexes
    from modalign.schemas.config import RunConfig

    root = tmp_path_factory.mktemp("search") / "out"
    config = RunConfig(embed=RunConfig().embed.model_copy(update={"device": "cpu"}))
    emb = Embedder(config, root, "a1")
    names = list(photos)
    frames = pa.table({
        "event_id": [f"s1/cam/frame/{i}" for i in range(len(names))],
        "t_ns": pa.array([i * 1_000_000_000 for i in range(len(names))], pa.int64()),
        "frame": pa.FixedShapeTensorArray.from_numpy_ndarray(np.stack([photos[n] for n in names])),
        "face_boxes": pa.array([[dict(zip(("x0", "y0", "x1", "y1"), FACE_BOX), score=0.9)], [], [], []],
                               pa.list_(BOX_TYPE)),
    })
    lineage = dict(session_id="s1", source_id="cam", source_uri="file:///data/s1/cam.mp4",
                   source_version="sha256:00", operators="video_frames@0.1.0", policy="p@1")
    files = emb.embed("video", frames, lineage, 0)["files"]
    boxes = [{"x0": 10, "y0": 20 + 100 * i, "x1": 900, "y1": 80 + 100 * i, "score": 0.95} for i in range(3)]
    blocks = pa.table({
        "event_id": [f"s1/slides/block/{i}" for i in range(3)],
        "t_ns": pa.array([2_500_000_000] * 3, pa.int64()),
        "text": BLOCKS, "box": pa.array(boxes, BOX_TYPE), "page_index": pa.array([0, 0, 0], pa.int32()),
    })
    files += emb.embed("pdf", blocks, dict(lineage, source_id="slides", source_uri="file:///data/s1/slides.pdf"),
                       0)["files"]
    emb.flush()
    (root / "events" / "pdf" / "s1").mkdir(parents=True)
    pq.write_table(blocks.select(["event_id", "text"]), root / "events" / "pdf" / "s1" / "slides-a1-00000.parquet")
    files.append("events/pdf/s1/slides-a1-00000.parquet")
    indexes = build_indexes(OutputLayout(root), [f for f in files if f.startswith("features/")], "a1")
    CommitLog.of(root).commit(None, run_id="a1", sessions={"s1": {"run_id": "a1", "files": files}},
                              shared=[ix["path"] for ix in indexes],
                              summary={"config": config.model_dump(mode="json")})
    return root


def _save(img: np.ndarray, path: Path) -> Path:
    Image.fromarray(img).save(path, quality=90)
    return path


def test_an_image_finds_its_own_frame_first(out, photos, tmp_path):
    for i, name in enumerate(photos):
        res = search(out, image=_save(photos[name], tmp_path / f"{name}.jpg"), k=3)  # JPEG: not bit-identical
        top = res[0]
        assert top["event_id"] == f"s1/cam/frame/{i}" and top["granularity"] == "frame", (name, res)
        assert top["score"] > 0.95 and res[1]["score"] < top["score"]
        assert (top["session_id"], top["source_id"], top["t_ns"], top["t_s"]) == ("s1", "cam", i * 10**9, float(i))
        assert top["box"] is None and top["modality"] == "video" and top["model_id"].startswith("efficientnet-lite0@")
    assert [r["rank"] for r in res] == [1, 2, 3]


def test_a_face_crop_finds_the_face_roi(out, photos, tmp_path):
    x0, y0, x1, y1 = FACE_BOX
    crop = _save(np.ascontiguousarray(photos["astronaut"][y0:y1, x0:x1]), tmp_path / "face.png")
    res = search(out, image=crop, granularity="roi", k=1)
    assert res[0]["event_id"] == "s1/cam/frame/0" and res[0]["granularity"] == "roi"
    assert (res[0]["box"]["x0"], res[0]["box"]["y0"], res[0]["box"]["x1"], res[0]["box"]["y1"]) == FACE_BOX


def test_text_query_searches_text_blocks_and_shows_their_text(out):
    res = search(out, text="cooling pump engineers", k=3)
    assert res[0]["event_id"] == "s1/slides/block/1" and res[0]["granularity"] == "roi"
    assert res[0]["text"] == BLOCKS[1] and res[0]["box"]["y0"] == 120 and res[0]["modality"] == "pdf"
    assert res[0]["model_id"].startswith("all-minilm-l6-v2@") and res[0]["score"] > res[1]["score"]


def test_a_record_is_its_own_nearest_neighbour(out):
    by_event = search(out, record="s1/cam/frame/2", k=2)
    assert by_event[0]["event_id"] == "s1/cam/frame/2" and by_event[0]["score"] == pytest.approx(1.0, abs=1e-5)
    assert by_event[0]["granularity"] == "frame"  # an event with several rows prefers its frame row
    fid = by_event[0]["feature_id"]
    by_id = search(out, record=str(fid), k=1)
    assert by_id[0]["feature_id"] == fid
    roi = search(out, record="s1/cam/frame/0", granularity="roi", k=1)
    assert roi[0]["granularity"] == "roi" and roi[0]["event_id"] == "s1/cam/frame/0"
    assert find_record(out, "s1/slides/block/2")["granularity"] == "roi"
    assert json.loads(json.dumps(by_event)) == by_event  # --json prints it as it is


def test_identical_vectors_put_the_record_first(out):
    """Two rows with the same vector tie at 1.0: the queried record wins the tie."""
    import modalign
    from modalign.operators.cache.index import FeatureIndex

    row = find_record(out, "s1/slides/block/0")
    path = modalign.open(out).index_file(row["model_id"], "roi")
    index = FeatureIndex.load(path)
    twin = find_record(out, "s1/slides/block/2")
    original = index.reconstruct(twin["feature_id"])
    vec = np.asarray(row["vector"], np.float32)[None]
    try:
        # twin gets the record's vector and the record is re-added after it: FAISS alone would list twin first
        index.add(np.array([twin["feature_id"]]), vec)
        index.add(np.array([row["feature_id"]]), vec)
        index.save(path)
        res = search(out, record=str(row["feature_id"]), k=2)
        assert [r["feature_id"] for r in res] == [row["feature_id"], twin["feature_id"]]
        assert res[1]["score"] == pytest.approx(1.0, abs=1e-5)
    finally:
        index.add(np.array([twin["feature_id"]]), original[None])
        index.save(path)


def test_rows_removed_from_the_index_are_not_returned(out, tmp_path):
    import shutil

    import modalign
    from modalign.operators.cache.index import FeatureIndex

    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    rec = find_record(copy, "s1/slides/block/1")
    path = modalign.open(copy).index_file(rec["model_id"], "roi")
    index = FeatureIndex.load(path)
    assert index.remove(np.array([rec["feature_id"]])) == 1
    index.save(path)
    assert rec["feature_id"] not in [r["feature_id"] for r in search(copy, text="cooling pump", k=5)]


def test_render_results_table(out):
    text = render_results(search(out, text="travel expense form", k=2))
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["#", "score", "session", "source"] and "event_id" in lines[0]
    assert "s1/slides/block/2" in lines[2] and "2.500" in lines[2] and "10,220,900,280" in lines[2]
    assert BLOCKS[2] in lines[3]
    assert render_results([]) == "no results"


def test_bad_queries_say_what_to_do(out, tmp_path):
    with pytest.raises(ConfigError, match="exactly one"):
        search(out, text="a", record="b")
    with pytest.raises(ConfigError, match="exactly one"):
        search(out)
    with pytest.raises(ConfigError, match="no feature row"):
        search(out, record="no/such/event")
    with pytest.raises(ConfigError, match="available: .*roi"):
        search(out, text="cooling", granularity="patch")
    with pytest.raises(ConfigError, match="granularity must be"):
        search(out, text="cooling", granularity="page")
    with pytest.raises(UnreadableInputError):
        search(out, image=tmp_path / "missing.jpg")
    (tmp_path / "junk.jpg").write_bytes(b"not an image")
    with pytest.raises(UnreadableInputError, match="cannot be decoded"):
        search(out, image=tmp_path / "junk.jpg")
    with pytest.raises(ConfigError, match="does not exist"):
        search(tmp_path / "nowhere", text="x")
