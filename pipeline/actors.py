"""Ray actors wrapping the stage operators: ingest, align, embed.

The only module besides ``modalign.pipeline.runner`` that imports ``ray``. Each actor builds its
operators once and loads their models in its constructor (``warm``: the run's start-up, which
``run.json`` reports apart as ``timing.actors_ready_s``), and limits torch and tesseract to one
thread: Ray gives parallelism across actors, and oversubscribed BLAS threads only slow a
shared machine. Restart policies are explicit (Ray's default is at-most-once).

``ActorPool`` holds the ingest and embed actors: a run starts its own and kills it at the end;
a watch keeps one for its whole life, so its batches pay the model loads once.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray

from modalign.schemas.config import RunConfig


def _single_threaded(torch_too: bool = False) -> None:
    """One thread per actor for tesseract and OpenMP (and torch, which reads OMP_NUM_THREADS when
    it is first imported). ``torch_too``: import torch now and set its threads; only the embed
    actor does: an ingest actor never uses torch, and importing it would cost ~2 CPU s and
    ~170 MiB of RSS per actor."""
    os.environ["OMP_THREAD_LIMIT"] = "1"  # tesseract: its own threading is slower on few cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if torch_too:
        import torch

        torch.set_num_threads(1)


@ray.remote(max_restarts=2, max_task_retries=0)
class IngestActor:
    """Decodes and de-identifies sources; yields metadata and de-identified payload refs.

    Generator tasks are not retried by Ray (a retry would re-yield items already forwarded):
    the driver retries a source whose stream failed before its first item, and commits only
    the event files it was told of.
    """

    def __init__(self, config_json: str, out_root: str, key_store_dir: str,
                 warm: list[tuple[str, str]] = ()) -> None:
        from modalign.pipeline.worker import IngestWorker

        _single_threaded()
        self.worker = IngestWorker(RunConfig.model_validate_json(config_json), out_root, Path(key_store_dir))
        self.warm(warm)

    def ping(self) -> bool:
        """Answers once the actor is up (after a restart too)."""
        return True

    def pid(self) -> int:
        return os.getpid()

    def warm(self, chains: list[tuple[str, str]]) -> int:
        """Build the (modality, tenant) chains and set their operators up (models loaded) now;
        returns this process's id."""
        for modality, tenant in chains:
            for op in self.worker.chain(modality, tenant):
                op.ensure_setup()
        return os.getpid()

    def ranges(self, job: Any, parts: int) -> list:
        """The ranges ``job``'s source can be processed in by several actors ([]: whole); ``parts``:
        how many ingest actors there are (an audio stream is cut into at most that many)."""
        return self.worker.ranges(job, parts)

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

    def __init__(self, config_json: str, out_root: str, attempt: str, warm: list[str] = ()) -> None:
        from modalign.pipeline.embedding import Embedder

        _single_threaded(torch_too=True)
        self.embedder = Embedder(RunConfig.model_validate_json(config_json), out_root, attempt)
        self.embedder.load(list(warm))

    def pid(self) -> int:
        return os.getpid()

    def begin(self, attempt: str, warm: list[str] = ()) -> int:
        """Start a run (its attempt id, counts from zero) with the models of ``warm`` loaded;
        returns this process's id."""
        self.embedder.begin(attempt)
        self.embedder.load(list(warm))
        return os.getpid()

    def embed(self, modality: str, table: pa.Table, lineage: dict, part: int) -> dict:
        return self.embedder.embed(modality, table, lineage, part)

    def flush(self) -> dict:
        return self.embedder.flush()


