"""Feature cache: content-addressed vectors at frame, roi and patch granularity.

Sits under the embedding operators: before a forward pass they look up the cache key of
their input (``operators.cache.keys.cache_key``); a hit skips the model, a patch-grid hit
lets frame and roi vectors be pooled without one. Re-running a pipeline over the same
de-identified inputs is therefore all hits with bit-identical vectors.

Two tiers:
- memory: an LRU of ``lru_items`` entries (key -> vector), per process;
- disk (when ``path`` is given): Parquet segments ``path/cache-<time>-<rand>.parquet`` with
  columns ``cache_key, granularity, model_id, dim, shape, vector`` (``shape`` restores a
  patch grid ``[gh, gw, C]``; ``vector`` is the flattened float32 data). ``flush()``
  writes the entries put since the last flush as one new segment, atomically (temporary
  file, then rename), so concurrent writers (one per actor) never clobber each other and a
  reader never sees half a segment.

Opening is lazy: the first lookup that misses memory reads the ``cache_key`` column of
every segment into a key -> (segment, row) map; a segment's vectors are decoded when one of
its keys is first read and the last few decoded segments are kept. That is fine up to a
few million entries; beyond that a key-value store would replace the map (same API).
``refresh()`` picks up segments written by other processes.

Statistics count hits and misses per granularity. ``gc(referenced)`` rewrites segments
without the unreferenced entries; ``remove(keys)`` deletes given entries (erasure).
"""

from __future__ import annotations

import os
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

from operators.cache.keys import GRANULARITIES

SEGMENT_GLOB = "cache-*.parquet"
SEGMENT_SCHEMA = pa.schema(
    [
        pa.field("cache_key", pa.string(), nullable=False),
        pa.field("granularity", pa.string(), nullable=False),
        pa.field("model_id", pa.string(), nullable=False),
        pa.field("dim", pa.int32(), nullable=False, metadata={"doc": "number of float32 values"}),
        pa.field("shape", pa.list_(pa.int32()), nullable=False, metadata={"doc": "array shape, e.g. [gh, gw, C]"}),
        pa.field("vector", pa.list_(pa.float32()), nullable=False),
    ],
    metadata={"table": "feature_cache", "doc": "one cached feature array per content-addressed key"},
)


@dataclass(frozen=True)
class _Entry:
    granularity: str
    model_id: str
    vector: np.ndarray  # read-only float32


@dataclass
class _Segment:
    """A decoded segment: flat float32 values, per-row offsets and shapes."""

    values: np.ndarray
    offsets: np.ndarray
    shapes: list[tuple[int, ...]]
    granularity: list[str]
    model_id: list[str]

    def entry(self, row: int) -> _Entry:
        v = self.values[self.offsets[row] : self.offsets[row + 1]].reshape(self.shapes[row])
        return _Entry(self.granularity[row], self.model_id[row], v)


