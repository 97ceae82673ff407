"""Identity of features: content-addressed cache keys, FAISS ids, and the feature row layout.

Sits between the embedding operators (``operators/embed``) and the feature cache/index
(``operators/cache``): an encoder asks for ``cache_key(...)`` before a forward pass, the
cache stores vectors under it, and every emitted feature row gets ``feature_id(...)``, the
int64 id it has in the FAISS index, so an index hit maps back to its row.

Invariants:
- ``cache_key`` is a sha256 hex digest over a canonical, versioned encoding of *every*
  input that changes a vector: content bytes (arrays with dtype and shape), model id
  (name + weights hash), granularity, resolution, crop box and normalisation. Any change
  in one of them changes the key; identical inputs give the same key in every process
  (no Python ``hash()``, no pickles, no dict order).
- ``feature_id`` is a positive 63-bit int (fits FAISS's int64 ids, never -1 or 0), stable
  across processes; it adds the event and box to the key, so two identical frames at
  different times are different rows sharing one cache entry.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from modalign.schemas.tables import Box, FeatureRow, LineageColumns

KEY_VERSION = 1
GRANULARITIES = ("frame", "roi", "patch")

_ID_MASK = (1 << 63) - 1


def _num(x: Any) -> float:
    """Canonical number: float, no negative zero, finite (so 3, 3.0 and np.int32(3) agree)."""
    v = float(x) + 0.0
    if not math.isfinite(v):
        raise ValueError(f"cache key fields must be finite numbers, got {x!r}")
    return v


def _content_digest(content: bytes | bytearray | memoryview | np.ndarray) -> dict[str, Any]:
    if isinstance(content, np.ndarray):
        if content.dtype.hasobject:
            raise TypeError("cache key content must be a numeric array, not an object array")
        arr = np.ascontiguousarray(content)
        digest = hashlib.sha256(arr.reshape(-1).view(np.uint8) if arr.size else b"").hexdigest()
        return {"kind": "ndarray", "dtype": arr.dtype.str, "shape": list(arr.shape), "sha256": digest}
    if isinstance(content, memoryview):
        raw: bytes | memoryview = content.cast("B") if content.c_contiguous else content.tobytes()
    elif isinstance(content, (bytes, bytearray)):
        raw = content
    else:
        raise TypeError(f"cache key content must be bytes, memoryview or ndarray, not {type(content).__name__}")
    return {"kind": "bytes", "sha256": hashlib.sha256(raw).hexdigest()}


def _resolution(resolution: tuple | list | int | None) -> list[float] | None:
    """An int ``r`` means a square ``r x r`` input; a tuple is (height, width) or any shape."""
    if resolution is None:
        return None
    if isinstance(resolution, (int, np.integer, float, np.floating)):
        return [_num(resolution), _num(resolution)]
    return [_num(v) for v in resolution]


def box_coords(box: Any) -> list[float] | None:
    """(x0, y0, x1, y1) of a ``Box``, a Box-shaped dict or a 4-sequence; the score is ignored."""
    if box is None:
        return None
    if isinstance(box, Box):
        return [_num(box.x0), _num(box.y0), _num(box.x1), _num(box.y1)]
    if isinstance(box, dict):
        return [_num(box["x0"]), _num(box["y0"]), _num(box["x1"]), _num(box["y1"])]
    vals = list(box)
    if len(vals) != 4:
        raise ValueError(f"a box has 4 coordinates (x0, y0, x1, y1), got {len(vals)}")
    return [_num(v) for v in vals]


def _check_granularity(granularity: str) -> str:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    return granularity


def _sha256_json(obj: Any) -> bytes:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).digest()


def cache_key(
    content: bytes | memoryview | np.ndarray,
    *,
    model_id: str,
    granularity: str,
    resolution: tuple | int | None,
    crop_box: tuple | None,
    normalisation: str,
) -> str:
    """sha256 hex of the content and every preprocessing parameter that shapes the vector."""
    record = {
        "v": KEY_VERSION,
        "content": _content_digest(content),
        "model_id": str(model_id),
        "granularity": _check_granularity(granularity),
        "resolution": _resolution(resolution),
        "crop_box": box_coords(crop_box),
        "normalisation": str(normalisation),
    }
    return _sha256_json(record).hex()


def feature_id(cache_key: str, event_id: str, granularity: str, box: Any) -> int:
    """Positive 63-bit FAISS id of one feature row (stable across processes and runs)."""
    digest = _sha256_json(
        {"v": KEY_VERSION, "key": cache_key, "event": str(event_id), "g": granularity, "box": box_coords(box)}
    )
    return (int.from_bytes(digest[:8], "big") & _ID_MASK) or 1


# -- the feature row layout operators emit (lineage columns are attached by the pipeline) --

_LINEAGE_ONLY = frozenset(LineageColumns.model_fields) - {"model_id"}


def feature_schema() -> pa.Schema:
    """``FeatureRow``'s schema without the lineage columns the pipeline adds, plus ``model_id``."""
    full = FeatureRow.schema()
    own = [f for f in full if f.name not in LineageColumns.model_fields]
    return pa.schema([*own, full.field("model_id")], metadata=full.metadata)


