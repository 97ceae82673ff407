"""Feature cache: content-addressed vectors at frame, roi and patch granularity.

Sits under the embedding operators: before a forward pass they look up the cache key of
their input (``modalign.operators.cache.keys.cache_key``); a hit skips the model, a patch-grid hit
lets frame and roi vectors be pooled without one. Re-running a pipeline over the same
de-identified inputs is therefore all hits with bit-identical vectors.

Two tiers:
- memory: an LRU bounded by ``lru_items`` entries and ``lru_bytes`` of vector data, per
  process (a 224 px EfficientNet patch grid is 7 x 7 x 1280 floats = 245 KiB, so the byte
  bound is the one that matters for grids);
- disk (when ``path`` is given): Parquet segments ``path/cache-<time>-<rand>.parquet`` with
  columns ``cache_key, granularity, model_id, dim, shape, vector, parent_key`` (``shape``
  restores a patch grid ``[gh, gw, C]``; ``vector`` is the flattened float32 data;
  ``parent_key`` is the patch-grid key a frame/roi vector was pooled from, or null).
  ``flush()`` writes the entries put since the last flush as new segments (patch grids
  in one, pooled vectors in another), atomically (temporary file, then rename), so
  concurrent writers (one per actor) never clobber each other and a reader never sees half
  a segment. Pending entries flush themselves past
  ``flush_items`` entries or ``flush_bytes`` of vector data.

Opening is lazy: the first lookup that misses memory reads the ``cache_key`` column of
every segment into a key -> (segment, row group, row) map; a row group's vectors (at most
~8 MiB; patch grids and pooled vectors are in separate segments, so a frame lookup never
decodes grids) are decoded when one of its keys is first read, and the last
``decoded_segments`` decoded row groups are kept. That is fine up to a
few million entries; beyond that a key-value store would replace the map (same API).
``refresh()`` picks up segments written by other processes.

Statistics count hits and misses per granularity. ``gc(referenced)`` rewrites segments
without the unreferenced entries, keeping the patch grids that referenced entries were
pooled from (their ``parent_key``): feature rows name frame and roi keys, and the grid
behind them is what lets a new roi (another box on the same frame) be pooled without a
forward pass. ``remove(keys)`` deletes given entries and nothing else (erasure).
``catalog()`` lists persisted entries without decoding vectors (``modalign cache stats``).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from modalign.operators.cache.keys import GRANULARITIES
from modalign.schemas.arrow import bool_mask
from modalign.schemas.files import atomic_write

SEGMENT_GLOB = "cache-*.parquet"
SEGMENT_SCHEMA = pa.schema(
    [
        pa.field("cache_key", pa.string(), nullable=False),
        pa.field("granularity", pa.string(), nullable=False),
        pa.field("model_id", pa.string(), nullable=False),
        pa.field("dim", pa.int32(), nullable=False, metadata={"doc": "number of float32 values"}),
        pa.field("shape", pa.list_(pa.int32()), nullable=False, metadata={"doc": "array shape, e.g. [gh, gw, C]"}),
        pa.field("vector", pa.list_(pa.float32()), nullable=False),
        pa.field("parent_key", pa.string(), nullable=True,
                 metadata={"doc": "patch-grid key this vector was pooled from; gc keeps it while this entry lives"}),
    ],
    metadata={"table": "feature_cache", "doc": "one cached feature array per content-addressed key"},
)


@dataclass(frozen=True)
class _Entry:
    granularity: str
    model_id: str
    vector: np.ndarray  # read-only float32
    parent: str | None = None


@dataclass
class _Segment:
    """A decoded segment: flat float32 values, per-row offsets and shapes."""

    values: np.ndarray
    offsets: np.ndarray
    shapes: list[tuple[int, ...]]
    granularity: list[str]
    model_id: list[str]
    parent: list[str | None]

    def entry(self, row: int) -> _Entry:
        v = self.values[self.offsets[row] : self.offsets[row + 1]].reshape(self.shapes[row])
        return _Entry(self.granularity[row], self.model_id[row], v, self.parent[row])


class FeatureCache:
    """Content-addressed feature store with an in-memory LRU and optional Parquet segments.

    ``path=None`` keeps everything in the LRU (entries beyond ``lru_items`` / ``lru_bytes``
    are lost). With a path, entries put are also pending until ``flush()`` (or until
    ``flush_items`` entries or ``flush_bytes`` are pending, when the cache flushes itself).
    """

    def __init__(self, path: Path | str | None = None, lru_items: int = 4096, *, lru_bytes: int = 256 << 20,
                 flush_items: int = 8192, flush_bytes: int = 64 << 20, decoded_segments: int = 4) -> None:
        if lru_items < 0 or lru_bytes < 0:
            raise ValueError("lru_items and lru_bytes must be >= 0")
        self.path = Path(path) if path is not None else None
        self.lru_items = lru_items
        self.lru_bytes = lru_bytes
        self.flush_items = flush_items
        self.flush_bytes = flush_bytes
        self._lru: OrderedDict[str, _Entry] = OrderedDict()
        self._lru_nbytes = 0
        self._pending_nbytes = 0
        self._pending: dict[str, _Entry] = {}
        self._index: dict[str, tuple[Path, int, int]] | None = None  # key -> (segment, row group, row); lazy
        self._decoded: OrderedDict[tuple[Path, int], _Segment] = OrderedDict()
        self._decoded_max = max(1, decoded_segments)
        self._hits: dict[str, int] = {g: 0 for g in GRANULARITIES}
        self._misses: dict[str, int] = {g: 0 for g in GRANULARITIES}
        self._lock = threading.RLock()
        if self.path is not None:
            self.path.mkdir(parents=True, exist_ok=True)

    # -- lookups ---------------------------------------------------------------------------

    def get(self, key: str, granularity: str | None = None) -> np.ndarray | None:
        """The cached array (read-only float32) or None; counts a hit/miss for ``granularity``.

        Without ``granularity`` a hit counts under the stored entry's granularity and a
        miss under ``"unknown"``.
        """
        entry = self._lookup(key)
        if entry is None:
            self.record(granularity or "unknown", hit=False)
            return None
        self.record(granularity or entry.granularity, hit=True)
        return entry.vector

    def peek(self, key: str) -> np.ndarray | None:
        """Like ``get`` without touching the statistics (the caller records the outcome)."""
        entry = self._lookup(key)
        return None if entry is None else entry.vector

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._lookup(key, promote=False) is not None

    def record(self, granularity: str, *, hit: bool, n: int = 1) -> None:
        """Count ``n`` hits or misses (e.g. a roi vector pooled from a cached patch grid is a hit)."""
        with self._lock:
            table = self._hits if hit else self._misses
            table[granularity] = table.get(granularity, 0) + n

    def _lookup(self, key: str, *, promote: bool = True) -> _Entry | None:
        with self._lock:
            entry = self._lru.get(key)
            if entry is not None:
                if promote:
                    self._lru.move_to_end(key)
                return entry
            entry = self._pending.get(key)
            if entry is None and self.path is not None:
                loc = self._ensure_index().get(key)
                if loc is not None:
                    entry = self._decode(loc[0], loc[1]).entry(loc[2])
            if entry is not None and promote:
                self._remember(key, entry)
            return entry

    # -- writes ----------------------------------------------------------------------------

    def put(self, key: str, granularity: str, vector: np.ndarray, *, model_id: str = "",
            parent: str | None = None) -> None:
        """Store a float32 array (any shape; a patch grid keeps its ``[gh, gw, C]`` shape).

        ``parent``: the key of the patch grid this vector was pooled from, if any (``gc``
        keeps that grid as long as this entry is referenced).
        """
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
        vec = np.array(vector, dtype=np.float32, copy=True, order="C")
        vec.setflags(write=False)
        entry = _Entry(granularity, model_id, vec, parent)
        flush_now = False
        with self._lock:
            self._remember(key, entry)
            if self.path is not None and not self._persisted(key):
                self._pending[key] = entry
                self._pending_nbytes += vec.nbytes
                flush_now = len(self._pending) >= self.flush_items or self._pending_nbytes >= self.flush_bytes
        if flush_now:
            self.flush()

    def _persisted(self, key: str) -> bool:
        return key in self._pending or key in self._ensure_index()

    def _remember(self, key: str, entry: _Entry) -> None:
        if self.lru_items == 0 or entry.vector.nbytes > self.lru_bytes:
            return
        old = self._lru.pop(key, None)
        if old is not None:
            self._lru_nbytes -= old.vector.nbytes
        self._lru[key] = entry
        self._lru_nbytes += entry.vector.nbytes
        while len(self._lru) > self.lru_items or self._lru_nbytes > self.lru_bytes:
            _, evicted = self._lru.popitem(last=False)
            self._lru_nbytes -= evicted.vector.nbytes

    def flush(self) -> int:
        """Write pending entries as new segments (atomic renames); returns entries written.

        Each segment holds one model's entries, patch grids apart from pooled vectors (reading
        a frame or roi vector never decodes grids), and at most one row group (~8 MiB of
        vectors, the unit a lookup decodes). So an erasure or a gc rewrites only the segments
        that hold what it removes, each at most one row group, not the whole cache.
        """
        with self._lock:
            if self.path is None or not self._pending:
                return 0
            index = self._ensure_index()
            kinds: dict[tuple[bool, str], list[str]] = {}
            for k, e in self._pending.items():
                kinds.setdefault((e.granularity == "patch", e.model_id), []).append(k)
            for _, keys in sorted(kinds.items()):
                per_segment = _rows_per_group(max(self._pending[k].vector.size for k in keys))
                for i in range(0, len(keys), per_segment):
                    chunk = keys[i:i + per_segment]
                    seg = _new_segment_path(self.path)
                    groups = _write_segment(seg, chunk, [self._pending[k] for k in chunk])
                    for k, loc in zip(chunk, _row_locations(groups)):
                        index.setdefault(k, (seg, *loc))
            n = len(self._pending)
            self._pending.clear()
            self._pending_nbytes = 0
            return n

    # -- maintenance -----------------------------------------------------------------------

    def refresh(self) -> None:
        """Forget the key map so that segments written by other processes become visible."""
        with self._lock:
            self._index = None
            self._decoded.clear()

    def keys(self, granularity: str | None = None) -> set[str]:
        """Every key held (memory-only entries included), optionally of one granularity."""
        with self._lock:
            out: dict[str, str] = {k: e.granularity for k, e in self._lru.items()}
            out.update({k: e.granularity for k, e in self._pending.items()})
            if self.path is not None:
                for seg in self._segments():
                    t = pq.read_table(seg, columns=["cache_key", "granularity"])
                    out.update(zip(t.column("cache_key").to_pylist(), t.column("granularity").to_pylist()))
            return {k for k, g in out.items() if granularity is None or g == granularity}

    def __len__(self) -> int:
        return len(self.keys())

    def catalog(self) -> pa.Table:
        """Persisted entries without their vectors: ``cache_key, granularity, model_id, dim,
        parent_key, segment`` (one row per key; a key written by two actors counts once)."""
        with self._lock:
            parts = []
            if self.path is not None:
                for seg in self._segments():
                    t = _read_segment(seg, columns=["cache_key", "granularity", "model_id", "dim", "parent_key"])
                    parts.append(t.append_column("segment", pa.array([seg.name] * t.num_rows, pa.string())))
            if not parts:
                names = ["cache_key", "granularity", "model_id", "dim", "parent_key"]
                fields = [*(SEGMENT_SCHEMA.field(n) for n in names), pa.field("segment", pa.string())]
                return pa.schema(fields).empty_table()
            table = pa.concat_tables(parts)
            keys = table.column("cache_key").to_pylist()
            first = list({k: i for i, k in reversed(list(enumerate(keys)))}.values())
            return table.take(pa.array(sorted(first), type=pa.int64())) if len(first) != len(keys) else table

    def gc(self, referenced_keys: set[str], *, keep_parents: bool = True) -> int:
        """Remove every entry whose key is not referenced; returns entries removed.

        With ``keep_parents`` the patch grids that referenced entries were pooled from
        (their ``parent_key``) are kept too.
        """
        keep = set(referenced_keys)
        if keep_parents:
            keep |= self._parents_of(keep)
        return self._drop(lambda k: k not in keep)

    def _parents_of(self, keys: set[str]) -> set[str]:
        with self._lock:
            found = {e.parent for k, e in [*self._lru.items(), *self._pending.items()] if k in keys and e.parent}
            if self.path is not None:
                cat = self.catalog()
                found |= {p for k, p in zip(cat.column("cache_key").to_pylist(), cat.column("parent_key").to_pylist())
                          if p and k in keys}
            return found

    def remove(self, keys: Iterable[str]) -> int:
        """Remove the given entries (e.g. an erasure request); returns entries removed."""
        doomed = set(keys)
        return self._drop(lambda k: k in doomed)

    def _drop(self, doomed: Callable[[str], bool]) -> int:
        with self._lock:
            removed: set[str] = set()
            for k in [k for k in self._lru if doomed(k)]:
                self._lru_nbytes -= self._lru.pop(k).vector.nbytes
                removed.add(k)
            for k in [k for k in self._pending if doomed(k)]:
                self._pending_nbytes -= self._pending.pop(k).vector.nbytes
                removed.add(k)
            if self.path is not None:
                for seg in self._segments():
                    keys = _read_segment(seg, columns=["cache_key"]).column("cache_key").to_pylist()
                    keep = [not doomed(k) for k in keys]
                    if all(keep):
                        continue  # read no vector of a segment that stays as it is
                    removed.update(k for k, kept in zip(keys, keep) if not kept)
                    table = _read_segment(seg)
                    if any(keep):
                        _atomic_write(_new_segment_path(seg.parent), table.filter(bool_mask(keep)))
                    seg.unlink()
                self.refresh()
            return len(removed)

    def stats(self) -> dict:
        """Hit/miss counts per granularity, hit rate, and entry counts per tier."""
        with self._lock:
            hits = {g: n for g, n in self._hits.items() if n or g in GRANULARITIES}
            misses = {g: n for g, n in self._misses.items() if n or g in GRANULARITIES}
            total_h, total_m = sum(hits.values()), sum(misses.values())
            return {
                "hits": hits,
                "misses": misses,
                "hit_rate": (total_h / (total_h + total_m)) if (total_h + total_m) else None,
                "memory_items": len(self._lru),
                "pending_items": len(self._pending),
                "persisted_items": len(self._ensure_index()) if self.path is not None else 0,
                "segments": len(self._segments()) if self.path is not None else 0,
            }

    def reset_stats(self) -> None:
        with self._lock:
            self._hits = {g: 0 for g in GRANULARITIES}
            self._misses = {g: 0 for g in GRANULARITIES}

    # -- segments --------------------------------------------------------------------------

    def _segments(self) -> list[Path]:
        assert self.path is not None
        return sorted(self.path.glob(SEGMENT_GLOB))

    def _ensure_index(self) -> dict[str, tuple[Path, int, int]]:
        if self._index is None:
            index: dict[str, tuple[Path, int, int]] = {}
            if self.path is not None:
                for seg in self._segments():
                    pf = pq.ParquetFile(seg)
                    keys = pf.read(columns=["cache_key"]).column("cache_key").to_pylist()
                    groups = [pf.metadata.row_group(i).num_rows for i in range(pf.metadata.num_row_groups)]
                    for k, loc in zip(keys, _row_locations(groups)):
                        index.setdefault(k, (seg, *loc))
            self._index = index
        return self._index

    def _decode(self, seg: Path, row_group: int) -> _Segment:
        unit = (seg, row_group)
        got = self._decoded.get(unit)
        if got is not None:
            self._decoded.move_to_end(unit)
            return got
        table = _read_segment(seg, row_group=row_group)
        vec = table.column("vector").combine_chunks()
        values = vec.values.to_numpy(zero_copy_only=False)
        offsets = vec.offsets.to_numpy(zero_copy_only=False) - vec.offsets[0].as_py()
        values = values[: offsets[-1]] if len(offsets) else values
        values.setflags(write=False)
        decoded = _Segment(
            values=values,
            offsets=offsets,
            shapes=[tuple(s) for s in table.column("shape").to_pylist()],
            granularity=table.column("granularity").to_pylist(),
            model_id=table.column("model_id").to_pylist(),
            parent=table.column("parent_key").to_pylist(),
        )
        self._decoded[unit] = decoded
        while len(self._decoded) > self._decoded_max:
            self._decoded.popitem(last=False)
        return decoded


ROW_GROUP_BYTES = 8 << 20


def merge_stats(stats: Iterable[dict]) -> dict:
    """The ``FeatureCache.stats`` of several processes sharing one cache folder (a run's embed
    actors) as one: hits, misses and in-memory counts summed, the hit rate of the sums; the folder's
    persisted entries and segments are the largest any of them saw (they count the same files)."""
    stats = list(stats)
    hits: dict[str, int] = {}
    misses: dict[str, int] = {}
    for st in stats:
        for g, n in st.get("hits", {}).items():
            hits[g] = hits.get(g, 0) + n
        for g, n in st.get("misses", {}).items():
            misses[g] = misses.get(g, 0) + n
    total_h, total_m = sum(hits.values()), sum(misses.values())
    return {
        "hits": hits,
        "misses": misses,
        "hit_rate": (total_h / (total_h + total_m)) if (total_h + total_m) else None,
        "memory_items": sum(st.get("memory_items", 0) for st in stats),
        "pending_items": sum(st.get("pending_items", 0) for st in stats),
        "persisted_items": max((st.get("persisted_items", 0) for st in stats), default=0),
        "segments": max((st.get("segments", 0) for st in stats), default=0),
    }


def _new_segment_path(folder: Path) -> Path:
    return folder / f"cache-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.parquet"


def _rows_per_group(widest_dim: int) -> int:
    """Rows of vectors of up to ``widest_dim`` float32 values in one ~``ROW_GROUP_BYTES`` row group."""
    return max(1, ROW_GROUP_BYTES // max(widest_dim * 4, 1))


def _row_locations(groups: list[int]) -> list[tuple[int, int]]:
    """(row group, row within it) of every row of a file with row groups of these sizes."""
    return [(g, r) for g, n in enumerate(groups) for r in range(n)]


def _write_segment(seg: Path, keys: list[str], entries: list[_Entry]) -> list[int]:
    """Write a segment; returns its row-group sizes."""
    flat = np.concatenate([e.vector.reshape(-1) for e in entries]) if entries else np.zeros(0, np.float32)
    offsets = np.zeros(len(entries) + 1, dtype=np.int32)
    np.cumsum([e.vector.size for e in entries], out=offsets[1:])
    table = pa.Table.from_arrays(
        [
            pa.array(keys, pa.string()),
            pa.array([e.granularity for e in entries], pa.string()),
            pa.array([e.model_id for e in entries], pa.string()),
            pa.array([e.vector.size for e in entries], pa.int32()),
            pa.array([list(e.vector.shape) for e in entries], pa.list_(pa.int32())),
            pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, pa.float32())),
            pa.array([e.parent for e in entries], pa.string()),
        ],
        schema=SEGMENT_SCHEMA,
    )
    return _atomic_write(seg, table)


def _read_segment(seg: Path, columns: list[str] | None = None, row_group: int | None = None) -> pa.Table:
    """A segment (or one row group of it) as ``SEGMENT_SCHEMA`` (or only ``columns`` of it,
    without reading the others); segments written before ``parent_key`` existed read it as null."""
    want = list(columns) if columns is not None else SEGMENT_SCHEMA.names
    pf = pq.ParquetFile(seg)
    present = set(pf.schema_arrow.names)
    cols = [c for c in want if c in present]
    table = pf.read(columns=cols) if row_group is None else pf.read_row_group(row_group, columns=cols)
    for name in want:
        if name not in present:
            field = SEGMENT_SCHEMA.field(name)
            table = table.append_column(field, pa.nulls(table.num_rows, field.type))
    return table.select(want).cast(pa.schema([SEGMENT_SCHEMA.field(n) for n in want], metadata=SEGMENT_SCHEMA.metadata))


def _atomic_write(dest: Path, table: pa.Table) -> list[int]:
    """Write a segment table atomically, in row groups of at most ~``ROW_GROUP_BYTES`` of
    vector data (the unit a lookup decodes); returns the row-group sizes."""
    rows = _rows_per_group(max(table.column("dim").to_pylist(), default=1))
    atomic_write(dest, lambda tmp: pq.write_table(table, tmp, compression="zstd", row_group_size=rows))
    meta = pq.read_metadata(dest)
    return [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
