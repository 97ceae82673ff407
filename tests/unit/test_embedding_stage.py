"""The embedding stage body (in-process): feature files with lineage, user regions as roi rows."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from modalign.pipeline.embedding import Embedder
from modalign.schemas.arrow import arrow_type
from modalign.schemas.config import EmbedConfig, RunConfig
from modalign.schemas.tables import Box, FeatureRow

pytestmark = pytest.mark.unit


def test_user_regions_become_roi_rows_beside_face_boxes(tmp_path):
    from skimage.data import astronaut

    frame = np.zeros((360, 640, 3), np.uint8)
    frame[52:308, 192:448] = astronaut()[::2, ::2]
    table = pa.table({
        "event_id": ["s/cam/frame/0"], "t_ns": pa.array([0], pa.int64()),
        "frame": pa.FixedShapeTensorArray.from_numpy_ndarray(frame[None].copy()),
        "face_boxes": pa.array([[{"x0": 260, "y0": 70, "x1": 330, "y1": 150, "score": 0.9}]], pa.list_(arrow_type(Box))),
    })
    screen = (10, 10, 180, 120)
    emb = Embedder(RunConfig(embed=EmbedConfig(roi_boxes=[screen])), tmp_path, "a1")
    lineage = dict(session_id="s", source_id="cam", source_uri="file:///cam.mp4", source_version="sha256:0",
                   operators="video_frames@0.2.0;face_blur@0.2.0", policy="p@1", model_id=None)
    res = emb.embed("video", table, lineage, part=0)
    assert res["granularities"] == {"frame": 1, "roi": 2}
    assert sorted(res["files"]) == [f"features/{res['model_id']}/{g}/s/cam-a1-00000.parquet" for g in ("frame", "roi")]
    rows = ds.dataset(tmp_path / "features", format="parquet").to_table()
    assert rows.schema == FeatureRow.schema()
    rois = [r for r in rows.to_pylist() if r["granularity"] == "roi"]
    assert sorted((b["box"]["x0"], b["box"]["y0"], b["box"]["x1"], b["box"]["y1"]) for b in rois) == \
        sorted([screen, (260, 70, 330, 150)])
    assert all(r["operators"].endswith(";frame_embed@0.2.0") and r["model_id"].startswith("efficientnet-lite0@")
               for r in rows.to_pylist())
    screen_vec = next(np.array(r["vector"]) for r in rois if r["box"]["x0"] == 10)
    face_vec = next(np.array(r["vector"]) for r in rois if r["box"]["x0"] == 260)
    assert float(screen_vec @ face_vec) < 0.95  # two different regions, two different vectors
    assert table.column("face_boxes").to_pylist()[0][0]["x0"] == 260  # input untouched
