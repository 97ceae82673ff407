"""A video cut into keyframe ranges (``ingest.video.range_s``): each range decodes an overlap on
either side of its own frames, so faces and text on screen are covered across every cut; the
ranges together give every frame exactly once, with the indices, times and event ids of a
decode from the start, and the whole file's sha256."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from modalign.pipeline.discovery import discover
from modalign.pipeline.items import DoneItem, QuarantineItem, SourceJob
from modalign.pipeline.sample import generate_sample, sample_face_box
from modalign.pipeline.worker import IngestWorker
from modalign.schemas.config import RunConfig
from modalign.schemas.files import sha256_file, stat_version

pytestmark = pytest.mark.integration

RANGE_S = 4.0  # the sample's keyframes are 2 s apart: cuts at 4, 8 and 12 s


@pytest.fixture(scope="module")
def video_job(tmp_path_factory) -> SourceJob:
    manifest = generate_sample(tmp_path_factory.mktemp("ranges"), duration_s=14.0, seed=3)
    (session,) = discover(manifest)
    spec = next(s for s in session.manifest.sources if s.modality == "video" and s.track_of is None)
    path = session.resolve(spec)
    return SourceJob(run_id="r" * 32, session_id=session.manifest.session_id, spec=spec, path=path,
                     uri=path.as_uri(), version=stat_version(path))


def _ingest(worker: IngestWorker, job: SourceJob) -> list:
    items = list(worker.ingest(job))
    assert not [i for i in items if isinstance(i, QuarantineItem)]
    assert isinstance(items[-1], DoneItem) and items[-1].row.status == "ingested"
    return items


def _frames(out: Path) -> list[dict]:
    cols = ["event_id", "frame_index", "t_ns", "pts", "face_boxes", "text_boxes"]
    return sorted(ds.dataset(out / "events" / "video", format="parquet").to_table(columns=cols).to_pylist(),
                  key=lambda r: r["t_ns"])


def _covers(boxes: list[dict], face: tuple[int, int, int, int], need: float = 0.8) -> bool:
    """Whether the boxes together cover ``need`` of the true face box (pixel count)."""
    import numpy as np

    x0, y0, x1, y1 = face
    mask = np.zeros((y1 - y0, x1 - x0), dtype=bool)
    for b in boxes:
        mask[max(0, b["y0"] - y0):max(0, min(y1, b["y1"]) - y0), max(0, b["x0"] - x0):max(0, min(x1, b["x1"]) - x0)] = True
    return mask.mean() >= need


def test_ranges_cover_every_frame_once_and_every_face_across_the_cuts(video_job, tmp_path):
    keys = tmp_path / "keys"
    cfg = RunConfig(key_store=keys, ingest={"video": {"range_s": RANGE_S, "range_overlap_s": 1.0}})
    worker = IngestWorker(cfg, tmp_path / "ranged", keys)
    ranges = worker.video_ranges(video_job)
    assert [r.index for r in ranges] == [0, 1, 2, 3] and all(r.count == 4 for r in ranges)
    assert all(r.sha256 == "sha256:" + sha256_file(video_job.path) for r in ranges)
    for prev, nxt in zip(ranges, ranges[1:]):  # each cut on a keyframe, the overlap decoded on both sides
        assert prev.end_pts == nxt.start_pts and nxt.decode_from_pts < nxt.start_pts < prev.decode_to_pts
    dones = [_ingest(worker, replace(video_job, range=r))[-1] for r in ranges]

    whole_cfg = RunConfig(key_store=keys, ingest={"video": {"range_s": None}})
    whole = IngestWorker(whole_cfg, tmp_path / "whole", keys)
    assert whole.video_ranges(video_job) == []
    whole_done = _ingest(whole, video_job)[-1]

    got, want = _frames(tmp_path / "ranged"), _frames(tmp_path / "whole")
    # The ranges' parts, in part-number order, follow each other in time (the dataset reader's
    # binary search over a source's parts, ``pipeline.dataset.ORDERED_PARTS``, relies on it).
    spans = [(min(t), max(t)) for t in (pq.read_table(f, columns=["t_ns"]).column("t_ns").to_pylist()
                                       for f in sorted((tmp_path / "ranged" / "events" / "video").rglob("*.parquet"),
                                                       key=lambda f: int(f.stem.rsplit("-", 1)[1])))]
    assert len(spans) > len(ranges) and all(a[1] < b[0] for a, b in zip(spans, spans[1:]))
    ids = Counter(r["event_id"] for r in got)
    assert max(ids.values()) == 1  # no frame twice (an overlap is decoded twice, output once)
    assert [(r["event_id"], r["frame_index"], r["t_ns"], r["pts"]) for r in got] == \
           [(r["event_id"], r["frame_index"], r["t_ns"], r["pts"]) for r in want]  # none lost, same ids
    assert sum(d.row.events for d in dones) == whole_done.row.events == len(want) == 14 * 25

    # Every frame's face is covered, the frames at each cut included (a track carried through
    # the overlap, not restarted cold at the cut).
    # (The truth is the pasted crop, hair and all; the blur starts at the brows: 0.85-0.89 of it.)
    uncovered = [r["frame_index"] for r in got if not _covers(r["face_boxes"], sample_face_box(r["t_ns"]))]
    assert uncovered == []
    cuts = {r.start_pts for r in ranges[1:]}
    at_cut = [r for r in got if any(abs(r["pts"] - c) <= 512 * 3 for c in cuts)]  # 3 frames either side
    assert len(at_cut) == 3 * 7
    by_id = {r["event_id"]: r for r in want}
    for r in at_cut:  # as a whole decode covers them: the face, and the slide text where it found any
        assert _covers(r["face_boxes"], sample_face_box(r["t_ns"]))
        assert bool(r["text_boxes"]) == bool(by_id[r["event_id"]]["text_boxes"]), r["frame_index"]
    counts = Counter()
    for d in dones:
        counts.update(d.counts)
    assert counts["faces_blurred"] == whole_done.counts["faces_blurred"] == len(want)


def test_sampled_frames_reach_the_embedder_in_full_batches_each_once(video_job, tmp_path):
    """At 4 fps of 25 a batch of frames holds a frame or two to embed: they are gathered into calls
    of ``embed.batch_size`` frames, or of ``ingest.video.batch_bytes`` pixels, whichever comes first,
    and what is left goes at the end of the stream (or of a range); every sampled frame once, in order."""
    import numpy as np

    from modalign.pipeline.items import EmbedItem
    from modalign.pipeline.worker import sample_every

    keys = tmp_path / "keys"
    fast = {"face": {"action": "keep"}, "frame_text": {"action": "keep"}}
    frame_bytes = 640 * 360 * 3

    def embedded(cfg: RunConfig, out: Path, jobs: list[SourceJob]) -> list[list[str]]:
        worker = IngestWorker(cfg, out, keys)
        items = [i for job in jobs for i in _ingest(worker, job) if isinstance(i, EmbedItem)]
        assert all(i.rows == i.table.num_rows for i in items)
        return [i.table.column("event_id").to_pylist() for i in items]

    by_rows = RunConfig(key_store=keys, policy=fast, embed={"image_fps": 4, "batch_size": 16},
                        ingest={"video": {"range_s": None}})
    calls = embedded(by_rows, tmp_path / "rows", [video_job])
    frames = _frames(tmp_path / "rows")
    t_ns = np.array([r["t_ns"] for r in frames])
    want = [r["event_id"] for r, keep in zip(frames, sample_every(t_ns, 4.0, {})) if keep]
    assert len(want) == 14 * 4 and [e for c in calls for e in c] == want
    assert [len(c) for c in calls] == [16, 16, 16, 8]

    by_bytes = by_rows.model_copy(update={"ingest": by_rows.ingest.model_copy(update={
        "video": by_rows.ingest.video.model_copy(update={"batch_bytes": 3 * frame_bytes})})})
    calls = embedded(by_bytes, tmp_path / "bytes", [video_job])
    assert [e for c in calls for e in c] == want and {len(c) for c in calls[:-1]} == {3} and len(calls[-1]) <= 3

    ranged = by_rows.model_copy(update={"ingest": by_rows.ingest.model_copy(update={
        "video": by_rows.ingest.video.model_copy(update={"range_s": RANGE_S})})})
    worker = IngestWorker(ranged, tmp_path / "ranged", keys)
    calls = embedded(ranged, tmp_path / "ranged", [replace(video_job, range=r) for r in worker.video_ranges(video_job)])
    assert [e for c in calls for e in c] == want and [len(c) for c in calls] == [16, 16, 16, 8]