class FeatureCache:
    """Content-addressed feature store with an in-memory LRU and optional Parquet segments.

    ``path=None`` keeps everything in the LRU (entries beyond ``lru_items`` are lost).
    With a path, entries put are also pending until ``flush()`` (or until
    ``flush_items`` are pending, when the cache flushes itself).
    """

    def __init__(self, path: Path | str | None = None, lru_items: int = 4096, *, flush_items: int = 8192,
                 decoded_segments: int = 4) -> None:
        if lru_items < 0:
            raise ValueError("lru_items must be >= 0")
        self.path = Path(path) if path is not None else None
        self.lru_items = lru_items
        self.flush_items = flush_items
        self._lru: OrderedDict[str, _Entry] = OrderedDict()
        self._pending: dict[str, _Entry] = {}
        self._index: dict[str, tuple[Path, int]] | None = None  # lazily built
        self._decoded: OrderedDict[Path, _Segment] = OrderedDict()
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
                    entry = self._decode(loc[0]).entry(loc[1])
            if entry is not None and promote:
                self._remember(key, entry)
            return entry

    # -- writes ----------------------------------------------------------------------------

    def put(self, key: str, granularity: str, vector: np.ndarray, *, model_id: str = "") -> None:
        """Store a float32 array (any shape; a patch grid keeps its ``[gh, gw, C]`` shape)."""
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
        vec = np.array(vector, dtype=np.float32, copy=True, order="C")
        vec.setflags(write=False)
        entry = _Entry(granularity, model_id, vec)
        flush_now = False
        with self._lock:
            self._remember(key, entry)
            if self.path is not None and not self._persisted(key):
                self._pending[key] = entry
                flush_now = len(self._pending) >= self.flush_items
        if flush_now:
            self.flush()

    def _persisted(self, key: str) -> bool:
        return key in self._pending or key in self._ensure_index()

    def _remember(self, key: str, entry: _Entry) -> None:
        if self.lru_items == 0:
            return
        self._lru[key] = entry
        self._lru.move_to_end(key)
        while len(self._lru) > self.lru_items:
            self._lru.popitem(last=False)

    def flush(self) -> int:
        """Write pending entries as one new segment (atomic rename); returns entries written."""
        with self._lock:
            if self.path is None or not self._pending:
                return 0
            keys = list(self._pending)
            entries = [self._pending[k] for k in keys]
            seg = self.path / f"cache-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.parquet"
            _write_segment(seg, keys, entries)
            index = self._ensure_index()
            for row, k in enumerate(keys):
                index.setdefault(k, (seg, row))
            self._pending.clear()
            return len(keys)

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

    def gc(self, referenced_keys: set[str]) -> int:
        """Remove every entry whose key is not in ``referenced_keys``; returns entries removed."""
        return self._drop(lambda k: k not in referenced_keys)

    def remove(self, keys: Iterable[str]) -> int:
        """Remove the given entries (e.g. an erasure request); returns entries removed."""
        doomed = set(keys)
        return self._drop(lambda k: k in doomed)

    def _drop(self, doomed: Callable[[str], bool]) -> int:
        with self._lock:
            removed: set[str] = set()
            for k in [k for k in self._lru if doomed(k)]:
                del self._lru[k]
                removed.add(k)
            for k in [k for k in self._pending if doomed(k)]:
                del self._pending[k]
                removed.add(k)
            if self.path is not None:
                for seg in self._segments():
                    table = pq.read_table(seg, schema=SEGMENT_SCHEMA)
                    keys = table.column("cache_key").to_pylist()
                    keep = [i for i, k in enumerate(keys) if not doomed(k)]
                    if len(keep) == len(keys):
                        continue
                    removed.update(k for k in keys if doomed(k))
                    if keep:
                        new = seg.with_name(f"cache-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.parquet")
                        _atomic_write(new, table.take(pa.array(keep, type=pa.int64())))
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

    def _ensure_index(self) -> dict[str, tuple[Path, int]]:
        if self._index is None:
            index: dict[str, tuple[Path, int]] = {}
            if self.path is not None:
                for seg in self._segments():
                    keys = pq.read_table(seg, columns=["cache_key"]).column("cache_key").to_pylist()
                    for row, k in enumerate(keys):
                        index.setdefault(k, (seg, row))
            self._index = index
        return self._index

    def _decode(self, seg: Path) -> _Segment:
        got = self._decoded.get(seg)
        if got is not None:
            self._decoded.move_to_end(seg)
            return got
        table = pq.read_table(seg, schema=SEGMENT_SCHEMA)
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
        )
        self._decoded[seg] = decoded
        while len(self._decoded) > self._decoded_max:
            self._decoded.popitem(last=False)
        return decoded


def _write_segment(seg: Path, keys: list[str], entries: list[_Entry]) -> None:
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
        ],
        schema=SEGMENT_SCHEMA,
    )
    _atomic_write(seg, table)


def _atomic_write(dest: Path, table: pa.Table) -> None:
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            tmp.unlink()
