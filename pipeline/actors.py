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
        self.worker = IngestWorker(RunConfig.model_validate_json(config_json), out_root, Path(key_store_dir))

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


ALIGNER_RESTARTS = 3


@ray.remote(max_restarts=ALIGNER_RESTARTS, max_task_retries=0)
class AlignerActor:
    """One per session: aligns the sources' event times and writes the timeline in parts as the
    watermarks advance, with a checkpoint after each (``modalign.pipeline.timeline``).

    Restarted by Ray, never retried by it: a restarted instance loads the last checkpoint and
    answers ``NEEDS_RESUME`` to every call until the driver replays its log of calls with
    ``resume`` (events it had not consumed are re-read from their parts in OUT).
    """

    def __init__(self, session_id: str, config_json: str, out_root: str, attempt: str,
                 expected_sources: list[str]) -> None:
        import warnings

        from modalign.pipeline.layout import OutputLayout
        from modalign.pipeline.timeline import TimelineWriter

        cfg = RunConfig.model_validate_json(config_json)
        with warnings.catch_warnings():  # deprecated in favour of nothing that says the same
            warnings.simplefilter("ignore")
            restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        self.timeline = TimelineWriter(session_id, cfg, OutputLayout.of(out_root, cfg.storage), attempt,
                                       expected_sources, restarted=restarted)

    def held(self) -> bool:
        """Whether this instance (a restarted one) waits for ``resume``; answers once it is up."""
        return self.timeline.held

    def pid(self) -> int:
        return os.getpid()

    def register(self, source_id: str, modality: str, lineage: dict, clock: Any) -> str | None:
        return self.timeline.register(source_id, modality, lineage, clock)

    def add(self, source_id: str, events: pa.Table, latency_ms: float = 0.0, seq: int | None = None) -> int | str:
        return self.timeline.add(source_id, events, latency_ms, seq)

    def observe_offsets(self, source_id: str, windows: list) -> int | str:
        return self.timeline.observe_offsets(source_id, windows)

    def finish_source(self, source_id: str, cut_short_at_ns: int | None = None) -> str | None:
        return self.timeline.finish_source(source_id, cut_short_at_ns)

    def resume(self, log: list[tuple]) -> dict:
        return self.timeline.resume(log)

    def finish(self) -> dict | str:
        """Decide the rest of the session and write its last part; returns counts and the files written."""
        return self.timeline.finish()


@ray.remote(max_restarts=2, max_task_retries=2)
class EmbedActor:
    """Embeds de-identified payload batches into the feature cache and feature files."""

    def __init__(self, config_json: str, out_root: str, attempt: str) -> None:
        from modalign.pipeline.embedding import Embedder

        _single_threaded()
        self.embedder = Embedder(RunConfig.model_validate_json(config_json), out_root, attempt)

    def embed(self, modality: str, table: pa.Table, lineage: dict, part: int) -> dict:
        return self.embedder.embed(modality, table, lineage, part)

    def flush(self) -> dict:
        return self.embedder.flush()