BOX_TYPE: pa.DataType = FeatureRow.schema().field("box").type


class FeatureRowsBuilder:
    """Accumulates feature rows column-wise and builds one ``feature_schema()`` table.

    Vectors are stored as float32 lists; ``feature_id`` is derived here so that every
    operator names its rows the same way.
    """

    def __init__(self) -> None:
        self._cols: dict[str, list[Any]] = {n: [] for n in feature_schema().names if n != "vector"}
        self._vectors: list[np.ndarray] = []

    def __len__(self) -> int:
        return len(self._vectors)

    def add(
        self,
        *,
        cache_key: str,
        granularity: str,
        modality: str,
        event_id: str,
        t_ns: int,
        box: dict[str, Any] | None,
        vector: np.ndarray,
        model_id: str,
    ) -> None:
        vec = np.asarray(vector, dtype=np.float32).reshape(-1)
        c = self._cols
        c["feature_id"].append(feature_id(cache_key, event_id, granularity, box))
        c["cache_key"].append(cache_key)
        c["granularity"].append(granularity)
        c["modality"].append(modality)
        c["event_id"].append(event_id)
        c["t_ns"].append(int(t_ns))
        c["box"].append(_box_struct(box))
        c["dim"].append(int(vec.shape[0]))
        c["model_id"].append(model_id)
        self._vectors.append(vec)

    def to_table(self) -> pa.Table:
        schema = feature_schema()
        if self._vectors:
            flat = np.concatenate(self._vectors)
            offsets = np.zeros(len(self._vectors) + 1, dtype=np.int32)
            np.cumsum([v.shape[0] for v in self._vectors], out=offsets[1:])
            vectors = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=pa.float32()))
        else:
            vectors = pa.array([], type=pa.list_(pa.float32()))
        arrays = []
        for f in schema:
            if f.name == "vector":
                arrays.append(vectors.cast(f.type))
            else:
                arrays.append(pa.array(self._cols[f.name], type=f.type))
        return pa.Table.from_arrays(arrays, schema=schema)


def _box_struct(box: Any) -> dict[str, Any] | None:
    if box is None:
        return None
    if isinstance(box, Box):
        return box.model_dump()
    if isinstance(box, dict):
        score = box.get("score")
        return {"x0": int(box["x0"]), "y0": int(box["y0"]), "x1": int(box["x1"]), "y1": int(box["y1"]),
                "score": 1.0 if score is None else float(score)}
    x0, y0, x1, y1 = (int(round(float(v))) for v in box)
    return {"x0": x0, "y0": y0, "x1": x1, "y1": y1, "score": 1.0}


def as_box_dicts(boxes: Iterable[Any] | None) -> list[dict[str, Any]]:
    """Normalise a list of boxes (``Box``, dict or 4-sequence) to Box-shaped dicts."""
    return [d for d in (_box_struct(b) for b in (boxes or [])) if d is not None]


def xyxy(box: dict[str, Any] | Sequence[float]) -> tuple[float, float, float, float]:
    """(x0, y0, x1, y1) floats of a Box-shaped dict or a 4-sequence."""
    c = box_coords(box)
    assert c is not None
    return c[0], c[1], c[2], c[3]
