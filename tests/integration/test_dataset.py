"""Training samples of a real run (the shared ``lineage_run``: a meeting with video, two audio sources
and slides; two audio recorders; a deck alone) checked against its committed timeline and event
tables: every part within its tolerance window of the span, gaps as the records say, shards of 2
ranks x 2 DataLoader workers covering every sample once, exports that read back as the samples,
splits by session, and the same rows through Ray Data and Hugging Face datasets."""

from __future__ import annotations

import io
import json
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import modalign
from modalign.pipeline.dataset import (AlignedSpec, Geometry, assign_splits, column_numpy, context, iter_blocks,
                                       plain_batch, rows_of, samples_of, to_batch)
from modalign.pipeline.export import export
from modalign.schemas.errors import ConfigError

pytestmark = pytest.mark.integration
MS = 1_000_000


@pytest.fixture(scope="module")
def out(lineage_run):
    return modalign.open(lineage_run.out)


@pytest.fixture(scope="module")
def tables(out):
    """The committed tables as Python, keyed the way the samples refer to them."""
    def rows(name, columns):
        have = out.table(name).schema.names
        return out.table(name).to_table(columns=[c for c in columns if c in have]).to_pylist()

    recs = rows("records", ["session_id", "source_id", "modality", "tick_index", "t_ns", "event_id", "residual_ns",
                            "decision", "source_version"])
    feats = rows("features", ["event_id", "granularity", "modality", "feature_id", "vector"])
    return {
        "records": {(r["session_id"], r["source_id"], r["tick_index"]): r for r in recs},
        "sources": {(r["session_id"], r["modality"]): sorted({x["source_id"] for x in recs if
                                                             (x["session_id"], x["modality"]) == (r["session_id"], r["modality"])})[0]
                    for r in recs},
        "video": {r["event_id"]: r for r in rows("events_video", ["event_id", "t_ns", "frame_jpeg", "quality"])},
        "audio": rows("events_audio", ["session_id", "source_id", "event_id", "t_ns", "mfcc", "voiced", "quality"]),
        "pdf": rows("events_pdf", ["session_id", "source_id", "event_id", "t_ns", "end_t_ns", "block_index", "text",
                                   "quality"]),
        "features": feats,
    }