@dataclass
class ActorPool:
    """The ingest actors and the embed actors of a run, or of a watch's whole life.

    ``ready`` starts the actors if there are none (their constructors load the models the
    run needs), or tells the running ones the new run's attempt and what it needs beyond
    what they loaded; it returns once every actor has answered. ``close`` kills them.
    ``embedder_for(i)`` is the embed actor that ingest actor ``i`` hands its payloads to.

    A run never starts on an actor that Ray restarted in an earlier run (its process id is not
    the one it started with): such an actor has fewer restarts left than its policy gives a run,
    so a long watch whose actors die now and then would fail a session at the third death over
    its whole life. It is replaced by a fresh one (its models loaded again) before the run.
    """

    ingest: list = field(default_factory=list)
    embedders: list = field(default_factory=list)
    runs: int = 0  # runs served so far
    pids: dict = field(default_factory=dict)  # (kind, slot) -> the process id the actor started with
    replaced: int = 0  # restarted actors replaced by fresh ones, over the pool's life

    def ready(self, config: RunConfig, out_root: str, key_store_dir: str, attempt: str, n_ingest: int,
              embed_options: dict, chains: list[tuple[str, str]], n_embed: int = 1) -> float:
        """Make the pool ready for a run; returns the seconds until every actor answered.

        A warm pool whose actors cannot answer any more (restarts used up in an earlier run of
        the watch) is replaced by a fresh one, once."""
        t = time.perf_counter()
        modalities = sorted({m for m, _tenant in chains})
        for fresh in (False, True):
            if not self.embedders:
                cfg_json = config.model_dump_json()
                self.ingest = [IngestActor.options(num_cpus=1).remote(cfg_json, out_root, key_store_dir, chains)
                               for _ in range(n_ingest)]
                self.embedders = [EmbedActor.options(**embed_options).remote(cfg_json, out_root, attempt, modalities)
                                  for _ in range(max(1, n_embed))]
            try:
                pids = self._answer(chains, attempt, modalities)
                self._renew(pids, config, out_root, key_store_dir, attempt, embed_options, chains, modalities)
                break
            except ray.exceptions.RayActorError:
                if fresh or self.runs == 0:  # a fresh pool that cannot start: the machine's problem
                    raise
                self.close()
        self.runs += 1
        return time.perf_counter() - t

    def _answer(self, chains: list, attempt: str, modalities: list[str]) -> dict:
        """Every actor warmed for the run; (kind, slot) -> its process id now."""
        pids = ray.get([a.warm.remote(chains) for a in self.ingest] +
                       [e.begin.remote(attempt, modalities) for e in self.embedders])
        slots = [("ingest", i) for i in range(len(self.ingest))] + [("embed", i) for i in range(len(self.embedders))]
        return dict(zip(slots, pids))

    def _renew(self, pids: dict, config: RunConfig, out_root: str, key_store_dir: str, attempt: str,
               embed_options: dict, chains: list, modalities: list[str]) -> None:
        """Replace the actors Ray restarted since they started (``pids``: their process ids now; see
        the class) with fresh ones."""
        stale = [slot for slot, pid in pids.items() if self.pids.get(slot, pid) != pid]
        if not stale:
            self.pids = pids  # (a fresh pool: what each actor started as)
            return
        cfg_json = config.model_dump_json()
        for kind, i in stale:
            group = self.ingest if kind == "ingest" else self.embedders
            ray.kill(group[i])
            group[i] = (IngestActor.options(num_cpus=1).remote(cfg_json, out_root, key_store_dir, chains)
                        if kind == "ingest" else
                        EmbedActor.options(**embed_options).remote(cfg_json, out_root, attempt, modalities))
        self.replaced += len(stale)
        self.pids = self._answer(chains, attempt, modalities)

    def embedder_for(self, ingest_index: int) -> Any:
        """The embed actor of ingest actor ``ingest_index``: the ingest actors in turn, so each embed
        actor serves as many (a source's payloads all go to one, which keeps its cache hits there)."""
        return self.embedders[ingest_index % len(self.embedders)]

    def actors(self) -> list:
        return [*self.ingest, *self.embedders]

    def close(self) -> None:
        for a in self.actors():
            ray.kill(a)
        self.ingest, self.embedders, self.pids = [], [], {}
