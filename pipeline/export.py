"""``modalign export``: the aligned samples of a committed OUT as training shards, split by session.

Sits after the run, on ``pipeline.dataset``: sessions go to splits by a keyed hash of
(seed, session id) (``dataset.assign_splits``), so no session is in two splits and a session's split
never changes when sessions are added; then each split's samples are written as they are joined
(memory flat in the dataset's size):

- ``webdataset``: ``DIR/SPLIT-000000.tar`` ... (stdlib ``tarfile``), ``samples_per_shard`` samples
  each; per sample ``KEY.json`` (span, lineage ids, residuals, gaps, text blocks, quality),
  ``KEY.jpg`` (a tick) or ``KEY.fTTTT.jpg`` (tick ``TTTT`` of a clip; none at a gap: the JPEG bytes
  as stored, not re-encoded), ``KEY.mfcc.npy`` (F, n_mfcc) float32, ``KEY.mfcc_mask.npy`` and
  ``KEY.voiced.npy`` (F,) bool, ``KEY.feat_M_G.npy`` (k, dim) float32 per feature stream;
- ``parquet``: ``DIR/SPLIT.parquet``, one flat file per split (tensors as nested fixed-size lists).

``DIR/export.json`` lists the splits, their sessions, files and sample counts.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from modalign.pipeline.dataset import (AlignedSpec, assign_splits, column_numpy, context, iter_batches, parse_split,
                                       plain_batch)
from modalign.schemas.errors import ConfigError

FORMATS = ("webdataset", "parquet")
_KEY = re.compile(r"[^A-Za-z0-9_-]+")
# members written as .npy (the rest of a sample goes into its .json)
_NPY = {"audio_mfcc": "mfcc", "audio_mask": "mfcc_mask", "audio_voiced": "voiced"}


def sample_key(session_id: str, sample_index: int) -> str:
    """A WebDataset key (no dots: the first dot starts the member's extension)."""
    return f"{_KEY.sub('_', session_id)}__{sample_index:09d}"


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return buf.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = mtime
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def webdataset_members(batch: pa.RecordBatch, squeeze: bool) -> list[tuple[str, dict[str, bytes]]]:
    """(key, {extension: bytes}) per sample of a ``decode=False`` batch."""
    names = batch.schema.names
    feats = [c for c in names if c.startswith("feat_") and not c.endswith("_event_id")]
    arrays = {c: column_numpy(batch, c) for c in list(_NPY) + feats if c in names}
    skip = set(arrays) | {"video_jpeg"}
    meta = batch.select([c for c in names if c not in skip]).to_pylist()
    jpegs = batch.column("video_jpeg").to_pylist() if "video_jpeg" in names else None
    out = []
    for i, row in enumerate(meta):
        members: dict[str, bytes] = {"json": json.dumps(row, sort_keys=True).encode()}
        if jpegs is not None:
            if squeeze:
                if jpegs[i] is not None:
                    members["jpg"] = jpegs[i]
            else:
                for t, j in enumerate(jpegs[i]):
                    if j is not None:
                        members[f"f{t:04d}.jpg"] = j
        for c, arr in arrays.items():
            members[f"{_NPY.get(c, c)}.npy"] = _npy(arr[i])
        out.append((sample_key(row["session_id"], row["sample_index"]), members))
    return out


def export(output: Any, fmt: str, dest: str | Path, clip_s: float | None = None, stride_s: float | None = None,
           split: str | list[float] | None = None, seed: int = 0, samples_per_shard: int = 1000,
           progress: Any = None, **aligned: Any) -> dict:
    """Write the samples of ``output`` (a ``modalign.open`` Output) to ``dest``; returns what
    ``dest/export.json`` holds. ``clip_s`` None: one sample per tick."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if samples_per_shard < 1:
        raise ConfigError(f"samples per shard must be >= 1, got {samples_per_shard}")
    dest = Path(dest)
    out_root = Path(str(output.root)).resolve() if not output.uri.startswith("s3://") else None
    if out_root is not None and (dest.resolve() == out_root or out_root in dest.resolve().parents):
        raise ConfigError(f"the export folder {dest} lies inside OUT {output.uri}: choose a folder outside it")
    dest.mkdir(parents=True, exist_ok=True)
    fractions = parse_split(split)
    unit = "tick" if clip_s is None else "clip"
    sessions = aligned.pop("sessions", None)
    all_sessions = sorted(output.snapshot.sessions) if sessions is None else sorted(sessions)
    splits = assign_splits(all_sessions, fractions, seed)
    summary: dict[str, Any] = {"format": fmt, "source": output.uri, "commit": output.version, "unit": unit,
                               "clip_s": clip_s, "stride_s": stride_s, "seed": seed, "fractions": fractions,
                               "splits": {}}
    now = time.time()
    for name, sids in splits.items():
        files: list[str] = []
        count = 0
        if sids:
            spec = AlignedSpec.make(unit, clip_s, stride_s, sessions=sids, decode=False, **aligned)
            ctx = context(output, spec)
            if fmt == "parquet":
                path = dest / f"{name}.parquet"
                writer = None
                try:
                    for b in iter_batches(ctx):
                        b = plain_batch(b)
                        if writer is None:
                            writer = pq.ParquetWriter(str(path), b.schema, compression="zstd")
                        writer.write_batch(b)
                        count += b.num_rows
                finally:
                    if writer is not None:
                        writer.close()
                if writer is not None:
                    files.append(path.name)
            else:
                tar = None
                try:
                    for b in iter_batches(ctx):
                        for key, members in webdataset_members(b, ctx.geometry.squeeze):
                            if tar is None or count % samples_per_shard == 0:
                                if tar is not None:
                                    tar.close()
                                shard = dest / f"{name}-{len(files):06d}.tar"
                                files.append(shard.name)
                                tar = tarfile.open(shard, "w")
                            for ext, data in members.items():
                                _add(tar, f"{key}.{ext}", data, now)
                            count += 1
                finally:
                    if tar is not None:
                        tar.close()
        summary["splits"][name] = {"sessions": sids, "samples": count, "files": files}
        if progress:
            progress(f"{name}: {count} samples from {len(sids)} session(s) -> {', '.join(files) or 'no file'}")
    (dest / "export.json").write_text(json.dumps(summary, indent=2))
    return summary
