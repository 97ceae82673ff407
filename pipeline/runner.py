"""``modalign run``: the batch job on local Ray or a cluster.

Discovery validates every manifest first (a bad one stops the run before any work).
Then, per source, an ingest actor streams de-identified items back: metadata goes to the
session's aligner actor, payload refs to the embed actor (at most ``max_in_flight``
pending per ingest stream, so memory stays bounded), quarantine and lineage rows to the
driver. At the end the aligners write the timeline and CTAL log, the FAISS indexes are
built from the feature files, and ``run.json`` records the counts.
"""

from __future__ import annotations

import logging
import platform
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any, Callable

from modalign.operators.modalities import PLANS
from modalign.pipeline.discovery import Session, discover
from modalign.pipeline.items import (ClockItem, DoneItem, EmbedItem, FaultItem, Item, MetaItem, QuarantineItem,
                                     SourceItem, SourceJob)
from modalign.pipeline.layout import OutputLayout, check_writable, write_json, write_table
from modalign.pipeline.worker import lineage_row, source_lineage
from modalign.schemas.arrow import rows_to_table
from modalign.schemas.config import RunConfig
from modalign.schemas.environment import key_store_dir, ray_temp_dir
from modalign.schemas.errors import ConfigError, EnvironmentFaultError, InputError, QuarantineReason
from modalign.schemas.files import stat_version
from modalign.schemas.tables import LineageColumns, QuarantineRow, SourceLineageRow

log = logging.getLogger("modalign")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_QUARANTINED = 3  # the run completed, some inputs (or ranges) were quarantined

# Packages whose versions run.json records; alternatives are distributions of one module
# (the GPU image swaps faiss-cpu for faiss-gpu).
VERSIONED_PACKAGES: dict[str, tuple[str, ...]] = {
    "ray": ("ray",), "torch": ("torch",), "pyarrow": ("pyarrow",), "av": ("av",),
    "faiss": ("faiss-cpu", "faiss-gpu", "faiss-gpu-cu12", "faiss"),
}


def package_version(*distributions: str) -> str | None:
    """Version of the first installed distribution of ``distributions`` (None: none is)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in distributions:
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


@dataclass
class _SessionState:
    session: Session
    aligner: Any
    quarantine: list[QuarantineRow] = field(default_factory=list)
    lineage: list[SourceLineageRow] = field(default_factory=list)


@dataclass
class _SourceStream:
    """State of one source's ingest stream on the driver."""

    job: SourceJob
    started: float
    events: int = 0
    part: int = 0
    pending: list = field(default_factory=list)
    done: DoneItem | None = None
    clock: ClockItem | None = None
    lineage: LineageColumns | None = None


