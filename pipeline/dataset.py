"""Training samples from a committed OUT: the timeline joined once to frames, MFCC windows, slide text
and embeddings (``modalign.open(OUT).aligned(...)``).

Sits after the run, beside ``pipeline.outputs``: it reads only committed files (``Output.snapshot``),
session by session and, inside a session, time chunk by time chunk (``chunk_s`` of session time), so
memory is flat in the session's length. Every file's footer (row-group statistics of ``t_ns`` /
``tick_index``, ``source_id``, ``modality``, read once per process) says which chunks need it; a
chunk reads only the files of its sources that overlap it (a file spanning several chunks, like a
60 s ``records`` part, is read by each of them, filtered to the chunk). The join is Ray-free and torch-free (numpy and pyarrow); the readers built on
it (``pipeline.readers``: Ray Data, PyTorch, Hugging Face) and ``modalign export``
(``pipeline.export``) only hand its batches on.

A sample is one span of the session clock on the tick grid (``Geometry``): ``unit="tick"`` is one
tick ``[t_k, t_k+1)``; ``unit="clip"`` is ``clip_s`` of ticks every ``stride_s``. Columns (``T``
ticks per clip, ``F`` MFCC frames of ``hop_ms`` per span; a tick sample drops the ``T`` axis):

- ``session_id, sample_index, tick_index`` (first tick), ``start_ns, end_ns`` (session clock);
- per modality ``m`` (one source per modality and session: ``sources`` or the first id):
  ``m_source_id, m_source_version``, and from ``records`` per tick ``m_event_id``, ``m_residual_ns``
  (0 at a gap) and ``m_gap`` (the timeline's gap, never filled);
- video: ``video_frame`` uint8 ``(T,) H, W, 3`` (zeros at a gap; ``decode=False``: ``video_jpeg``,
  null at a gap), the de-identified frame the timeline matched to each tick;
- audio: ``audio_mfcc`` float32 ``(F, n_mfcc)``: slot ``j`` holds the MFCC frame whose ``t_ns``
  lies in ``[start + j*hop, start + (j+1)*hop)`` (the first, if a skewed clock puts two there),
  ``audio_mask`` (F,) True where a frame is, zeros elsewhere; ``audio_voiced`` (F,) and
  ``audio_mfcc_event_id`` (F,);
- pdf: ``pdf_blocks`` (list of structs: event_id, page_index, block_index, t_ns, end_t_ns, text,
  box, words) of the pages the timeline shows in the span, ``pdf_text`` their text;
- ``feat_<m>_<g>`` (list of float32 vectors) and ``feat_<m>_<g>_event_id`` for each feature stream
  asked for: the ``features`` rows of the sample's events (joined by ``event_id``);
- ``m_quality``: the matched events' ``quality`` struct, when the event tables have that column.

MFCC and vector columns are Arrow buffers made once per chunk; ``column_numpy`` (and the torch
reader's ``torch.from_numpy``) views them without a copy. Frames are decoded once per sample
straight into the batch's preallocated array, in threads (the decoder releases the GIL), by OpenCV where
it is checked to give Pillow's pixels (``_Decoder``), else by Pillow; the threads decode the next batch
while the caller uses this one (one batch ahead).
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import PurePath
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from modalign.operators.align.ticks import TickGrid
from modalign.pipeline.layout import safe_name
from modalign.schemas.errors import ConfigError
from modalign.schemas.tables import FeatureRow, MfccRow, RecordRow, TextBlockRow, VideoFrameRow
from modalign.schemas.units import NS_PER_MS, NS_PER_S

MODALITIES = ("video", "audio", "pdf")
EVENT_TABLES = {"video": VideoFrameRow, "audio": MfccRow, "pdf": TextBlockRow}
DEFAULT_CHUNK_S = 10.0  # session seconds per work item: the unit of sharding and of reading
FRAMES_PER_BATCH = 64  # default batch size in frames: 64 tick samples, or one clip of 64 ticks
_I64_MAX = np.iinfo(np.int64).max


# -- geometry: where samples lie on the tick grid (pure) -------------------------------------

@dataclass(frozen=True)
class Geometry:
    """Samples of ``clip_ticks`` ticks every ``stride_ticks`` on a ``tick_hz`` grid; MFCC slots of ``hop_ns``.

    Sample ``i`` covers ticks ``[i*stride, i*stride + clip)`` and the session-clock span
    ``[t(i*stride), t(i*stride + clip))``; only samples whose ticks all exist are made."""

    tick_hz: float
    clip_ticks: int = 1
    stride_ticks: int = 1
    hop_ns: int = 10 * NS_PER_MS

    @classmethod
    def of(cls, unit: str, clip_s: float | None, stride_s: float | None, tick_hz: float,
           hop_ms: float = 10.0) -> "Geometry":
        if unit == "tick":
            if clip_s is not None or stride_s is not None:
                raise ConfigError("unit='tick' takes no clip_s/stride_s (one sample per tick); use unit='clip'")
            return cls(tick_hz, 1, 1, int(round(hop_ms * NS_PER_MS)))
        if unit != "clip":
            raise ConfigError(f"unit must be 'tick' or 'clip', got {unit!r}")
        if clip_s is None or clip_s <= 0:
            raise ConfigError(f"unit='clip' needs clip_s > 0 (seconds), got {clip_s!r}")
        clip = int(round(clip_s * tick_hz))
        stride = int(round((clip_s if stride_s is None else stride_s) * tick_hz))
        if clip < 1 or stride < 1:
            raise ConfigError(f"clip_s={clip_s} and stride_s={stride_s} must each be at least one tick "
                              f"({1 / tick_hz:g} s at {tick_hz:g} ticks/s)")
        return cls(tick_hz, clip, stride, int(round(hop_ms * NS_PER_MS)))

    @property
    def grid(self) -> TickGrid:
        return TickGrid(self.tick_hz)

    @property
    def squeeze(self) -> bool:
        """One tick per sample: per-tick columns are scalars, frames are ``H, W, 3``."""
        return self.clip_ticks == 1

    @property
    def mfcc_frames(self) -> int:
        """MFCC slots per sample (``F``): the span's length in hops."""
        return max(1, int(round(self.clip_ticks * NS_PER_S / self.tick_hz / self.hop_ns)))

    def n_samples(self, n_ticks: int) -> int:
        """Samples of a session with ``n_ticks`` ticks (whole clips only)."""
        if n_ticks < self.clip_ticks:
            return 0
        return (n_ticks - self.clip_ticks) // self.stride_ticks + 1

    def first_ticks(self, first: int, stop: int) -> np.ndarray:
        return np.arange(first, stop, dtype=np.int64) * self.stride_ticks

    def spans(self, first: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """``(start_ns, end_ns)`` of samples ``[first, stop)``."""
        k0 = self.first_ticks(first, stop)
        g = self.grid
        return _tick_times(g, k0), _tick_times(g, k0 + self.clip_ticks)

    def in_range(self, n_ticks: int, time_range: tuple[int | None, int | None] | None) -> tuple[int, int]:
        """Samples ``[first, stop)`` of a session whose spans lie inside ``time_range`` (ns, either end open)."""
        n = self.n_samples(n_ticks)
        if time_range is None or n == 0:
            return 0, n
        lo, hi = time_range
        starts, ends = self.spans(0, n)
        first = 0 if lo is None else int(np.searchsorted(starts, lo, side="left"))
        stop = n if hi is None else int(np.searchsorted(ends, hi, side="right"))
        return first, max(first, stop)

    def mfcc_slots(self, starts: np.ndarray, t_ns: np.ndarray) -> np.ndarray:
        """``(len(starts), F)`` index into the sorted ``t_ns`` of the frame in each slot, -1 where none."""
        F = self.mfcc_frames
        lo = (starts[:, None] + np.arange(F, dtype=np.int64)[None, :] * self.hop_ns).ravel()
        pos = np.searchsorted(t_ns, lo, side="left")
        ok = pos < len(t_ns)
        ok[ok] = t_ns[pos[ok]] < lo[ok] + self.hop_ns
        return np.where(ok, pos, -1).reshape(len(starts), F)


def _tick_times(grid: TickGrid, k: np.ndarray) -> np.ndarray:
    return (k.astype(np.int64) * (NS_PER_S * grid.den)) // grid.num


# -- work items, shards and splits (pure) ------------------------------------------------------

@dataclass(frozen=True)
class WorkItem:
    """Samples ``[first, stop)`` of one session: the unit a reader, worker or rank takes whole."""

    session_id: str
    first: int
    stop: int


def plan_items(sessions: Sequence[tuple[str, int, int]], samples_per_item: int) -> list[WorkItem]:
    """``(session_id, first, stop)`` ranges cut into items of ``samples_per_item``, sessions in order."""
    items = []
    for sid, first, stop in sessions:
        for a in range(first, stop, max(1, samples_per_item)):
            items.append(WorkItem(sid, a, min(stop, a + samples_per_item)))
    return items


def shard_of(rank: int, world_size: int, worker_id: int, num_workers: int) -> tuple[int, int]:
    """(index, count) of one DataLoader worker of one rank among all of them."""
    if not (0 <= rank < world_size) or not (0 <= worker_id < num_workers):
        raise ConfigError(f"rank {rank} of {world_size}, worker {worker_id} of {num_workers}: out of range")
    return rank * num_workers + worker_id, world_size * num_workers


def shard_items(items: Sequence[WorkItem], index: int, count: int) -> list[WorkItem]:
    """Items ``index, index + count, ...``: every item in exactly one of the ``count`` shards."""
    return list(items[index::count])


EVEN_MODES = ("drop", "pad")


def even_shard_items(items: Sequence[WorkItem], index: int, count: int, mode: str) -> list[WorkItem]:
    """Shard ``index`` of ``count`` holding exactly as many samples as every other shard, for trainers
    that must see equal batch counts on every rank (DDP hangs at the end of an epoch otherwise).

    The samples, in item order, are cut into ``count`` contiguous stretches of ``T`` each, mapped back
    onto (parts of) the items: ``drop``: ``T = N // count``, the last ``N % count`` samples (fewer than
    ``count``) are left out; ``pad``: ``T = ceil(N / count)``, the last shard goes on from the first
    sample again, so fewer than ``count`` samples are seen twice. Every shard is contiguous in session
    time, so a shard reads few files."""
    if mode not in EVEN_MODES:
        raise ConfigError(f"even: one of {', '.join(EVEN_MODES)} or None, got {mode!r}")
    sizes = [i.stop - i.first for i in items]
    total = sum(sizes)
    if total == 0:
        return []
    per = total // count if mode == "drop" else -(-total // count)
    starts = np.cumsum([0, *sizes[:-1]])
    out: list[WorkItem] = []
    pos, end = index * per, (index + 1) * per
    while pos < end:
        g = pos % total
        k = int(np.searchsorted(starts, g, side="right")) - 1
        item, off = items[k], g - int(starts[k])
        take = min(sizes[k] - off, end - pos)
        out.append(WorkItem(item.session_id, item.first + off, item.first + off + take))
        pos += take
    return out


def split_names(n: int) -> list[str]:
    return {1: ["train"], 2: ["train", "val"], 3: ["train", "val", "test"]}.get(n, [f"split{i}" for i in range(n)])


def parse_split(text: str | Sequence[float] | None) -> list[float]:
    """``"0.9,0.1"`` -> fractions summing to 1 (a ConfigError otherwise)."""
    if text is None:
        return [1.0]
    vals = [float(x) for x in (text.split(",") if isinstance(text, str) else text)]
    if not vals or any(v < 0 for v in vals) or not math.isclose(sum(vals), 1.0, abs_tol=1e-6):
        raise ConfigError(f"--split takes fractions >= 0 summing to 1 (e.g. 0.9,0.1), got {text!r}")
    return vals


def split_of(session_id: str, fractions: Sequence[float], seed: int) -> int:
    """The split of one session: a keyed hash of (seed, session id) placed on the cumulative fractions.

    A function of the session alone, so a session never lands in two splits and adding sessions
    never moves one."""
    h = hashlib.sha256(f"{seed}\0{session_id}".encode()).digest()
    u = int.from_bytes(h[:8], "big") / 2.0**64
    acc = 0.0
    for i, f in enumerate(fractions):
        acc += f
        if u < acc:
            return i
    return max(i for i, f in enumerate(fractions) if f > 0)


def assign_splits(session_ids: Iterable[str], fractions: Sequence[float], seed: int) -> dict[str, list[str]]:
    """Split name -> sorted session ids."""
    names = split_names(len(fractions))
    out: dict[str, list[str]] = {n: [] for n in names}
    for sid in sorted(session_ids):
        out[names[split_of(sid, fractions, seed)]].append(sid)
    return out


# -- what to read -------------------------------------------------------------------------------

@dataclass(frozen=True)
class AlignedSpec:
    """The arguments of ``Output.aligned`` (see its docstring)."""

    unit: str = "tick"
    clip_s: float | None = None
    stride_s: float | None = None
    modalities: tuple[str, ...] = MODALITIES
    sessions: tuple[str, ...] | None = None
    time_range: tuple[int | None, int | None] | None = None
    decode: bool = True
    features: tuple[str, ...] = ()
    sources: tuple[tuple[str, str], ...] = ()  # (modality, source_id): which source fills a modality
    batch_size: int | None = None
    chunk_s: float = DEFAULT_CHUNK_S
    frame_size: tuple[int, int] | None = None  # (height, width): resize every frame (fixed shapes)
    decode_threads: int | None = None

    @classmethod
    def make(cls, unit: str = "tick", clip_s: float | None = None, stride_s: float | None = None,
             modalities: Iterable[str] | None = None, sessions: Iterable[str] | None = None,
             time_range: tuple[int | None, int | None] | None = None, decode: bool = True,
             features: bool | str | Iterable[str] | None = None, sources: dict[str, str] | None = None,
             batch_size: int | None = None, chunk_s: float = DEFAULT_CHUNK_S,
             frame_size: tuple[int, int] | None = None, decode_threads: int | None = None) -> "AlignedSpec":
        mods = tuple(MODALITIES if modalities is None else ([modalities] if isinstance(modalities, str) else modalities))
        bad = [m for m in mods if m not in MODALITIES]
        if bad or not mods:
            raise ConfigError(f"modalities must be some of {', '.join(MODALITIES)}, got {list(mods)}")
        if features is True:
            feats: tuple[str, ...] = ("*",)
        elif not features:
            feats = ()
        else:
            feats = (features,) if isinstance(features, str) else tuple(features)
        if chunk_s <= 0 or (batch_size is not None and batch_size < 1):
            raise ConfigError(f"chunk_s must be > 0 and batch_size >= 1, got {chunk_s}, {batch_size}")
        return cls(unit=unit, clip_s=clip_s, stride_s=stride_s, modalities=tuple(m for m in MODALITIES if m in mods),
                   sessions=None if sessions is None else tuple(sessions), time_range=time_range, decode=decode,
                   features=feats, sources=tuple(sorted((sources or {}).items())), batch_size=batch_size,
                   chunk_s=chunk_s, frame_size=None if frame_size is None else (int(frame_size[0]), int(frame_size[1])),
                   decode_threads=decode_threads)


@dataclass(frozen=True)
class FeatureStream:
    """One ``features`` stream a sample carries: vectors of one model and granularity of one modality."""

    modality: str
    granularity: str
    model_id: str
    dim: int

    @property
    def column(self) -> str:
        return f"feat_{self.modality}_{self.granularity}"


@dataclass(frozen=True)
class _File:
    """One committed Parquet file and what its footer says (row-group statistics)."""

    path: str
    schema: pa.Schema
    lo: int | None  # t_ns (tick_index for records) min
    hi: int | None  # t_ns max, end_t_ns max for pages (None: unbounded)
    source_id: str | None
    modality: str | None
    model_id: str | None
    granularity: str | None
    dim: int | None
    size: tuple[int, int] | None  # (height, width) of video frames


_STAT_COLUMNS = ("t_ns", "tick_index", "end_t_ns", "source_id", "modality", "model_id", "granularity", "dim",
                 "width", "height")


def _footer(path: str, fs: Any) -> _File:
    md = pq.read_metadata(path, filesystem=fs)
    stats: dict[str, list] = {}
    for r in range(md.num_row_groups):
        rg = md.row_group(r)
        for j in range(rg.num_columns):
            c = rg.column(j)
            if c.path_in_schema in _STAT_COLUMNS:
                s = c.statistics
                if s is None or not s.has_min_max:
                    stats.setdefault(c.path_in_schema, []).append(None if rg.num_rows else ())
                else:
                    stats.setdefault(c.path_in_schema, []).append((s.min, s.max, s.null_count))

    def rng(name):
        vals = stats.get(name)
        if not vals or any(v is None for v in vals):
            return None
        vals = [v for v in vals if v != ()]
        return (min(v[0] for v in vals), max(v[1] for v in vals), sum(v[2] for v in vals)) if vals else None

    def one(name):
        r = rng(name)
        return r[0] if r is not None and r[0] == r[1] else None

    time_col = "tick_index" if rng("tick_index") is not None else "t_ns"
    t = rng(time_col)
    hi = None if t is None else t[1]
    e = rng("end_t_ns")
    if "end_t_ns" in stats:  # pages: shown until end_t_ns, or to the end (null)
        hi = None if e is None or e[2] > 0 else max(e[1], hi if hi is not None else e[1])
    w, h = one("width"), one("height")
    return _File(path=path, schema=md.schema.to_arrow_schema(), lo=None if t is None else t[0], hi=hi,
                 source_id=one("source_id"), modality=one("modality"), model_id=one("model_id"),
                 granularity=one("granularity"), dim=one("dim"), size=(h, w) if w and h else None)


class _Footers:
    """Footers read once per process (a file's footer never changes: committed names are unique)."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        self._cache: dict[str, _File] = {}

    def __call__(self, path: str) -> _File:
        f = self._cache.get(path)
        if f is None:
            f = self._cache[path] = _footer(path, self.fs)
        return f


@dataclass
class Context:
    """What every item of one ``aligned`` call shares: the committed files per session, the run's
    alignment settings, the feature streams and the quality columns found. Plain data: it
    travels to Ray tasks and DataLoader workers as it is."""

    spec: AlignedSpec
    geometry: Geometry
    tolerance_ns: dict[str, int]
    n_mfcc: int
    root: str  # OUT's absolute folder, or bucket/prefix on ``layout.fs``
    layout: Any  # OUT's ``OutputLayout`` (its filesystem: None locally, S3 with the run's options)
    uri: str
    session_files: dict[str, list[str]]  # session -> committed files, relative to OUT
    n_ticks: dict[str, int]
    streams: tuple[FeatureStream, ...]
    quality: dict[str, pa.DataType]  # modality -> type of its events' quality column, where present
    items: list[WorkItem] = field(default_factory=list)
    frame_size: tuple[int, int] = (0, 0)  # (height, width) of gap-only blocks: the first video's frames
    _fs: Any = field(default=None, repr=False, compare=False)
    _footers: Any = field(default=None, repr=False, compare=False)
    unordered: set = field(default_factory=set, repr=False, compare=False)  # (modality, source) parts out of order

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_fs"] = state["_footers"] = None  # filesystems, clients and caches are made again where it runs
        state["layout"] = replace(self.layout)  # its fields only: not the cached store (a boto3 client)
        return state

    @property
    def fs(self) -> Any:
        if self._fs is None and self.layout.is_s3:
            self._fs = self.layout.fs
        return self._fs

    def footer(self, rel: str) -> _File:
        if self._footers is None:
            self._footers = _Footers(self.fs)
        return self._footers(self.path(rel))

    def path(self, rel: str) -> str:
        return str(PurePath(self.root) / rel)

    @property
    def samples_per_item(self) -> int:
        ticks = max(1, int(round(self.spec.chunk_s * self.geometry.tick_hz)))
        return max(1, -(-ticks // self.geometry.stride_ticks))

    @property
    def batch_size(self) -> int:
        if self.spec.batch_size:
            return self.spec.batch_size
        return max(1, FRAMES_PER_BATCH // self.geometry.clip_ticks)


def context(output: Any, spec: AlignedSpec) -> Context:
    """The plan of one ``aligned`` call over an ``Output``: footers of the records files (tick counts),
    one footer per feature stream folder, and the work items in session order."""
    cfg = output.run.get("config", {})
    align = cfg.get("align", {})
    audio = cfg.get("ingest", {}).get("audio", {})
    tick_hz = float(align.get("tick_hz", 25.0))
    tol = {m: int(round(float(v) * NS_PER_MS)) for m, v in align.get("tolerance_ms", {}).items()}
    geometry = Geometry.of(spec.unit, spec.clip_s, spec.stride_s, tick_hz, float(audio.get("hop_ms", 10.0)))
    snap = output.snapshot
    wanted = sorted(snap.sessions) if spec.sessions is None else list(spec.sessions)
    missing = [s for s in wanted if s not in snap.sessions]
    if missing:
        raise ConfigError(f"no session {', '.join(missing)} in {output.uri}; sessions: {', '.join(sorted(snap.sessions))}")
    ctx = Context(spec=spec, geometry=geometry, tolerance_ns=tol, n_mfcc=int(audio.get("n_mfcc", 40)),
                  root=str(output.root if output.layout.is_s3 else os.path.abspath(output.root)),
                  layout=output.layout, uri=output.uri,
                  session_files={s: sorted(snap.sessions[s]["files"]) for s in wanted}, n_ticks={},
                  streams=(), quality={}, _fs=output.filesystem)
    ctx.streams = _feature_streams(ctx, spec.features, snap)
    ctx.quality = _quality_types(ctx)
    ctx.frame_size = spec.frame_size or _first_frame_size(ctx)
    ranges = []
    for sid in wanted:
        recs = [ctx.footer(f) for f in _table_files(ctx.session_files[sid], RecordRow)]
        n = max((f.hi + 1 for f in recs if f.hi is not None), default=0)
        ctx.n_ticks[sid] = n
        ranges.append((sid, *geometry.in_range(n, spec.time_range)))
    ctx.items = plan_items(ranges, ctx.samples_per_item)
    return ctx


def _first_frame_size(ctx: Context) -> tuple[int, int]:
    if not ctx.spec.decode or "video" not in ctx.spec.modalities:
        return (0, 0)
    for files in ctx.session_files.values():
        for f in _table_files(files, VideoFrameRow):
            size = ctx.footer(f).size
            if size:
                return (int(size[0]), int(size[1]))
    return (0, 0)


def _table_files(files: Iterable[str], row: type) -> list[str]:
    prefix = row.PATH + "/"
    return [f for f in files if f.startswith(prefix) and f.endswith(".parquet")]


def _feature_streams(ctx: Context, wanted: tuple[str, ...], snap: Any) -> tuple[FeatureStream, ...]:
    if not wanted:
        return ()
    folders: dict[str, str] = {}  # features/MODEL/GRAN/ -> one file (of any session)
    for f in snap.under(FeatureRow.PATH):
        parts = f.split("/")
        if len(parts) >= 5 and f.endswith(".parquet"):
            folders.setdefault("/".join(parts[:3]), f)
    found: dict[tuple[str, str], list[FeatureStream]] = {}
    for folder, f in sorted(folders.items()):
        info = ctx.footer(f)
        if info.modality and info.model_id and info.granularity and info.dim:
            found.setdefault((info.modality, info.granularity), []).append(
                FeatureStream(info.modality, info.granularity, info.model_id, int(info.dim)))
    out = []
    keys = sorted(found) if "*" in wanted else []
    for w in wanted:
        if w == "*":
            continue
        parts = w.split("/", 2)
        if len(parts) < 2:
            raise ConfigError(f"features are named MODALITY/GRANULARITY[/MODEL_ID] (e.g. video/frame), got {w!r}")
        keys.append((parts[0], parts[1]))
    for key in dict.fromkeys(keys):
        cands = found.get(key, [])
        named = [w.split("/", 2)[2] for w in wanted if w.count("/") >= 2 and tuple(w.split("/", 2)[:2]) == key]
        if named:
            cands = [c for c in cands if c.model_id == named[0]]
        if not cands:
            have = ", ".join(f"{m}/{g} ({', '.join(c.model_id for c in v)})" for (m, g), v in sorted(found.items()))
            raise ConfigError(f"no features {'/'.join(key)} in {ctx.uri}; it holds: {have or 'none'}")
        if len(cands) > 1:
            raise ConfigError(f"features {'/'.join(key)} come from {len(cands)} models "
                              f"({', '.join(c.model_id for c in cands)}): name one as {'/'.join(key)}/MODEL_ID")
        out.append(cands[0])
    return tuple(out)


def _nullable(t: pa.DataType) -> pa.DataType:
    """``t`` with every nested field nullable (a gap's quality is a null struct: Parquet refuses nulls
    under fields declared non-nullable)."""
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, _nullable(f.type), True, f.metadata) for f in t])
    if pa.types.is_list(t):
        return pa.list_(pa.field(t.value_field.name, _nullable(t.value_type), True))
    return t


def _quality_types(ctx: Context) -> dict[str, pa.DataType]:
    """The type of each event table's ``quality`` column (every field nullable), where the declared
    schema or a file has one."""
    out: dict[str, pa.DataType] = {}
    for m in ctx.spec.modalities:
        row = EVENT_TABLES[m]
        declared = row.schema()
        if "quality" in declared.names:
            out[m] = _nullable(declared.field("quality").type)
            continue
        for files in ctx.session_files.values():
            fs = _table_files(files, row)
            if fs:
                schema = ctx.footer(fs[0]).schema
                if "quality" in schema.names:
                    out[m] = _nullable(schema.field("quality").type)
                break
    return out


# -- the join -----------------------------------------------------------------------------------

def _read(ctx: Context, rels: list[str], columns: list[str], flt: Any = None) -> pa.Table:
    import pyarrow.dataset as ds

    if not rels:
        return None
    infos = [ctx.footer(r) for r in rels]
    schema = pa.unify_schemas([i.schema for i in infos], promote_options="permissive")
    cols = [c for c in columns if c in schema.names]
    dataset = ds.dataset([i.path for i in infos], schema=schema, format="parquet", filesystem=ctx.fs)
    return dataset.to_table(columns=cols, filter=flt)


def _overlap(info: _File, lo: int, hi: int) -> bool:
    return (info.lo is None or info.lo <= hi) and (info.hi is None or info.hi >= lo)


def _ticks_table(ctx: Context, files: list[str], k_lo: int, k_hi: int) -> pa.Table:
    rels = [f for f in _table_files(files, RecordRow) if _overlap(ctx.footer(f), k_lo, k_hi - 1)]
    flt = (pc.field("tick_index") >= k_lo) & (pc.field("tick_index") < k_hi)
    return _read(ctx, rels, ["tick_index", "source_id", "source_version", "modality", "event_id", "residual_ns",
                             "decision"], flt)


@dataclass
class _Stream:
    """One modality's per-tick timeline over a chunk's ticks (index = tick - k_lo)."""

    source_id: str | None
    source_version: str | None
    event_id: pa.Array  # string, null at a gap
    residual_ns: np.ndarray
    gap: np.ndarray


def _streams(ctx: Context, recs: pa.Table | None, k_lo: int, n: int) -> dict[str, _Stream]:
    chosen = dict(ctx.spec.sources)
    out: dict[str, _Stream] = {}
    pairs = set()
    if recs is not None and recs.num_rows:
        pairs = set(zip(recs.column("modality").to_pylist(), recs.column("source_id").to_pylist()))
    for m in ctx.spec.modalities:
        ids = sorted(s for mod, s in pairs if mod == m)
        src = chosen.get(m, ids[0] if ids else None)
        gap = np.ones(n, dtype=bool)
        res = np.zeros(n, dtype=np.int64)
        if src is None or src not in ids:
            out[m] = _Stream(None, None, pa.nulls(n, pa.string()), res, gap)
            continue
        r = recs.filter(pc.equal(recs.column("source_id"), src))
        pos = _arr(r, "tick_index").to_numpy() - k_lo
        idx = np.full(n, -1, dtype=np.int64)
        idx[pos] = np.arange(len(pos))
        take = pa.array(idx, mask=idx < 0)
        matched = pc.fill_null(pc.equal(_arr(r, "decision").take(take), "matched"), False)
        gap = ~matched.to_numpy(zero_copy_only=False)
        res = pc.fill_null(_arr(r, "residual_ns").take(take), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        res[gap] = 0
        ev = pc.if_else(matched, _arr(r, "event_id").take(take), pa.nulls(n, pa.string()))
        out[m] = _Stream(src, _arr(r, "source_version")[0].as_py(), ev, res, gap)
    return out


def _arr(table: pa.Table, name: str) -> pa.Array:
    return table.column(name).combine_chunks()


_PART_NO = re.compile(r"-(\d+)\.parquet$")
# Modalities whose parts of one source follow each other in time (part order = decode order: frames and
# MFCC windows in presentation order, a video range's parts numbered after the previous range's). A PDF's
# pages may be scheduled in any order, so its parts are checked one by one.
ORDERED_PARTS = frozenset({"video", "audio"})
_ORDERED_MIN = 16  # fewer parts than this: read every footer


def _source_parts(ctx: Context, files: list[str], m: str, src: str, lo: int, hi: int) -> list[str]:
    """The committed event parts of source ``src`` whose time range overlaps ``[lo, hi]``.

    events/M/SESSION/SOURCE-ATTEMPT-PART.parquet: other sources' footers are never read. For a stream
    modality (``ORDERED_PARTS``) the parts in part order cover increasing times, so a binary search and
    a scan read the footers of O(log n) parts and the overlapping ones only (a 30 min video has 1,920
    parts; reading them all cost a first sample 3.7 s). Footers that break the order (an erasure never
    reorders parts, but an OUT written by another tool could) make it read every footer of the source."""
    prefix = safe_name(src) + "-"
    rels = [f for f in _table_files(files, EVENT_TABLES[m]) if f.rsplit("/", 1)[-1].startswith(prefix)]

    def hit(f: str) -> bool:
        info = ctx.footer(f)
        return info.source_id in (None, src) and _overlap(info, lo, hi)

    if m not in ORDERED_PARTS or len(rels) < _ORDERED_MIN or (m, src) in ctx.unordered:
        return [f for f in rels if hit(f)]
    numbered = sorted((int(x.group(1)), f) for f in rels if (x := _PART_NO.search(f)))
    parts = [f for _, f in numbered]
    if len(parts) != len(rels):
        ctx.unordered.add((m, src))
        return [f for f in rels if hit(f)]

    def ends_before(i: int) -> bool:  # part i ends before lo (false for an empty or unbounded part)
        info = ctx.footer(parts[i])
        return info.hi is not None and info.hi < lo

    first, last = 0, len(parts)
    while first < last:  # the first part that does not end before lo
        mid = (first + last) // 2
        if ends_before(mid):
            first = mid + 1
        else:
            last = mid
    out, prev = [], ctx.footer(parts[first - 1]) if first else None
    for f in parts[first:]:
        info = ctx.footer(f)
        if info.lo is None or info.hi is None or (prev is not None and prev.hi is not None and info.lo < prev.hi):
            ctx.unordered.add((m, src))  # not a clean time sequence: read every footer
            return [f for f in rels if hit(f)]
        if info.lo > hi:
            break
        if hit(f):
            out.append(f)
        prev = info
    return out


def _events(ctx: Context, files: list[str], m: str, src: str | None, lo: int, hi: int, columns: list[str],
            flt: Any = None) -> pa.Table | None:
    if src is None:
        return None
    rels = _source_parts(ctx, files, m, src, lo, hi)
    base = pc.field("source_id") == src
    t = _read(ctx, rels, columns + (["quality"] if m in ctx.quality else []), base if flt is None else base & flt)
    return t


def _index_in(ids: pa.Array, table: pa.Table | None) -> np.ndarray:
    """Row of each id in ``table`` (its event_id column), -1 for a null or absent id."""
    if table is None or table.num_rows == 0:
        return np.full(len(ids), -1, dtype=np.int64)
    idx = pc.index_in(ids, value_set=table.column("event_id").combine_chunks())
    return pc.fill_null(idx, -1).to_numpy(zero_copy_only=False).astype(np.int64)


def _per_tick(values: np.ndarray | pa.Array, rows: np.ndarray, T: int, squeeze: bool) -> Any:
    """Per-sample view of per-tick values: ``rows`` is (n, T) of chunk tick positions."""
    if isinstance(values, np.ndarray):
        v = values[rows]
        return v[:, 0] if squeeze else v
    flat = values.take(pa.array(rows.ravel()))
    return flat if squeeze else pa.FixedSizeListArray.from_arrays(flat, T)


def _fsl(arr: np.ndarray) -> pa.Array:
    """(n, ...) numpy -> a fixed-size-list column (one level per trailing axis), sharing numeric buffers."""
    a = pa.array(arr.reshape(-1))
    for size in reversed(arr.shape[1:]):
        a = pa.FixedSizeListArray.from_arrays(a, size)
    return a


def _col(arr: np.ndarray) -> pa.Array:
    return pa.array(arr) if arr.ndim == 1 else _fsl(arr)


@dataclass
class Block:
    """Samples of one item (or a slice of them): the Arrow columns and the numpy arrays they share."""

    columns: dict[str, pa.Array]
    views: dict[str, Any]  # name -> numpy array (n, ...) or (flat, offsets) for lists of vectors
    n: int
    frames: tuple[np.ndarray, np.ndarray] | None = None  # (video row per sample x tick, jpeg column) to decode

    def slice(self, a: int, b: int) -> "Block":
        cols = {k: v.slice(a, b - a) for k, v in self.columns.items()}
        views = {}
        for k, v in self.views.items():
            if isinstance(v, tuple):
                flat, off = v
                views[k] = (flat, off[a:b + 1])
            else:
                views[k] = v[a:b]
        frames = None if self.frames is None else (self.frames[0][a:b], self.frames[1])
        return Block(cols, views, b - a, frames)


def join_item(ctx: Context, item: WorkItem) -> Block:
    """Every column of samples ``[item.first, item.stop)`` of one session, frames still JPEG."""
    g = ctx.geometry
    T, F = g.clip_ticks, g.mfcc_frames
    sq = g.squeeze
    files = ctx.session_files[item.session_id]
    n = item.stop - item.first
    k0 = g.first_ticks(item.first, item.stop)
    starts, ends = g.spans(item.first, item.stop)
    k_lo, k_hi = int(k0[0]), int(k0[-1]) + T
    rows = (k0 - k_lo)[:, None] + np.arange(T, dtype=np.int64)[None, :]  # (n, T) chunk tick positions
    recs = _ticks_table(ctx, files, k_lo, k_hi)
    streams = _streams(ctx, recs, k_lo, k_hi - k_lo)
    cols: dict[str, pa.Array] = {
        "session_id": pa.array([item.session_id] * n, pa.string()),
        "sample_index": pa.array(np.arange(item.first, item.stop, dtype=np.int64)),
        "tick_index": pa.array(k0),
        "start_ns": pa.array(starts),
        "end_ns": pa.array(ends),
    }
    views: dict[str, Any] = {}
    frames = None
    t_lo, t_hi = int(starts[0]), int(ends[-1])
    wanted_events: dict[str, list[list[str]]] = {}  # modality -> per sample event ids (feature join)
    for m in ctx.spec.modalities:
        s = streams[m]
        tol = ctx.tolerance_ns.get(m, 0)
        cols[f"{m}_source_id"] = pa.array([s.source_id] * n, pa.string())
        cols[f"{m}_source_version"] = pa.array([s.source_version] * n, pa.string())
        cols[f"{m}_event_id"] = _per_tick(s.event_id, rows, T, sq)
        views[f"{m}_residual_ns"] = _per_tick(s.residual_ns, rows, T, sq)
        views[f"{m}_gap"] = _per_tick(s.gap, rows, T, sq)
        cols[f"{m}_residual_ns"] = _col(views[f"{m}_residual_ns"])
        cols[f"{m}_gap"] = _col(views[f"{m}_gap"])
        if m == "video":
            ids = s.event_id.filter(pc.is_valid(s.event_id)) if s.source_id else pa.array([], pa.string())
            table = _events(ctx, files, m, s.source_id, t_lo - tol, t_hi + tol,
                            ["event_id", "t_ns", "width", "height", "frame_jpeg"],
                            pc.field("event_id").isin(ids)) if len(ids) else None
            vrow = _index_in(s.event_id, table)[rows]  # (n, T)
            jpeg = table.column("frame_jpeg").combine_chunks() if table is not None else pa.array([], pa.binary())
            if ctx.spec.decode:
                frames = (vrow, jpeg)
            else:
                take = pa.array(vrow.ravel(), mask=vrow.ravel() < 0)
                flat = jpeg.take(take) if len(jpeg) else pa.nulls(n * T, pa.binary())
                cols["video_jpeg"] = flat if sq else pa.FixedSizeListArray.from_arrays(flat, T)
            _quality(ctx, cols, m, table, vrow, T, sq)
            wanted_events[m] = _ids_per_sample(s.event_id, rows)
        elif m == "audio":
            table = _events(ctx, files, m, s.source_id, t_lo - tol, t_hi + tol,
                            ["event_id", "t_ns", "mfcc", "voiced"],
                            (pc.field("t_ns") >= t_lo - tol) & (pc.field("t_ns") <= t_hi + tol))
            mfcc = np.zeros((n, F, ctx.n_mfcc), dtype=np.float32)
            mask = np.zeros((n, F), dtype=bool)
            voiced = np.zeros((n, F), dtype=bool)
            ev = pa.nulls(n * F, pa.string())
            if table is not None and table.num_rows:
                table = table.sort_by([("t_ns", "ascending"), ("event_id", "ascending")])
                t = table.column("t_ns").to_numpy()
                slot = g.mfcc_slots(starts, t)  # (n, F)
                mask = slot >= 0
                values = _mfcc_values(table.column("mfcc"), ctx.n_mfcc, item)
                mfcc[mask] = values[slot[mask]]
                voiced[mask] = pc.fill_null(table.column("voiced"), False).to_numpy(zero_copy_only=False)[slot[mask]]
                ev = table.column("event_id").combine_chunks().take(pa.array(slot.ravel(), mask=~mask.ravel()))
            views["audio_mfcc"], views["audio_mask"], views["audio_voiced"] = mfcc, mask, voiced
            cols["audio_mfcc"] = pa.FixedShapeTensorArray.from_numpy_ndarray(mfcc)
            cols["audio_mask"] = _fsl(mask)
            cols["audio_voiced"] = _fsl(voiced)
            cols["audio_mfcc_event_id"] = pa.FixedSizeListArray.from_arrays(ev, F)
            _quality(ctx, cols, m, table, _index_in(s.event_id, table)[rows], T, sq)
            wanted_events[m] = [[x for x in row if x is not None]
                                for row in np.asarray(ev.to_pylist(), dtype=object).reshape(n, F).tolist()]
        else:  # pdf
            _pages(ctx, cols, files, s, rows, n, t_lo - tol, t_hi + tol, wanted_events, T, sq)
    for stream in ctx.streams:
        _features(ctx, cols, views, files, stream, wanted_events.get(stream.modality), n, t_lo, t_hi)
    return Block(cols, views, n, frames)


def _mfcc_values(col: pa.ChunkedArray, n_mfcc: int, item: WorkItem) -> np.ndarray:
    arr = col.combine_chunks()
    lens = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
    if len(lens) and (lens.min() != n_mfcc or lens.max() != n_mfcc):
        raise ConfigError(f"session {item.session_id}: MFCC rows of {lens.min()}..{lens.max()} coefficients, "
                          f"the run's config says {n_mfcc}")
    return arr.flatten().to_numpy().reshape(-1, n_mfcc)


def _ids_per_sample(ids: pa.Array, rows: np.ndarray) -> list[list[str]]:
    py = ids.to_pylist()
    out = []
    for r in rows.tolist():
        seen = dict.fromkeys(py[k] for k in r if py[k] is not None)
        out.append(list(seen))
    return out


def _quality(ctx: Context, cols: dict, m: str, table: pa.Table | None, idx: np.ndarray, T: int, sq: bool) -> None:
    if m not in ctx.quality:
        return
    typ = ctx.quality[m]
    flat_idx = idx.ravel()
    if table is None or "quality" not in table.column_names or table.num_rows == 0:
        flat = pa.nulls(len(flat_idx), typ)
    else:
        flat = table.column("quality").combine_chunks().take(pa.array(flat_idx, mask=flat_idx < 0))
        if flat.type != typ:
            flat = flat.cast(typ)
    cols[f"{m}_quality"] = flat if sq else pa.FixedSizeListArray.from_arrays(flat, T)


_BLOCK_COLUMNS = ["event_id", "page_index", "block_index", "t_ns", "end_t_ns", "text", "box", "words"]


def _pages(ctx: Context, cols: dict, files: list[str], s: _Stream, rows: np.ndarray, n: int, lo: int, hi: int,
           wanted: dict, T: int, sq: bool) -> None:
    block_type = pa.struct([TextBlockRow.schema().field(c) for c in _BLOCK_COLUMNS])
    table = _events(ctx, files, "pdf", s.source_id, lo, hi, _BLOCK_COLUMNS) if s.source_id else None
    if table is None or table.num_rows == 0:
        cols["pdf_text"] = pa.array([""] * n, pa.string())
        cols["pdf_blocks"] = pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, np.int32)), pa.array([], block_type))
        wanted["pdf"] = [[] for _ in range(n)]
        if "pdf" in ctx.quality:
            _quality(ctx, cols, "pdf", None, np.full(rows.shape, -1), T, sq)
        return
    table = table.sort_by([("t_ns", "ascending"), ("block_index", "ascending"), ("event_id", "ascending")])
    page_t = table.column("t_ns").to_numpy()
    named = _index_in(s.event_id, table)  # per chunk tick: the row naming its page
    starts_of_page = {}  # page start t_ns -> (first row, stop row)
    uniq, first = np.unique(page_t, return_index=True)
    bounds = list(first) + [len(page_t)]
    for i, t in enumerate(uniq):
        starts_of_page[int(t)] = (int(bounds[i]), int(bounds[i + 1]))
    texts = table.column("text").to_pylist()
    block_ids = table.column("event_id").to_pylist()
    offsets = [0]
    take: list[int] = []
    sample_text: list[str] = []
    sample_ids: list[list[str]] = []
    for r in rows.tolist():
        pages = list(dict.fromkeys(int(page_t[named[k]]) for k in r if named[k] >= 0))
        blocks = [j for p in pages for j in range(*starts_of_page[p])]
        take.extend(blocks)
        offsets.append(len(take))
        sample_text.append("\n\n".join("\n".join(texts[j] for j in range(*starts_of_page[p])) for p in pages))
        sample_ids.append([block_ids[j] for j in blocks])
    struct = pa.StructArray.from_arrays([table.column(c).combine_chunks() for c in _BLOCK_COLUMNS],
                                        fields=list(block_type))
    cols["pdf_text"] = pa.array(sample_text, pa.string())
    cols["pdf_blocks"] = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), struct.take(pa.array(take, pa.int64())))
    wanted["pdf"] = sample_ids
    if "pdf" in ctx.quality:
        _quality(ctx, cols, "pdf", table, named[rows], T, sq)


def _features(ctx: Context, cols: dict, views: dict, files: list[str], stream: FeatureStream,
              wanted: list[list[str]] | None, n: int, t_lo: int, t_hi: int) -> None:
    prefix = f"{FeatureRow.PATH}/"
    rels = []
    for f in files:
        if f.startswith(prefix) and f.endswith(".parquet") and f.split("/")[2] == stream.granularity:
            info = ctx.footer(f)
            if info.model_id == stream.model_id and info.modality in (None, stream.modality):
                rels.append(f)
    wanted = wanted or [[] for _ in range(n)]
    ids = sorted({x for w in wanted for x in w})
    flat = np.zeros((0, stream.dim), dtype=np.float32)
    offsets = np.zeros(n + 1, dtype=np.int32)
    out_ids: list[str] = []
    if ids and rels:
        flt = pc.field("event_id").isin(pa.array(ids, pa.string())) & (pc.field("model_id") == stream.model_id) & (
            pc.field("granularity") == stream.granularity)
        table = _read(ctx, rels, ["event_id", "feature_id", "vector"], flt)
        if table is not None and table.num_rows:
            table = table.sort_by([("event_id", "ascending"), ("feature_id", "ascending")])
            vec = table.column("vector").combine_chunks()
            values = vec.flatten().to_numpy().reshape(-1, stream.dim)
            ev = table.column("event_id").to_pylist()
            by_event: dict[str, list[int]] = {}
            for j, e in enumerate(ev):
                by_event.setdefault(e, []).append(j)
            take = []
            for i, w in enumerate(wanted):
                for e in w:
                    take.extend(by_event.get(e, ()))
                offsets[i + 1] = len(take)
            flat = values[np.asarray(take, dtype=np.int64)] if take else flat
            out_ids = [ev[j] for j in take]
    views[stream.column] = (flat, offsets)
    inner = pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), stream.dim)
    cols[stream.column] = pa.ListArray.from_arrays(pa.array(offsets), inner)
    cols[f"{stream.column}_event_id"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(out_ids, pa.string()))


# -- frames ---------------------------------------------------------------------------------------

def _decode_pil(data: Any, size: tuple[int, int]) -> np.ndarray:
    """One JPEG as uint8 RGB ``size`` with Pillow: the reference decoder (webdataset, the tests)."""
    from PIL import Image

    h, w = size
    with Image.open(io.BytesIO(data)) as im:
        if im.mode != "RGB":  # (convert copies even to its own mode)
            im = im.convert("RGB")
        if (im.height, im.width) != (h, w):
            im = im.resize((w, h), Image.BILINEAR)
        return np.asarray(im)


class _Decoder:
    """JPEG -> uint8 RGB, by OpenCV's ``imdecode`` straight to RGB where it gives Pillow's pixels.

    Both link libjpeg-turbo (the same integer IDCT and fancy upsampling), so they agree pixel for
    pixel; OpenCV is about 1.4x faster per 360p frame and hands back an array without Pillow's
    ``tobytes`` copy (which alone costs about a third of Pillow's time). Whether they agree is not
    assumed: the first frame this process decodes is decoded both ways, and on any difference (another
    libjpeg build, say) every frame goes through Pillow. A frame OpenCV cannot read, of another size
    (Pillow resizes it) or not 3-channel also goes through Pillow."""

    def __init__(self) -> None:
        self.checked = False
        self.use_cv2 = False
        try:
            import cv2
        except ImportError:  # pragma: no cover - opencv-python-headless is a dependency
            self.checked = True
            return
        self._cv2 = cv2
        self._flag = getattr(cv2, "IMREAD_COLOR_RGB", None)
        if self._flag is None:  # OpenCV < 4.10
            self.checked = True

    def _cv(self, data: Any) -> np.ndarray | None:
        img = self._cv2.imdecode(np.frombuffer(data, np.uint8), self._flag)
        return img if img is not None and img.ndim == 3 and img.shape[2] == 3 else None

    def __call__(self, data: Any, size: tuple[int, int]) -> np.ndarray:
        if not self.checked:
            ref = _decode_pil(data, size)
            img = self._cv(data)
            self.use_cv2 = img is not None and img.shape == ref.shape and np.array_equal(img, ref)
            self.checked = True
            return ref
        if self.use_cv2:
            img = self._cv(data)
            if img is not None and img.shape[:2] == tuple(size):
                return img
        return _decode_pil(data, size)


_DECODER: _Decoder | None = None


def decoder() -> _Decoder:
    """The process's JPEG decoder (made, and its parity with Pillow checked, on first use)."""
    global _DECODER
    if _DECODER is None:
        _DECODER = _Decoder()
    return _DECODER


def decode_frames(block: Block, ctx: Context, pool: ThreadPoolExecutor | None = None) -> Callable[[], np.ndarray]:
    """Start decoding the block's frames into one uint8 array ``(n, [T,] H, W, 3)``, each JPEG once into
    its slot, on ``pool`` (in this thread without one); returns the function that waits for the array."""
    from PIL import Image

    vrow, jpeg = block.frames
    n, T = vrow.shape
    size = ctx.spec.frame_size
    if size is None:
        first = next((int(r) for r in vrow.ravel() if r >= 0), None)
        if first is not None:
            with Image.open(io.BytesIO(jpeg[first].as_buffer())) as im:
                size = (im.height, im.width)
        else:  # no frame in the block: the size of the dataset's video, (0, 0) if it has none
            size = ctx.frame_size
    h, w = size
    out = np.zeros((n, T, h, w, 3), dtype=np.uint8)
    jobs = [(i, t, int(r)) for i, row in enumerate(vrow.tolist()) for t, r in enumerate(row) if r >= 0]
    dec = decoder()
    if jobs and not dec.checked:  # the parity check, once, before any thread decodes
        i, t, r = jobs.pop(0)
        out[i, t] = dec(jpeg[r].as_buffer(), (h, w))

    def one(job: tuple[int, int, int]) -> None:
        i, t, r = job
        out[i, t] = dec(jpeg[r].as_buffer(), (h, w))

    futures = [pool.submit(one, j) for j in jobs] if pool is not None and len(jobs) > 1 else []
    if not futures:
        for j in jobs:
            one(j)

    def done() -> np.ndarray:
        for f in futures:
            f.result()
        return out[:, 0] if ctx.geometry.squeeze else out

    return done


def tensor_column(arr: np.ndarray) -> pa.Array:
    """(n, ...) numpy -> a fixed-shape tensor column sharing its buffer (an empty shape too)."""
    if arr.size:
        return pa.FixedShapeTensorArray.from_numpy_ndarray(arr)
    storage = pa.array([[]] * len(arr), pa.list_(pa.from_numpy_dtype(arr.dtype), 0))
    return pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(storage.type.value_type, list(arr.shape[1:])), storage)


def _threads(ctx: Context) -> int:
    if ctx.spec.decode_threads is not None:
        return max(0, ctx.spec.decode_threads)
    return min(4, os.cpu_count() or 1)


def iter_blocks(ctx: Context, items: Iterable[WorkItem] | None = None) -> Iterator[Block]:
    """Decoded blocks of ``batch_size`` samples over ``items``, in order."""
    threads = _threads(ctx) if ctx.spec.decode and "video" in ctx.spec.modalities else 0
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    pending: tuple[Block, Callable[[], np.ndarray]] | None = None  # decoding while the last block is used

    def ready(block: Block, frames: Callable[[], np.ndarray]) -> Block:
        block.views["video_frame"] = arr = frames()
        block.columns["video_frame"] = tensor_column(arr)
        block.frames = None
        return block

    try:
        for item in ctx.items if items is None else items:
            whole = join_item(ctx, item)
            bs = ctx.batch_size
            for a in range(0, whole.n, bs):
                block = whole.slice(a, min(whole.n, a + bs))
                if block.frames is None:
                    if pending is not None:
                        yield ready(*pending)
                        pending = None
                    yield block
                    continue
                started = (block, decode_frames(block, ctx, pool))  # the threads decode it ...
                if pending is not None:
                    yield ready(*pending)  # ... while the caller uses the block before it
                pending = started
        if pending is not None:
            yield ready(*pending)
    finally:
        if pool is not None:
            pool.shutdown()


def column_order(ctx: Context) -> list[str]:
    names = ["session_id", "sample_index", "tick_index", "start_ns", "end_ns"]
    for m in ctx.spec.modalities:
        names += [f"{m}_source_id", f"{m}_source_version", f"{m}_event_id", f"{m}_residual_ns", f"{m}_gap"]
        if m == "video":
            names.append("video_frame" if ctx.spec.decode else "video_jpeg")
        elif m == "audio":
            names += ["audio_mfcc", "audio_mask", "audio_voiced", "audio_mfcc_event_id"]
        else:
            names += ["pdf_text", "pdf_blocks"]
        if m in ctx.quality:
            names.append(f"{m}_quality")
    for s in ctx.streams:
        names += [s.column, f"{s.column}_event_id"]
    return names


def to_batch(block: Block, ctx: Context) -> pa.RecordBatch:
    names = column_order(ctx)
    meta = {"modalign.unit": ctx.spec.unit, "modalign.clip_ticks": str(ctx.geometry.clip_ticks),
            "modalign.stride_ticks": str(ctx.geometry.stride_ticks), "modalign.tick_hz": repr(ctx.geometry.tick_hz)}
    for s in ctx.streams:
        meta[f"modalign.{s.column}.model_id"] = s.model_id
    return pa.RecordBatch.from_arrays([block.columns[c] for c in names], names=names).replace_schema_metadata(meta)


def iter_batches(ctx: Context, items: Iterable[WorkItem] | None = None) -> Iterator[pa.RecordBatch]:
    for block in iter_blocks(ctx, ctx.items if items is None else items):
        yield to_batch(block, ctx)


def iter_samples(ctx: Context, items: Iterable[WorkItem] | None = None, tensor: Any = None) -> Iterator[dict]:
    """One dict per sample (``samples_of`` each block)."""
    for block in iter_blocks(ctx, ctx.items if items is None else items):
        yield from samples_of(block, ctx, tensor)


def samples_of(block: Block, ctx: Context, tensor: Any = None) -> Iterator[dict]:
    """The block's samples as dicts: arrays that are views of the block's buffers (the same memory
    as ``to_batch(block)``'s columns; ``tensor`` wraps each whole buffer once, e.g. ``torch.from_numpy``,
    and a sample gets an index into it, so consecutive samples are adjacent views of one buffer),
    Python numbers and strings, lists of dicts for text blocks."""
    wrap = tensor or (lambda a: a)
    names = column_order(ctx)
    py = {c: block.columns[c].to_pylist() for c in names if c not in block.views}
    arrays: dict[str, Any] = {}
    for c, v in block.views.items():
        if isinstance(v, tuple):
            arrays[c] = (wrap(v[0]), v[1])
        elif v.ndim == 1:  # one number per sample: a Python scalar
            arrays[c] = v.tolist()
        else:
            arrays[c] = wrap(v)
    for i in range(block.n):
        s: dict[str, Any] = {}
        for c in names:
            v = arrays.get(c)
            if v is None:
                s[c] = py[c][i]
            elif isinstance(v, tuple):
                flat, off = v
                s[c] = flat[int(off[i]):int(off[i + 1])]
            else:
                s[c] = v[i]
        yield s


def column_numpy(batch: pa.RecordBatch, name: str) -> np.ndarray | list[np.ndarray]:
    """A numeric column of an ``aligned`` batch as numpy without a copy: ``(n, ...)`` for tensors and
    fixed-size lists of numbers, one ``(k, dim)`` view per sample for lists of vectors. (Booleans are
    bit-packed in Arrow: those come as a copy.)"""
    col = batch.column(name)
    if isinstance(col.type, pa.FixedShapeTensorType):
        return col.to_numpy_ndarray()
    if pa.types.is_list(col.type) and pa.types.is_fixed_size_list(col.type.value_type):
        dim = col.type.value_type.list_size
        values = col.values.flatten().to_numpy().reshape(-1, dim)
        off = col.offsets.to_numpy()
        return [values[off[i]:off[i + 1]] for i in range(len(col))]
    shape = []
    t = col.type
    while pa.types.is_fixed_size_list(t):
        shape.append(t.list_size)
        t = t.value_type
    a = col
    for _ in shape:
        a = a.flatten()
    return a.to_numpy(zero_copy_only=not pa.types.is_boolean(t)).reshape(len(col), *shape)


def plain_batch(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The batch with each tensor column as nested fixed-size lists (one per axis), sharing its buffers:
    the form Parquet, Hugging Face datasets and Ray Data read without Arrow extension types."""
    cols = []
    for c in batch.schema.names:
        col = batch.column(c)
        if isinstance(col.type, pa.FixedShapeTensorType):
            a = col.storage.flatten()
            for size in reversed(col.type.shape):
                a = pa.FixedSizeListArray.from_arrays(a, size)
            col = a
        cols.append(col)
    return pa.RecordBatch.from_arrays(cols, names=batch.schema.names).replace_schema_metadata(batch.schema.metadata)


def rows_of(batch: pa.RecordBatch) -> list[dict]:
    """A batch as plain Python rows (numbers, strings, nested lists): what every reader must agree on."""
    out = batch.drop_columns([c for c in batch.schema.names if isinstance(batch.column(c).type, pa.FixedShapeTensorType)]
                             ).to_pylist()
    for c in batch.schema.names:
        col = batch.column(c)
        if isinstance(col.type, pa.FixedShapeTensorType):
            arr = col.to_numpy_ndarray().tolist()
            for r, v in zip(out, arr):
                r[c] = v
    names = batch.schema.names
    return [{c: r[c] for c in names} for r in out]


def with_spec(ctx: Context, **changes: Any) -> Context:
    return replace(ctx, spec=replace(ctx.spec, **changes))
