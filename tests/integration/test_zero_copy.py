"""De-identified frames travel to the embedder without copies: Ray object store and mmap'd IPC."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

pytestmark = pytest.mark.integration


def _deid_frames() -> pa.Table:
    from skimage.data import astronaut

    from modalign.operators.deid.faces import FaceBlurConfig, FaceBlurOperator

    canvas = np.full((360, 640, 3), 80, np.uint8)
    canvas[52:308, 192:448] = astronaut()[::2, ::2]
    frames = np.stack([canvas, canvas])
    table = pa.table({"event_id": ["s/cam/frame/0", "s/cam/frame/1"], "t_ns": pa.array([0, 40_000_000], pa.int64()),
                      "frame": pa.FixedShapeTensorArray.from_numpy_ndarray(frames)})
    op = FaceBlurOperator(FaceBlurConfig(secret=b"z" * 32))
    assert op.process(table).num_rows == 0  # both rows wait for the look-ahead of the face tracks
    (out,) = op.flush()
    face = (304, 111)  # the astronaut's face (its detection: x 277-331, y 81-142)
    for boxes, got in zip(out.column("face_boxes").to_pylist(), out.column("frame").chunk(0).to_numpy_ndarray()):
        # found, with one box (a weak box on the suit below it continues no track: it is looked at again, refused) ...
        assert len(boxes) == 1 and boxes[0]["x0"] <= face[0] < boxes[0]["x1"] and boxes[0]["y0"] <= face[1] < boxes[0]["y1"]
        assert np.abs(got[81:142, 277:331].astype(int) - canvas[81:142, 277:331]).mean() > 30  # ... and anonymised
    return out


def test_object_store_hands_the_embedder_views_not_copies(ray_local):
    ray = ray_local

    @ray.remote
    class EmbedderSide:
        def probe(self, refs: list) -> dict:
            from modalign.operators.ingest.video import frames_to_numpy

            a = frames_to_numpy(ray.get(refs[0]))
            b = frames_to_numpy(ray.get(refs[0]))
            return {"shared": bool(np.shares_memory(a, b)), "writeable": bool(a.flags.writeable),
                    "checksum": int(a.astype(np.int64).sum())}

    table = _deid_frames()
    ref = ray.put(table)
    from modalign.operators.ingest.video import frames_to_numpy

    local = frames_to_numpy(ray.get(ref))
    assert np.shares_memory(local, frames_to_numpy(ray.get(ref)))  # two gets: one shared-memory buffer
    res = ray.get(EmbedderSide.remote().probe.remote([ref]))
    assert res["shared"] and not res["writeable"]  # the actor reads the object store's pages in place
    assert res["checksum"] == int(frames_to_numpy(table).astype(np.int64).sum())


def test_memory_mapped_ipc_read_is_zero_copy(tmp_path):
    table = _deid_frames()
    path = tmp_path / "frames.arrow"
    with ipc.new_file(str(path), table.schema) as w:
        w.write_table(table)
    source = pa.memory_map(str(path))
    mapped = source.read_buffer()  # the whole mapping, itself zero-copy
    source.seek(0)
    read = ipc.open_file(source).read_all()
    values = read.column("frame").chunks[0].storage.values.buffers()[1]
    assert mapped.address <= values.address < mapped.address + mapped.size  # inside the mapping: no copy
    from modalign.operators.ingest.video import frames_to_numpy

    assert np.array_equal(frames_to_numpy(read), frames_to_numpy(table))
