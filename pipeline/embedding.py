"""The embedding stage body: de-identified payload -> feature rows + cache entries.

Wrapped by ``modalign.pipeline.actors.EmbedActor``; Ray-free so tests run it in-process. One
feature cache per actor, persisted under ``OUT/cache`` so a re-run finds its features. On an
s3:// OUT the cache lives in the actor's memory only (``OutputLayout.cache_dir`` is None): it
still saves repeated content within a run, and a re-run recomputes its features.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from modalign.pipeline.layout import OutputLayout, with_lineage
from modalign.schemas.config import RunConfig
from modalign.schemas.tables import FeatureRow


def with_user_boxes(table: pa.Table, boxes: list[tuple[int, int, int, int]]) -> pa.Table:
    """``table`` with configured fixed regions added to every frame's ``face_boxes`` (roi list)."""
    extra = [{"x0": x0, "y0": y0, "x1": x1, "y1": y1, "score": 1.0} for x0, y0, x1, y1 in boxes]
    col = table.column("face_boxes")
    rois = pa.array([(b or []) + extra for b in col.to_pylist()], type=col.type)
    return table.set_column(table.schema.get_field_index("face_boxes"), "face_boxes", rois)


class Embedder:
    def __init__(self, config: RunConfig, out_root: Path | str, attempt: str) -> None:
        from modalign.operators.cache.store import FeatureCache

        self.config = config
        self.layout = OutputLayout.of(out_root, config.storage)  # a folder or s3://bucket/prefix
        self.attempt = attempt  # in every feature file name (``layout.attempt_of``)
        self.cache = FeatureCache(self.layout.cache_dir)
        self._ops: dict[str, Any] = {}

    def begin(self, attempt: str) -> None:
        """Start a run with this embedder (a warm actor serves a watch's every batch): its
        attempt id names the feature files and the hit/miss counts start from zero. The cache's
        key map is kept: the lease of OUT keeps every other writer of the cache out meanwhile."""
        self.attempt = attempt
        self.cache.reset_stats()

    def load(self, modalities: list[str]) -> None:
        """Build the operators of ``modalities`` and load their models now (start-up, not the first batch)."""
        for modality in modalities:
            op = self._op(modality)
            getattr(op, "load", op.ensure_setup)()  # an encoder's network; a statistic has none

    def _op(self, modality: str):
        if modality not in self._ops:
            from modalign.operators.embed.registry import build_operator

            self._ops[modality] = build_operator(modality, self.config.embed, cache=self.cache)
        return self._ops[modality]

    def embed(self, modality: str, table: pa.Table, lineage: dict, part: int) -> dict:
        """Embed one payload batch of a source; writes one feature file per granularity.

        Returns the rows per granularity and the files written (relative to OUT)."""
        if table.num_rows == 0:
            return {"rows": 0, "model_id": None, "granularities": {}, "files": []}
        started = time.perf_counter()  # a modality's first batch includes loading its model
        op = self._op(modality)
        if modality == "video" and self.config.embed.roi_boxes:
            table = with_user_boxes(table, self.config.embed.roi_boxes)
        feats = op.process(table)
        if feats.num_rows == 0:
            return {"rows": 0, "model_id": None, "granularities": {}, "files": []}
        model_id = feats.column("model_id")[0].as_py()
        lin = dict(lineage, operators=f"{lineage['operators']};{op.tag}", model_id=model_id)
        counts, files = {}, []
        for gran in sorted(set(feats.column("granularity").to_pylist())):
            sub = feats.filter(pc.equal(feats.column("granularity"), gran))
            out = with_lineage(sub.drop_columns(["model_id"]), lin, FeatureRow.schema())
            path = self.layout.features(model_id, gran, lineage["session_id"], lineage["source_id"], self.attempt,
                                        part)
            self.layout.write_table(path, out)  # sub has rows: always a file
            files.append(self.layout.relative(path))
            counts[gran] = sub.num_rows
        return {"rows": feats.num_rows, "model_id": model_id, "granularities": counts, "files": files,
                "modality": modality, "seconds": time.perf_counter() - started, "pid": os.getpid()}

    def flush(self) -> dict:
        """Persist new cache entries; returns hit/miss counts per granularity."""
        self.cache.flush()
        return self.cache.stats()
