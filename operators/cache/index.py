"""FAISS index of feature vectors, one per (model, granularity), with deletes for erasure.

Sits after the embedding operators and the feature cache: the pipeline adds every feature
row's ``feature_id`` (``modalign.operators.cache.keys.feature_id``) and vector, ``modalign search``
queries it, and ``modalign lineage erase`` removes ids. ``IndexIDMap2`` over an exact
flat index: inner product (``metric="ip"``, cosine on the L2-normalised vectors the
encoders write) or squared L2 (``metric="l2"``). HNSW would be faster at scale but cannot
remove ids, which erasure requires.

faiss-cpu by default; ``device="auto"`` or ``"cuda"`` moves the index to a GPU only when the
installed faiss has GPU support and a GPU exists (removal and saving go through a CPU
copy). ``faiss`` is imported lazily.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from modalign.operators.dependencies import require
from modalign.schemas.files import atomic_write

METRICS = ("ip", "l2")


def faiss_gpu_available() -> bool:
    """True when the installed faiss was built with GPU support and sees a GPU."""
    faiss = require("faiss")
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


class FeatureIndex:
    """Exact vector index keyed by int64 feature ids; ``add`` replaces ids already present."""

    def __init__(self, dim: int, metric: str = "ip", *, device: str = "cpu", _index: Any = None) -> None:
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
        if dim <= 0:
            raise ValueError("dim must be positive")
        faiss = require("faiss")
        self.dim = int(dim)
        self.metric = metric
        if _index is None:
            flat = faiss.IndexFlatIP(self.dim) if metric == "ip" else faiss.IndexFlatL2(self.dim)
            _index = faiss.IndexIDMap2(flat)
        self._cpu = _index
        self._gpu: Any = None
        self._gpu_res: Any = None
        if device not in ("cpu", "auto", "cuda"):
            raise ValueError("device must be cpu, auto or cuda")
        if device != "cpu" and faiss_gpu_available():
            self._gpu_res = faiss.StandardGpuResources()
            self._gpu = faiss.index_cpu_to_gpu(self._gpu_res, 0, self._cpu)

    @property
    def device(self) -> str:
        return "cuda" if self._gpu is not None else "cpu"

    @property
    def _active(self) -> Any:
        return self._gpu if self._gpu is not None else self._cpu

    def _sync_from_gpu(self) -> None:
        if self._gpu is not None:
            self._cpu = require("faiss").index_gpu_to_cpu(self._gpu)

    def _sync_to_gpu(self) -> None:
        if self._gpu is not None:
            self._gpu = require("faiss").index_cpu_to_gpu(self._gpu_res, 0, self._cpu)

    @property
    def ntotal(self) -> int:
        return int(self._active.ntotal)

    def __len__(self) -> int:
        return self.ntotal

    def ids(self) -> np.ndarray:
        """Every id held, in insertion order."""
        self._sync_from_gpu()
        return require("faiss").vector_to_array(self._cpu.id_map).astype(np.int64)

    def __contains__(self, feature_id: object) -> bool:
        return bool(np.isin(np.int64(feature_id), self.ids()))  # type: ignore[arg-type]

    def _vectors(self, vectors: np.ndarray) -> np.ndarray:
        v = np.ascontiguousarray(vectors, dtype=np.float32)
        if v.ndim == 1:
            v = v[None, :]
        if v.ndim != 2 or v.shape[1] != self.dim:
            raise ValueError(f"vectors must be (n, {self.dim}), got {v.shape}")
        return v

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        """Add (or replace) vectors under int64 ids; ids must be unique within the call."""
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        v = self._vectors(vectors)
        if len(ids) != len(v):
            raise ValueError(f"{len(ids)} ids for {len(v)} vectors")
        if len(np.unique(ids)) != len(ids):
            raise ValueError("ids must be unique within one add")
        if len(ids) == 0:
            return
        present = ids[np.isin(ids, self.ids())] if self.ntotal else ids[:0]
        if len(present):
            self.remove(present)
        self._active.add_with_ids(v, ids)

    def search(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids), each (n, k), best first; missing neighbours have id -1.

        Scores are inner products (cosine for unit vectors) for ``ip``, squared L2 for ``l2``.
        """
        v = self._vectors(vectors)
        if k <= 0:
            raise ValueError("k must be positive")
        scores, ids = self._active.search(v, int(k))
        return scores, ids.astype(np.int64)

    def reconstruct(self, feature_id: int) -> np.ndarray:
        """The stored vector of one id (KeyError if absent)."""
        self._sync_from_gpu()
        try:
            return self._cpu.reconstruct(int(feature_id))
        except RuntimeError as e:
            raise KeyError(feature_id) from e

    def remove(self, ids: np.ndarray) -> int:
        """Remove the given ids; returns how many were present."""
        faiss = require("faiss")
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) == 0 or self.ntotal == 0:
            return 0
        self._sync_from_gpu()
        n = int(self._cpu.remove_ids(faiss.IDSelectorBatch(ids)))
        self._sync_to_gpu()
        return n

    def save(self, path: Path | str) -> Path:
        """Write the index atomically (temporary file, then rename)."""
        faiss = require("faiss")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._sync_from_gpu()
        return atomic_write(path, lambda tmp: faiss.write_index(self._cpu, str(tmp)))

    def to_bytes(self) -> bytes:
        """The index as ``save`` writes it (``faiss.serialize_index``: the same bytes), for an
        object store."""
        faiss = require("faiss")
        self._sync_from_gpu()
        return faiss.serialize_index(self._cpu).tobytes()

    @classmethod
    def load(cls, path: Path | str, *, device: str = "cpu") -> "FeatureIndex":
        faiss = require("faiss")
        return cls._of(faiss.read_index(str(path)), device)

    @classmethod
    def from_bytes(cls, data: bytes, *, device: str = "cpu") -> "FeatureIndex":
        """An index from the bytes of a saved one (``to_bytes``, or a file's content)."""
        import numpy as np

        faiss = require("faiss")
        return cls._of(faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8)), device)

    @classmethod
    def _of(cls, index: Any, device: str) -> "FeatureIndex":
        faiss = require("faiss")
        metric = "ip" if index.metric_type == faiss.METRIC_INNER_PRODUCT else "l2"
        return cls(index.d, metric, device=device, _index=index)