class Runner:
    def __init__(self, config: RunConfig, out: Path, progress: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.out = Path(out).absolute()  # workers run in other folders (and on other nodes)
        self.layout = OutputLayout(self.out)
        self.progress = progress or (lambda msg: log.info(msg))
        self.key_store = key_store_dir(config.key_store).absolute()
        if self.key_store.resolve().is_relative_to(self.out.resolve()):
            raise ConfigError(f"key_store {self.key_store} is inside the output folder {self.out}; pseudonym keys "
                              "are never outputs: set key_store (or $MODALIGN_KEY_STORE) to a folder outside it")
        self.run_id = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._stop = threading.Event()  # set when the run must stop (an environment fault)
        self.counts: Counter = Counter()

    # -- Ray ---------------------------------------------------------------------------
    def _init_ray(self) -> int:
        import os

        import ray

        rt = self.config.runtime
        if ray.is_initialized():
            return int(ray.cluster_resources().get("CPU", 1))
        if rt.address:
            ray.init(address=rt.address, log_to_driver=False)
        else:
            ray.init(num_cpus=rt.num_cpus or os.cpu_count() or 2, include_dashboard=False, log_to_driver=False,
                     configure_logging=False, _temp_dir=str(ray_temp_dir(rt.ray_temp_dir)))
        return int(ray.cluster_resources().get("CPU", 1))

    # -- the run -----------------------------------------------------------------------
    def run(self, input_path: Path) -> dict:
        import ray

        from modalign.operators.embed.device import embed_actor_resources
        from modalign.pipeline.actors import AlignerActor, EmbedActor, IngestActor

        started = time.time()
        sessions = discover(Path(input_path), tuple(self.config.ingest.allowed_roots))  # ConfigError before work
        check_writable(self.out, self.config.runtime.min_free_mb * 2**20)  # EnvironmentFaultError before work
        self.key_store.mkdir(parents=True, exist_ok=True, mode=0o700)
        cpus = self._init_ray()
        n_ingest = self.config.runtime.ingest_actors or max(1, cpus - 1)
        cfg_json = self.config.model_dump_json()
        self.progress(f"run {self.run_id[:8]}: {len(sessions)} session(s), {n_ingest} ingest actor(s), {cpus} CPU(s)")

        actors: list[Any] = []
        try:
            ingest_actors = [IngestActor.options(num_cpus=1).remote(cfg_json, str(self.out), str(self.key_store))
                             for _ in range(n_ingest)]
            actors += ingest_actors
            gpu = embed_actor_resources(self.config.embed.device, ray.cluster_resources().get("GPU", 0))
            embedder = EmbedActor.options(num_cpus=1 if cpus > 1 else 0, **gpu).remote(cfg_json, str(self.out))
            actors.append(embedder)

            states: list[_SessionState] = []
            jobs: list[tuple[_SessionState, SourceJob]] = []
            for s in sessions:
                st = _SessionState(s, aligner=None)
                states.append(st)
                session_jobs = [j for j in (self._job(st, spec) for spec in s.manifest.ingest_sources()) if j]
                st.aligner = AlignerActor.options(num_cpus=0).remote(
                    s.manifest.session_id, cfg_json, str(self.out), [j.spec.id for j in session_jobs])
                actors.append(st.aligner)
                jobs += [(st, j) for j in session_jobs]

            with ThreadPoolExecutor(max_workers=n_ingest) as pool:
                futures = [pool.submit(self._ingest_one, st, job, ingest_actors[i % n_ingest], embedder)
                           for i, (st, job) in enumerate(jobs)]
                try:
                    for f in futures:
                        f.result()
                except BaseException:
                    self._stop.set()  # the other streams stop at their next item
                    raise

            align = {}
            for st in states:
                sid = st.session.manifest.session_id
                align[sid] = self._get(st.aligner.finish.remote(), f"the aligner of session {sid}")
                for k in ("ticks", "gaps", "ctal_rows", "drift_alarms"):
                    self.counts[k] += align[sid][k]
                self._write_session_tables(st)
                self.progress(f"align {sid}: {align[sid]['ticks']} ticks, {align[sid]['gaps']} gaps, "
                              f"{align[sid]['drift_alarms']} drift alarm(s)")
            cache_stats = self._get(embedder.flush.remote(), "the embed actor")
        finally:  # a failed run must not leave actors (and their models) behind
            for a in actors:
                ray.kill(a)
        indexes = build_indexes(self.layout)
        summary = self._summary(sessions, align, cache_stats, indexes, time.time() - started)
        write_json(self.layout.run_json, summary)
        return summary

    def _job(self, st: _SessionState, spec) -> SourceJob | None:
        """The ingest job of one source, or None (and a quarantine row) when its file is unusable."""
        s = st.session
        m = s.manifest
        try:
            path = s.resolve(spec)  # containment first: nothing outside the roots is even stat()ed
        except InputError as exc:
            if spec.track_of is None:
                self.progress(f"quarantine {spec.uri}: [{exc.code}] {exc.message}")
                st.quarantine.append(QuarantineRow(
                    session_id=m.session_id, source_id=spec.id, source_uri=spec.uri, source_version=None,
                    stage="discover", reason_code=exc.code, message=exc.message))
            return None
        uri = path.as_uri()
        problem = None
        if not path.is_file():
            problem = (QuarantineReason.FILE_MISSING, "file not found; check the manifest's uri")
        elif path.stat().st_size == 0:
            problem = (QuarantineReason.FILE_EMPTY, "file is empty (0 bytes)")
        elif path.stat().st_size > self.config.ingest.max_file_bytes:
            problem = (QuarantineReason.LIMIT_EXCEEDED,
                       f"file is larger than ingest.max_file_bytes={self.config.ingest.max_file_bytes}")
        version = stat_version(path) if problem is None or problem[0] != QuarantineReason.FILE_MISSING else None
        if problem:
            if spec.track_of is None:  # a video's own sound shares the video's file and its row
                self.progress(f"quarantine {uri}: {problem[1]}")
                st.quarantine.append(QuarantineRow(
                    session_id=m.session_id, source_id=spec.id, source_uri=uri, source_version=version,
                    stage="discover", reason_code=problem[0], message=problem[1]))
            return None
        return SourceJob(run_id=self.run_id, session_id=m.session_id, spec=spec, path=path, uri=uri,
                         version=version, tenant=m.tenant, subjects=tuple(m.subjects),
                         reference=self._reference(st, spec), roots=s.roots)

    def _ingest_one(self, st: _SessionState, job: SourceJob, actor, embedder) -> None:
        """Stream one source through an ingest actor, forwarding its items (runs in a driver thread)."""
        import ray

        stream_state = _SourceStream(job, started=time.perf_counter())
        limit = self.config.runtime.max_in_flight
        if self._stop.is_set():
            return
        try:
            stream = actor.ingest.options(num_returns="streaming").remote(job)
            for ref in stream:
                if self._stop.is_set():
                    return
                item = ray.get(ref)
                if isinstance(item, EmbedItem):  # the next stream item is its table: forward that ref unread
                    item = EmbedItem(item.modality, item.rows, next(stream))
                self._route(st, stream_state, item, embedder)
                if len(stream_state.pending) > limit:  # backpressure: at most `limit` downstream calls in flight
                    done, stream_state.pending = ray.wait(stream_state.pending,
                                                          num_returns=len(stream_state.pending) - limit)
                    self._collect(done)
        except ray.exceptions.RayError as exc:  # the worker died mid-source: quarantine, keep the run going
            self._route(st, stream_state, QuarantineItem(QuarantineRow(
                session_id=job.session_id, source_id=job.spec.id, source_uri=job.uri,
                source_version=job.version,
                stage=f"ingest/{job.spec.modality}", reason_code=QuarantineReason.WORKER_FAILED,
                message=f"ingest worker failed ({type(exc).__name__}); re-run to retry")), embedder)
        if stream_state.lineage is not None:  # no more events from this source: its ticks can be decided
            stream_state.pending.append(st.aligner.finish_source.remote(job.spec.id))
        self._collect(stream_state.pending)
        done = stream_state.done
        if done is None:  # the worker died before its last item
            lineage = stream_state.lineage or source_lineage(job, self.config.policy.tag)
            clock = stream_state.clock.mapping if stream_state.clock else job.spec.clock
            done = DoneItem(lineage_row(job, lineage, clock, status="quarantined", events=stream_state.events))
        with self._lock:
            st.lineage.append(done.row)
            self.counts[f"events_{job.spec.modality}"] += stream_state.events
            self.counts.update(done.counts)
        self.progress(f"ingest {job.session_id}/{job.spec.id} ({job.spec.modality}): {stream_state.events} events, "
                      f"{done.row.status}")

    def _route(self, st: _SessionState, src: _SourceStream, item: Item, embedder) -> None:
        """Forward one ingest item: metadata to the aligner, payload to the embedder, rows to the driver."""
        job = src.job
        match item:
            case ClockItem(mapping=clock):
                src.clock = item
                if clock.estimated:
                    self.progress(f"clock {job.session_id}/{job.spec.id}: offset {clock.offset_ns / 1e6:+.1f} ms, "
                                  f"skew {clock.skew_ppm:+.1f} ppm (estimated against {clock.estimate_from})")
            case SourceItem(lineage=lineage):
                src.lineage = lineage
                clock = src.clock.mapping if src.clock else job.spec.clock
                src.pending.append(st.aligner.register.remote(job.spec.id, job.spec.modality, lineage.model_dump(),
                                                              clock))
                if src.clock and src.clock.windows:
                    src.pending.append(st.aligner.observe_offsets.remote(job.spec.id, src.clock.windows))
            case MetaItem(table=table):
                src.events += table.num_rows
                latency = (time.perf_counter() - src.started) * 1e3
                src.pending.append(st.aligner.add.remote(job.spec.id, table, latency))
            case EmbedItem(modality=modality, rows=rows, table=table_ref):
                if rows:
                    lineage = src.lineage.model_dump() if src.lineage else {}
                    src.pending.append(embedder.embed.remote(modality, table_ref, lineage, src.part))
                    src.part += 1
            case QuarantineItem(row=row):
                self.progress(f"quarantine {row.source_uri}: [{row.reason_code}] {row.message}")
                with self._lock:
                    st.quarantine.append(row)
            case FaultItem(message=message):
                raise EnvironmentFaultError(message)
            case DoneItem():
                src.done = item

    def _reference(self, st: _SessionState, spec) -> tuple[Path, Any] | None:
        """(path, clock) of the source this one's clock is estimated or verified against."""
        ref_id = spec.clock.reference
        if ref_id is None:
            return None
        ref = next(s for s in st.session.manifest.sources if s.id == ref_id)
        try:
            path = st.session.resolve(ref)
        except InputError:
            path = None
        if path is None or not path.is_file():
            self.progress(f"clock {st.session.manifest.session_id}/{spec.id}: reference {ref_id} is missing; "
                          "manifest clock kept")
            return None
        return path, ref.clock

    @staticmethod
    def _get(refs: Any, what: str) -> Any:
        """``ray.get``, with the death of an actor that holds run state reported as what it is."""
        import ray

        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as exc:
            raise EnvironmentFaultError(f"{what} died ({type(exc).__name__}): the run cannot finish honestly; "
                                        "check the machine's memory and the Ray logs, then re-run") from None

    def _collect(self, results: list) -> None:
        import ray

        refs = [r for r in results if isinstance(r, ray.ObjectRef)]
        if refs:  # aligner and embedder calls: their actors hold the run's state
            results = [r for r in results if not isinstance(r, ray.ObjectRef)] + self._get(
                refs, "an aligner or the embed actor")
        for r in results:
            if isinstance(r, dict) and "granularities" in r:
                with self._lock:
                    for g, n in r["granularities"].items():
                        self.counts[f"features_{g}"] += n

    def _write_session_tables(self, st: _SessionState) -> None:
        sid = st.session.manifest.session_id
        write_table(self.layout.quarantine(sid),
                    rows_to_table(QuarantineRow, [r.model_dump(mode="json") for r in st.quarantine]))
        write_table(self.layout.lineage_sources(sid),
                    rows_to_table(SourceLineageRow, [r.model_dump(mode="json") for r in st.lineage]))
        self.counts["quarantined"] += len(st.quarantine)

    def _summary(self, sessions, align, cache_stats, indexes, elapsed_s: float) -> dict:
        from modalign.operators.base import all_operators

        c = self.counts
        removed = sorted({name for plan in PLANS.values() for name in plan.counters})
        return {
            "run_id": self.run_id,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "elapsed_s": round(elapsed_s, 2),
            "counts": {
                "sessions": len(sessions),
                "ticks": c["ticks"],
                "events": {m: c[f"events_{m}"] for m in PLANS},
                "gaps": c["gaps"],
                "ctal_rows": c["ctal_rows"],
                "drift_alarms": c["drift_alarms"],
                **{name: c[name] for name in removed},
                "voice_frames": {k.split(":", 1)[1]: n for k, n in sorted(c.items()) if k.startswith("voice_frames:")},
                "features": {g: c[f"features_{g}"] for g in ("frame", "roi", "patch")},
                "cache": {k: cache_stats[k] for k in ("hits", "misses", "hit_rate")},
                "quarantined": c["quarantined"],
            },
            "alignment": {sid: a["summary"] for sid, a in align.items()},
            "indexes": indexes,
            "versions": {
                "modalign": package_version("modalign"),
                "python": platform.python_version(),
                "policy": self.config.policy.tag,
                "operators": {kind: op.version for kind, op in sorted(all_operators().items())},
                **{name: package_version(*dists) for name, dists in VERSIONED_PACKAGES.items()},
            },
            "config": self.config.model_dump(mode="json"),
            "exit_code": EXIT_QUARANTINED if c["quarantined"] else EXIT_OK,
        }


def build_indexes(layout: OutputLayout) -> list[dict]:
    """One FAISS index per (model, granularity) from the feature files; ids = feature_id."""
    import numpy as np
    import pyarrow.dataset as ds

    from modalign.operators.cache.index import FeatureIndex

    built = []
    root = layout.root / "features"
    if not root.is_dir():
        return built
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        for gran_dir in sorted(p for p in model_dir.iterdir() if p.is_dir()):
            t = ds.dataset(gran_dir, format="parquet").to_table(columns=["feature_id", "vector", "dim"])
            if t.num_rows == 0:
                continue
            dim = t.column("dim")[0].as_py()
            vecs = np.asarray(t.column("vector").combine_chunks().flatten().to_numpy(), dtype=np.float32).reshape(-1, dim)
            index = FeatureIndex(dim)
            index.add(t.column("feature_id").to_numpy(), vecs)
            path = layout.root / "index" / f"{model_dir.name}__{gran_dir.name}.faiss"
            path.parent.mkdir(parents=True, exist_ok=True)
            index.save(path)
            built.append({"model_id": model_dir.name, "granularity": gran_dir.name, "vectors": t.num_rows,
                          "dim": dim, "path": str(path.relative_to(layout.root))})
    return built


def resolve_config(config: "RunConfig | dict | str | PathLike | None") -> RunConfig:
    """A ``RunConfig`` from itself, a dict of its fields, a YAML/JSON file, or None (defaults)."""
    from pydantic import ValidationError

    from modalign.schemas.load import format_validation_error, load_model

    if config is None:
        return RunConfig()
    if isinstance(config, RunConfig):
        return config
    if isinstance(config, dict):
        try:
            return RunConfig.model_validate(config)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, "config")) from None
    return load_model(RunConfig, Path(config))


def run(input_path: str | PathLike, out: str | PathLike, config: Any = None,
        progress: Callable[[str], None] | None = None) -> dict:
    """``modalign run``: the batch job (see ``modalign.run``)."""
    return Runner(resolve_config(config), Path(out), progress).run(Path(input_path))