def _check_sample(row, frame, tables, out, T):
    """One sample (``row``: Python values, per-tick values as lists of T; ``frame``: (T, H, W, 3))."""
    tol = {m: v * MS for m, v in out.run["config"]["align"]["tolerance_ms"].items()}
    hop = int(out.run["config"]["ingest"]["audio"]["hop_ms"] * MS)
    sid, start, end = row["session_id"], row["start_ns"], row["end_ns"]
    ticks = [row["tick_index"] + t for t in range(T)]
    per = {k: (v if T > 1 else [v]) for k, v in row.items() if k.endswith(("_event_id", "_residual_ns", "_gap", "_quality"))
           and not k.startswith(("feat_", "audio_mfcc"))}
    for m in ("video", "audio", "pdf"):
        src = tables["sources"].get((sid, m))
        assert row[f"{m}_source_id"] == src
        for t, k in enumerate(ticks):
            rec = tables["records"].get((sid, src, k))
            if rec is None:  # no source of this modality in the session: all gaps
                assert src is None and per[f"{m}_gap"][t] and per[f"{m}_event_id"][t] is None
                continue
            assert row[f"{m}_source_version"] == rec["source_version"]
            assert per[f"{m}_gap"][t] == (rec["decision"] == "gap")
            assert per[f"{m}_event_id"][t] == rec["event_id"]
            assert per[f"{m}_residual_ns"][t] == (rec["residual_ns"] or 0)
    # video: the matched frame lies within the tolerance of its tick; pixels are its JPEG's; zeros at a gap
    for t, (e, gap) in enumerate(zip(per["video_event_id"], per["video_gap"])):
        if gap:
            assert frame is None or not frame[t].any()
            continue
        ev = tables["video"][e]
        assert abs(ev["t_ns"] - (start + (ticks[t] - ticks[0]) * 40 * MS)) <= tol["video"]
        assert start - tol["video"] <= ev["t_ns"] < end + tol["video"]
        if frame is not None:
            assert np.array_equal(frame[t], np.asarray(Image.open(io.BytesIO(ev["frame_jpeg"])).convert("RGB")))
        if "quality" in ev:
            assert per["video_quality"][t] == ev["quality"]
    # audio: each masked slot holds the MFCC frame of its 10 ms inside the span, values as stored
    src = row["audio_source_id"]
    frames = sorted((a for a in tables["audio"] if a["session_id"] == sid and a["source_id"] == src),
                    key=lambda a: (a["t_ns"], a["event_id"]))
    in_span = [a for a in frames if start <= a["t_ns"] < end]
    first_per_slot = {}
    for a in in_span:
        first_per_slot.setdefault((a["t_ns"] - start) // hop, a)
    mfcc = np.asarray(row["audio_mfcc"], dtype=np.float32)
    assert mfcc.shape == (round((end - start) / hop), 40)
    for j, masked in enumerate(row["audio_mask"]):
        a = first_per_slot.get(j)
        assert masked == (a is not None)
        if a is None:
            assert not mfcc[j].any() and row["audio_mfcc_event_id"][j] is None and not row["audio_voiced"][j]
        else:
            assert start + j * hop <= a["t_ns"] < start + (j + 1) * hop
            assert row["audio_mfcc_event_id"][j] == a["event_id"]
            assert np.array_equal(mfcc[j], np.asarray(a["mfcc"], dtype=np.float32))
            assert row["audio_voiced"][j] == bool(a["voiced"])
    for t, gap in enumerate(per["audio_gap"]):
        if gap and T == 1:  # no MFCC frame within +-40 ms of the tick: none in its 40 ms either
            assert not any(row["audio_mask"])
    # pdf: the blocks of the pages the timeline shows, each page on show (or starting within tolerance)
    src = row["pdf_source_id"]
    blocks = [b for b in tables["pdf"] if b["session_id"] == sid and b["source_id"] == src]
    want = []
    for t, e in enumerate(per["pdf_event_id"]):
        if e is None:
            continue
        named = next(b for b in blocks if b["event_id"] == e)
        tick_t = start + (ticks[t] - ticks[0]) * 40 * MS
        assert named["t_ns"] - tol["pdf"] <= tick_t and (named["end_t_ns"] is None or tick_t < named["end_t_ns"])
        page = sorted((b for b in blocks if b["t_ns"] == named["t_ns"]), key=lambda b: (b["block_index"], b["event_id"]))
        if page[0]["event_id"] not in [w["event_id"] for w in want]:
            want += page
    assert [b["event_id"] for b in row["pdf_blocks"]] == [b["event_id"] for b in want]
    assert [b["text"] for b in row["pdf_blocks"]] == [b["text"] for b in want]
    pages: dict[int, list[str]] = {}
    for b in want:
        pages.setdefault(b["t_ns"], []).append(b["text"])
    assert row["pdf_text"] == "\n\n".join("\n".join(p) for p in pages.values())
    # features: the stored vectors of the sample's events, joined by event id
    for m, g, ids in (("video", "frame", per["video_event_id"]), ("pdf", "roi", [b["event_id"] for b in want]),
                      ("audio", "frame", row["audio_mfcc_event_id"])):
        col = f"feat_{m}_{g}"
        if col not in row:
            continue
        exp = [f for e in dict.fromkeys(i for i in ids if i) for f in sorted(
            (f for f in tables["features"] if f["event_id"] == e and f["granularity"] == g and f["modality"] == m),
            key=lambda f: f["feature_id"])]
        assert row[f"{col}_event_id"] == [f["event_id"] for f in exp]
        assert len(row[col]) == len(exp)
        for got, f in zip(row[col], exp):
            assert np.array_equal(np.asarray(got, dtype=np.float32), np.asarray(f["vector"], dtype=np.float32))


def _rows_and_frames(batch):
    frames = column_numpy(batch, "video_frame") if "video_frame" in batch.schema.names else None
    rows = rows_of(batch.drop_columns(["video_frame"]) if frames is not None else batch)
    return rows, frames


def test_tick_samples_are_the_timeline_joined(out, tables):
    seen = Counter()
    n_features = 0
    for batch in out.aligned(features=True):
        rows, frames = _rows_and_frames(batch)
        assert frames.dtype == np.uint8 and frames.shape[1:] == (360, 640, 3)
        for i, row in enumerate(rows):
            _check_sample(row, frames[i][None], tables, out, 1)
            seen[row["session_id"]] += 1
            n_features += len(row["feat_video_frame_event_id"]) + len(row["feat_pdf_roi_event_id"])
    per_session = {s: len({k[2] for k in tables["records"] if k[0] == s}) for s in {k[0] for k in tables["records"]}}
    assert dict(seen) == per_session  # one sample per tick of every session
    assert n_features > 0
    gaps = sum(r["decision"] == "gap" for r in tables["records"].values() if r["modality"] == "audio")
    assert gaps > 0  # the timeline has audio gaps, so the gap checks above did run


def test_clip_samples_hold_their_ticks(out, tables):
    g = Geometry.of("clip", 1.0, 0.5, 25.0)
    n = 0
    for batch in out.aligned(unit="clip", clip_s=1.0, stride_s=0.5, features=["video/frame", "pdf/roi"]):
        rows, frames = _rows_and_frames(batch)
        for i, row in enumerate(rows):
            assert row["end_ns"] - row["start_ns"] == 1_000_000_000 and len(row["video_gap"]) == 25
            assert row["start_ns"] == row["sample_index"] * g.stride_ticks * 40 * MS
            _check_sample(row, frames[i], tables, out, 25)
            n += 1
    ticks = {s: len({k[2] for k in tables["records"] if k[0] == s}) for s in {k[0] for k in tables["records"]}}
    assert n == sum(g.n_samples(t) for t in ticks.values()) > 0


def test_sessions_time_range_and_modalities_select(out):
    batches = list(out.aligned(sessions=["sample-meeting"], time_range=(1_000_000_000, 2_000_000_000),
                               modalities=["audio"], decode=False))
    rows = [r for b in batches for r in rows_of(b)]
    assert [r["tick_index"] for r in rows] == list(range(25, 50))
    assert not any(c.startswith(("video", "pdf")) for c in batches[0].schema.names)


def test_mfcc_and_vectors_are_views_of_the_batch_buffers(out):
    import torch

    ctx = context(out, AlignedSpec.make(sessions=["sample-meeting"], features=["video/frame"], batch_size=16))
    block = next(iter_blocks(ctx))
    batch = to_batch(block, ctx)
    mfcc = column_numpy(batch, "audio_mfcc")
    buf = batch.column("audio_mfcc").storage.values.buffers()[1]
    assert mfcc.shape == (16, 4, 40) and mfcc.__array_interface__["data"][0] == buf.address
    samples = list(samples_of(block, ctx, tensor=torch.from_numpy))
    assert samples[3]["audio_mfcc"].data_ptr() == buf.address + 3 * 4 * 40 * 4  # no copy down to torch
    vecs = column_numpy(batch, "feat_video_frame")
    vbuf = batch.column("feat_video_frame").values.values.buffers()[1]
    with_vec = [i for i, v in enumerate(vecs) if len(v)]
    assert with_vec and vecs[with_vec[0]].__array_interface__["data"][0] >= vbuf.address
    assert np.shares_memory(samples[with_vec[0]]["feat_video_frame"].numpy(), vecs[with_vec[0]])
    assert samples[0]["video_frame"].shape == (360, 640, 3) and samples[0]["video_frame"].dtype == torch.uint8


def _key(s):
    return (s["session_id"], s["sample_index"], s["start_ns"], round(float(s["audio_mfcc"].sum()), 3),
            tuple(b["event_id"] for b in s["pdf_blocks"]), tuple(e or "" for e in s["video_event_id"]))


def test_two_ranks_of_two_workers_cover_every_sample_once(out):
    from torch.utils.data import DataLoader

    args = dict(unit="clip", clip_s=0.4, decode=False, chunk_s=1.0)  # items of 1 s: each session in several
    whole = out.torch_dataset(rank=0, world_size=1, **args)
    want = Counter(_key(s) for s in whole)
    assert sum(want.values()) == whole.num_samples and max(want.values()) == 1 and len(whole.ctx.items) >= 8
    got, per_shard = Counter(), []
    for rank in (0, 1):
        ds = out.torch_dataset(rank=rank, world_size=2, **args)
        loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn")
        mine = [_key(s) for s in loader]
        per_shard.append(len(mine))
        got.update(mine)
    assert got == want  # no duplicate, no gap, same content
    assert sum(per_shard) == sum(want.values()) and all(per_shard)


@pytest.mark.parametrize("even", ["drop", "pad"])
def test_even_shards_give_every_rank_the_same_batches(out, even):
    """For distributed training: 2 ranks x 2 workers, every worker the same number of samples, so every
    rank the same number of batches; ``drop`` leaves fewer than 4 samples out, ``pad`` repeats fewer than 4."""
    from torch.utils.data import DataLoader

    from modalign.pipeline.readers import collate

    args = dict(unit="clip", clip_s=0.4, decode=False, chunk_s=1.0)
    want = Counter((s["session_id"], s["sample_index"]) for s in out.torch_dataset(rank=0, world_size=1, **args))
    got, batches, samples = Counter(), [], []
    for rank in (0, 1):
        ds = out.torch_dataset(rank=rank, world_size=2, even=even, **args)
        loader = DataLoader(ds, batch_size=8, num_workers=2, collate_fn=collate, multiprocessing_context="spawn")
        mine = [b for b in loader]
        batches.append(len(mine))
        keys = [(sid, int(i)) for b in mine for sid, i in zip(b["session_id"], b["sample_index"])]
        samples.append(len(keys))
        got.update(keys)
    n = sum(want.values())
    assert batches[0] == batches[1] and samples[0] == samples[1]
    if even == "drop":
        assert samples[0] * 2 == n // 4 * 4 and max(got.values()) == 1 and not (got - want)
    else:
        assert samples[0] * 2 == -(-n // 4) * 4 and set(got) == set(want) and sum((got - want).values()) < 4
    with pytest.raises(ConfigError, match="even"):
        out.torch_dataset(even="spread")


def _seed_with_two_splits(sessions):
    return next(s for s in range(100) if all(assign_splits(sessions, [0.5, 0.5], s).values()))


def _norm(v):
    if isinstance(v, np.ndarray):
        return _norm(v.tolist())
    if isinstance(v, (list, tuple)):
        return [_norm(x) for x in v]
    if isinstance(v, dict):
        return {k: _norm(x) for k, x in v.items()}
    if isinstance(v, np.generic):
        return v.item()
    return v


def test_webdataset_export_reads_back_as_the_samples(out, tmp_path):
    import webdataset as wds

    sessions = sorted(out.snapshot.sessions)
    seed = _seed_with_two_splits(sessions)
    summary = export(out, "webdataset", tmp_path / "wds", clip_s=1.0, split="0.5,0.5", seed=seed,
                     samples_per_shard=3, features=["video/frame"])
    splits = summary["splits"]
    assert sorted(s for v in splits.values() for s in v["sessions"]) == sessions
    assert not set(splits["train"]["sessions"]) & set(splits["val"]["sessions"])
    assert json.loads((tmp_path / "wds" / "export.json").read_text()) == summary
    for name, info in splits.items():
        urls = [str(tmp_path / "wds" / f) for f in info["files"]]
        assert len(urls) == -(-info["samples"] // 3)
        got = list(wds.WebDataset(urls, shardshuffle=False).decode("rgb8")) if urls else []
        want = [(r, f) for b in out.aligned(unit="clip", clip_s=1.0, sessions=info["sessions"], features=["video/frame"])
                for r, f in zip(*_rows_and_frames(b))]
        assert len(got) == len(want) == info["samples"]
        for s, (row, frames) in zip(got, want):
            meta = s["json"]
            assert meta["session_id"] in info["sessions"]  # the split holds by session
            for k, v in meta.items():
                assert v == row[k], k
            assert np.array_equal(s["mfcc.npy"], np.asarray(row["audio_mfcc"], np.float32))
            assert s["mfcc_mask.npy"].tolist() == row["audio_mask"] and s["voiced.npy"].tolist() == row["audio_voiced"]
            vec = s["feat_video_frame.npy"]
            assert vec.shape == (len(row["feat_video_frame_event_id"]), 1280)
            assert np.array_equal(vec, np.asarray(row["feat_video_frame"], np.float32).reshape(vec.shape))
            for t, gap in enumerate(row["video_gap"]):
                assert (f"f{t:04d}.jpg" in s) == (not gap)
                if not gap:
                    assert np.array_equal(s[f"f{t:04d}.jpg"], frames[t])


def test_parquet_export_reads_back_as_the_samples(out, tmp_path):
    sessions = sorted(out.snapshot.sessions)
    seed = _seed_with_two_splits(sessions)
    summary = export(out, "parquet", tmp_path / "pq", clip_s=2.0, stride_s=1.0, split=[0.5, 0.5], seed=seed,
                     features=True)
    assert summary["splits"] == {
        n: {"sessions": s, "samples": summary["splits"][n]["samples"], "files": [f"{n}.parquet"]}
        for n, s in assign_splits(sessions, [0.5, 0.5], seed).items()}
    for name, info in summary["splits"].items():
        got = pq.read_table(tmp_path / "pq" / f"{name}.parquet").to_pylist()
        want = [r for b in out.aligned(unit="clip", clip_s=2.0, stride_s=1.0, sessions=info["sessions"],
                                       decode=False, features=True) for r in rows_of(plain_batch(b))]
        assert len(got) == len(want) == info["samples"] > 0
        assert got == want
        assert {r["session_id"] for r in got} <= set(info["sessions"])


def test_ray_data_gives_the_same_samples(out, ray_local):
    args = dict(unit="clip", clip_s=1.0, decode=False, features=True, chunk_s=2.0)
    ds = out.ray_dataset(**args)
    got = sorted((_norm(r) for r in ds.take_all()), key=lambda r: (r["session_id"], r["sample_index"]))
    want = [r for b in out.aligned(**args) for r in rows_of(plain_batch(b))]
    assert len(got) == len(want) > 0
    assert got == want


def test_hugging_face_gives_the_same_rows(out, tmp_path):
    args = dict(unit="clip", clip_s=1.0, features=["pdf/roi", "video/frame"])
    hf = out.hf_dataset(cache_dir=str(tmp_path / "hf"), **args)
    want = [r for b in out.aligned(decode=False, **args) for r in rows_of(plain_batch(b))]
    got = [_norm(r) for r in hf]
    assert len(got) == len(want) > 0
    assert got == want
    assert not any(isinstance(f, pa.MapType) for f in hf.data.schema.types)


def test_readme_training_examples_run_as_written(lineage_run, ray_local):
    """README "Training datasets": its Python examples, on this run's OUT."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = re.search(r"\n## Training datasets\n(.*?)\n## ", readme, re.S).group(1)
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 3
    scope: dict = {}

    def run(code):
        exec(compile(code.replace('"out"', repr(str(lineage_run.out))), "README.md", "exec"), scope)

    run(blocks[0])  # Arrow batches
    assert scope["frames"].shape[1:] == (50, 360, 640, 3) and scope["frames"].dtype == np.uint8
    assert scope["mfcc"].shape[1:] == (200, 40) and scope["mask"].shape[1:] == (200,)
    assert np.shares_memory(scope["mfcc"], column_numpy(scope["batch"], "audio_mfcc"))
    assert all(v.shape[1:] == (1280,) for v in scope["vectors"]) and len(scope["text"]) == len(scope["frames"])
    run(blocks[1])  # PyTorch
    assert tuple(scope["batch"]["video_frame"].shape) == (32, 360, 640, 3)
    assert tuple(scope["batch"]["audio_mfcc"].shape) == (32, 4, 40)
    run(blocks[2])  # Ray Data, Hugging Face
    n_clips = sum(b.num_rows for b in modalign.open(lineage_run.out).aligned(unit="clip", clip_s=2.0, decode=False))
    assert scope["rd"].count() == len(scope["hf"]) == n_clips > 0
    assert "feat_pdf_roi" in scope["hf"].column_names and "video_jpeg" in scope["hf"].column_names


def test_an_s3_out_gives_the_samples_of_the_local_one(lineage_run, out, monkeypatch, tmp_path):
    """OUT copied object for object to s3://bucket/prefix: the same samples, also from a spawned
    DataLoader worker (the plan travels with the store's layout, not with a path)."""
    from torch.utils.data import DataLoader

    from s3server import s3_server, use_aws_env

    with s3_server(tmp_path / "s3") as server:
        use_aws_env(monkeypatch, server)
        client = server.client()
        for p in sorted(lineage_run.out.rglob("*")):
            rel = p.relative_to(lineage_run.out)
            if p.is_file() and rel.parts[0] != "cache":  # the feature cache is no part of a commit
                client.upload_file(str(p), server.bucket, f"run/{rel.as_posix()}")
        s3out = modalign.open(f"s3://{server.bucket}/run")
        args = dict(unit="clip", clip_s=1.0, decode=False, features=True)
        got = [r for b in s3out.aligned(**args) for r in rows_of(b)]
        assert got == [r for b in out.aligned(**args) for r in rows_of(b)] and got
        args = dict(unit="clip", clip_s=2.0, decode=False, modalities=["audio", "pdf"])
        loader = DataLoader(s3out.torch_dataset(**args), batch_size=None, num_workers=1, multiprocessing_context="spawn")
        keys = [(s["session_id"], s["sample_index"], round(float(s["audio_mfcc"].sum()), 3)) for s in loader]
        assert keys == [(s["session_id"], s["sample_index"], round(float(s["audio_mfcc"].sum()), 3))
                        for s in out.torch_dataset(**args)] and keys


def test_the_export_command(out, lineage_run, tmp_path, capsys):
    from modalign.pipeline.cli import main

    sessions = sorted(out.snapshot.sessions)
    seed = _seed_with_two_splits(sessions)
    dest = tmp_path / "shards"
    assert main(["export", str(lineage_run.out), "--format", "webdataset", "--clip-s", "2", "--out", str(dest),
                 "--split", "0.5,0.5", "--seed", str(seed), "--modalities", "audio,pdf", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary == json.loads((dest / "export.json").read_text())
    assert {n: v["sessions"] for n, v in summary["splits"].items()} == assign_splits(sessions, [0.5, 0.5], seed)
    assert sorted(p.name for p in dest.glob("*.tar")) == sorted(f for v in summary["splits"].values() for f in v["files"])
    n = sum(b.num_rows for b in out.aligned(unit="clip", clip_s=2.0, modalities=["audio", "pdf"], decode=False))
    assert sum(v["samples"] for v in summary["splits"].values()) == n > 0
    # an export folder inside OUT is refused before anything is written
    assert main(["export", str(lineage_run.out), "--format", "parquet", "--clip-s", "2",
                 "--out", str(lineage_run.out / "shards")]) == 1
    assert "inside OUT" in capsys.readouterr().err and not (lineage_run.out / "shards").exists()
