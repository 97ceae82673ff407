"""Ray actors wrapping the stage operators: ingest, align, embed.

The only module besides ``modalign.pipeline.runner`` that imports ``ray``. Each actor builds its
operators once (``setup`` loads models) and limits torch and tesseract to one thread:
Ray gives parallelism across actors, and oversubscribed BLAS threads only slow a
shared machine. Restart policies are explicit (Ray's default is at-most-once).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray

from modalign.schemas.config import RunConfig


def _single_threaded() -> None:
    os.environ["OMP_THREAD_LIMIT"] = "1"  # tesseract: its own threading is slower on few cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)


@ray.remote(max_restarts=2, max_task_retries=0)
class IngestActor:
    """Decodes and de-identifies sources; yields metadata and de-identified payload refs.

    Generator tasks are not retried by Ray (a retry would re-yield items already forwarded):
    the driver retries a source whose stream failed before its first item, and commits only
    the event files it was told of.
    """

    def __init__(self, config_json: str, out_root: str, key_store_dir: str) -> None:
        from modalign.pipeline.worker import IngestWorker

        _single_threaded()
        self.worker = IngestWorker(RunConfig.model_validate_json(config_json), Path(out_root), Path(key_store_dir))

    def ping(self) -> bool:
        """Answers once the actor is up (after a restart too)."""
        return True

    def ingest(self, job: Any):
        from dataclasses import replace

        from modalign.pipeline.items import EmbedItem

        for item in self.worker.ingest(job):
            if isinstance(item, EmbedItem):
                # The table is its own stream item (owned by the caller, not a ref nested in
                # one: ray #58080): the driver forwards that ref to the embedder unread.
                yield replace(item, table=None)
                yield item.table
            else:
                yield item


@ray.remote(max_restarts=0, max_task_retries=0)
class AlignerActor:
    """One per session: collects event times from all sources, then writes the timeline.

    Not restarted: a restarted aligner would have lost the events it held and would write
    a timeline full of false gaps; failing the run is the honest outcome until its state
    is checkpointed.
    """

    def __init__(self, session_id: str, config_json: str, out_root: str, attempt: str,
                 expected_sources: list[str]) -> None:
        from modalign.operators.align.aligner import TickAligner
        from modalign.pipeline.layout import OutputLayout

        self.cfg = RunConfig.model_validate_json(config_json)
        self.aligner = TickAligner(session_id, self.cfg.align, expected_sources=expected_sources)
        self.layout = OutputLayout(Path(out_root))
        self.session_id = session_id
        self.attempt = attempt

    def register(self, source_id: str, modality: str, lineage: dict, clock: Any) -> None:
        self.aligner.register(source_id, modality, lineage, clock)

    def add(self, source_id: str, events: pa.Table, latency_ms: float = 0.0) -> int:
        return self.aligner.add(source_id, events, latency_ms)

    def observe_offsets(self, source_id: str, windows: list) -> int:
        return self.aligner.observe_offsets(source_id, windows)

    def finish_source(self, source_id: str, cut_short_at_ns: int | None = None) -> None:
        if cut_short_at_ns is not None:
            self.aligner.expect_until(source_id, cut_short_at_ns)
        self.aligner.finish_source(source_id)

    def finish(self) -> dict:
        """Decide the rest of the session and write its tables; returns counts and the files written."""
        from modalign.pipeline.layout import write_jsonl, write_table

        res = self.aligner.finish()
        sid, lay, a = self.session_id, self.layout, self.attempt
        written = [write_table(lay.records(sid, a), res.records), write_table(lay.ctal(sid, a), res.ctal),
                   write_table(lay.ctal_summary(sid, a), res.summary),
                   write_table(lay.drift_alarms(sid, a), res.alarms)]
        if res.ctal.num_rows:
            written.append(write_jsonl(lay.ctal_jsonl(sid, a), res.ctal.to_pylist()))
        return dict(
            ticks=res.ticks, ctal_rows=res.ctal.num_rows, drift_alarms=res.alarms.num_rows,
            gaps=int(sum(r["gaps"] for r in res.summary.to_pylist())), summary=res.summary.to_pylist(),
            files=[lay.relative(p) for p in written if p.is_file()],
        )


@ray.remote(max_restarts=2, max_task_retries=2)
class EmbedActor:
    """Embeds de-identified payload batches into the feature cache and feature files."""

    def __init__(self, config_json: str, out_root: str, attempt: str) -> None:
        from modalign.pipeline.embedding import Embedder

        _single_threaded()
        self.embedder = Embedder(RunConfig.model_validate_json(config_json), Path(out_root), attempt)

    def embed(self, modality: str, table: pa.Table, lineage: dict, part: int) -> dict:
        return self.embedder.embed(modality, table, lineage, part)

    def flush(self) -> dict:
        return self.embedder.flush()
