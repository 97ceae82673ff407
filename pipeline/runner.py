"""``modalign run``: the batch job on local Ray or a cluster.

Discovery validates every manifest first (a bad one stops the run before any work), and
OUT is checked writable. The run then takes OUT's lease (one writer), and sweeps what a
crashed earlier attempt left. Per source, an ingest actor streams de-identified items back:
metadata goes to the session's aligner actor, payload refs to the embed actor (at most
``max_in_flight`` pending per ingest stream, so memory stays bounded), quarantine and
lineage rows to the driver. Each aligner writes its session's timeline and CTAL log in parts
as the watermarks advance (``pipeline.timeline``); every call to it is logged here first, so
an aligner that Ray restarts is resumed from its checkpoint plus that log. At the end the
aligners write their last parts, the FAISS indexes are built from the new state's feature
files, and the next commit
(``modalign.pipeline.commits``) lists exactly the files of that state; only then are the
previous commit's files removed and ``run.json`` (a copy of the summary) rewritten. Every
file the run writes carries its attempt id, so until the commit nothing a reader uses changes.

OUT may be ``s3://bucket/prefix`` (``OutputLayout.of``): every actor writes its files there
itself (the config JSON carries the endpoint; credentials come from each node's AWS chain),
the writability check is a probe object, the lease and commit log are objects, the sweep
lists and deletes objects, and the feature cache lives in the embed actor's memory only.
"""

from __future__ import annotations

import logging
import platform
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from os import PathLike
from pathlib import Path
from typing import Any, Callable

import pyarrow.compute as pc

from modalign.operators.cache.store import merge_stats as merge_cache_stats
from modalign.operators.modalities import PLANS, plan_for
from modalign.pipeline.commits import CommitLog, Snapshot, sweep
from modalign.pipeline.discovery import ObjectPath, Session, discover_input
from modalign.pipeline.erasure import Denylist, carried_shared
from modalign.pipeline.items import (ClockItem, DoneItem, EmbedItem, FaultItem, Item, MetaItem, QuarantineItem,
                                     SourceItem, SourceJob)
from modalign.pipeline.layout import OutputLayout, attempt_of, storage_faults, write_fault
from modalign.pipeline.lease import Lease
from modalign.pipeline.metrics import Metrics
from modalign.pipeline.monitors import COLUMNS as MONITOR_COLUMNS
from modalign.pipeline.monitors import EmbeddingMonitors, monitor_reference, read_group
from modalign.pipeline import quality
from modalign.pipeline.progress import Display
from modalign.pipeline.openlineage import RunLineage
from modalign.pipeline.worker import PARTS_PER_RANGE, lineage_row, source_lineage
from modalign.schemas.arrow import rows_to_table
from modalign.schemas.config import RunConfig, RuntimeConfig
from modalign.schemas.environment import key_store_dir, ray_temp_dir
from modalign.schemas.errors import (ConfigError, EnvironmentFaultError, InputError, ModalignError, OutputLockedError,
                                     QualityGateError, QuarantineReason)
from modalign.schemas.files import fsync_dir, stat_version
from modalign.schemas.tables import DeidHeader, LineageColumns, QuarantineRow, SourceLineageRow

log = logging.getLogger("modalign")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_QUARANTINED = 3  # the run completed, some inputs (or ranges) were quarantined
SOURCE_RETRIES = 2  # a source whose stream failed before its first item (its actor was restarting)
MODALITY_ORDER = {"video": 0, "audio": 1, "pdf": 2}  # longest job first: the order sources go to free actors

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
    files: set[str] = field(default_factory=set)  # what this run wrote for the session (relative to OUT)
    align_log: list = field(default_factory=list)  # every aligner call, in submission order: a restart replays it
    align_lock: threading.Lock = field(default_factory=threading.Lock)  # log order = submission order
    align_refs: dict = field(default_factory=dict)  # aligner calls not yet collected -> their index in the log
    align_resumed_at: int = 0  # length of the log the last resume replayed


@dataclass
class _RangedSource:
    """A source cut into ranges (``SourceJob.range``: a video's, an audio stream's) that several
    ingest actors stream at once.

    The aligner must see one source's event parts in time order: the parts of the range whose
    turn it is go to it as they come, a later range's parts wait here (event ids and times
    only) until every range before it is done. The source is registered once, by the first
    range to start, and finished, with one lineage row, when its last range is done."""

    job: SourceJob  # the whole source
    count: int
    current: int = 0  # the range whose parts go to the aligner now
    registered: bool = False
    meta_seq: int = 0  # the source's event parts sent to the aligner, over all its ranges
    held: dict[int, list[tuple]] = field(default_factory=dict)  # range -> [(table, path, latency_ms)]
    streams: dict[int, "_SourceStream"] = field(default_factory=dict)  # the ranges done
    lock: threading.Lock = field(default_factory=threading.Lock)


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
    end_ns: int | None = None  # where the recording ends (SourceItem)
    last_t_ns: int | None = None  # the latest event time received
    items: int = 0
    meta_seq: int = 0  # event parts sent to the aligner (their numbers dedupe a replay)


class Runner:
    def __init__(self, config: RunConfig, out: Path, progress: Callable[[str], None] | None = None, *,
                 metrics: Metrics | None = None, pool: Any = None, display: Display | None = None) -> None:
        """``progress``: where messages go; ``display``: what shows the run's progress (bars on a
        terminal, plain lines: ``pipeline.progress``; default none); ``pool``: an
        ``actors.ActorPool`` to run on and leave running (a watch's, warm across its batches);
        None: the run starts its own and kills it at the end."""
        self.config = config
        self.pool = pool
        self.timing: dict[str, float] = {}  # run.json ``timing``: start-up apart from processing
        self.out: Path | str = OutputLayout.of(out, config.storage).where  # a folder or s3://bucket/prefix
        self.layout = OutputLayout.of(self.out, config.storage)
        self.progress = progress or (lambda msg: log.info(msg))
        self.key_store = key_store_dir(config.key_store).absolute()
        if not self.layout.is_s3 and self.key_store.resolve().is_relative_to(self.out.resolve()):
            raise ConfigError(f"key_store {self.key_store} is inside the output folder {self.out}; pseudonym keys "
                              "are never outputs: set key_store (or $MODALIGN_KEY_STORE) to a folder outside it")
        self.run_id = uuid.uuid4().hex
        self.attempt = attempt_of(self.run_id)
        self._lock = threading.Lock()
        self._stop = threading.Event()  # set when the run must stop (an environment fault, a lost lease)
        self._stopped_by: ModalignError | None = None
        self.counts: Counter = Counter()
        self.embed_batches: Counter = Counter()  # embed actor pid -> payload batches it embedded
        self.lineage = RunLineage(config.openlineage, self.layout, self.run_id)  # OpenLineage events
        self.denylist = Denylist()  # the committed denylist of OUT, read once the lease is held
        self.committed: Snapshot | None = None  # the commit this run made
        self.metrics = metrics or Metrics()  # fed from the items routed here; served by the CLI when asked
        self.display = display or Display()  # fed from the same items
        # the monitors' OUT0 and its committed feature files, if any (ConfigError before work)
        self.reference: tuple[Any, list[str]] = monitor_reference(config.monitor.reference, config.storage)

    # -- Ray ---------------------------------------------------------------------------
    def _init_ray(self) -> int:
        return init_ray(self.config.runtime)

    # -- the run -----------------------------------------------------------------------
    def run(self, input_path: str | Path) -> dict:
        """Discover INPUT (a folder, manifest or file, or ``s3://bucket/prefix``) and run it."""
        from modalign.pipeline.objstore import S3Options

        sessions = discover_input(input_path, tuple(self.config.ingest.allowed_roots),  # ConfigError before work
                                  S3Options.from_config(self.config.storage))
        self.layout.check_writable(self.config.runtime.min_free_mb * 2**20)  # EnvironmentFaultError before work
        self.key_store.mkdir(parents=True, exist_ok=True, mode=0o700)
        with Lease(self.layout.store, self.run_id, ttl_s=self.config.runtime.lease_ttl_s,
                   on_lost=self._halt) as lease:  # OutputLockedError: another writer holds OUT
            if lease.took_over is not None:
                self.progress(f"took over the lease of OUT from {lease.took_over.holder}, which stopped")
            return self.run_sessions(lease, sessions)

    def run_sessions(self, lease: Lease, sessions: list[Session]) -> dict:
        """Process ``sessions`` and commit them (replacing the committed sessions of the same ids)
        under ``lease``, which the caller holds: ``run`` for one call, the watch loop for its whole
        life. Returns the run summary; ``self.committed`` is the new commit."""
        commits = CommitLog(lease.store)
        base = commits.latest()
        self._recover(base, walk=not lease.swept)
        lease.swept = False  # from here this attempt writes into OUT
        self.denylist = Denylist.load(self.layout, base, self.key_store)  # erased sources and subjects
        self.lineage.start(sessions)
        committed = None
        try:
            summary = self._run(sessions)
            t = time.perf_counter()
            committed = self._commit(lease, commits, base, summary)
            summary.setdefault("timing", {})["commit_s"] = round(time.perf_counter() - t, 3)  # run.json's
            self.lineage.complete(committed)
        except BaseException as exc:
            self.lineage.end(exc)  # FAIL, or ABORT when interrupted
            self.metrics.runs.labels("failed").inc()
            raise
        finally:
            self.display.run_ended()
            if committed is None and self._holds(lease):  # nothing of this attempt is listed: remove it
                self._sweep(base.files() if base else set(), quietly=True)
        self.committed = committed
        self.metrics.runs.labels("committed").inc()
        self.metrics.sessions.inc(len(sessions))
        with storage_faults(self.layout.run_json):
            self.layout.write_json(self.layout.run_json, summary)
        self._sweep(committed.files())
        lease.swept = True
        return summary

    def _run(self, sessions: list[Session]) -> dict:
        """Ingest, align and embed every session; returns the run summary (with ``timing``:
        Ray start-up, actors ready, processing; ``_commit`` adds the commit's)."""
        import queue

        import ray

        from modalign.operators.embed.device import embed_actor_count, embed_actor_resources
        from modalign.pipeline.actors import ActorPool, AlignerActor

        started = time.time()
        t = time.perf_counter()
        cpus = self._init_ray()
        self.timing = {"ray_start_s": round(time.perf_counter() - t, 3)}
        n_ingest = self.config.runtime.ingest_actors or cpus  # every core; the embed actor takes none (below)
        cfg_json = self.config.model_dump_json()
        self.progress(f"run {self.run_id[:8]}: {len(sessions)} session(s), {n_ingest} ingest actor(s), {cpus} CPU(s)")
        if self.layout.cache_dir is None:
            self.progress("feature cache: in memory for this run only (none is kept on an s3:// OUT; a re-run "
                          "recomputes the features)")

        pool = self.pool if self.pool is not None else ActorPool()  # a watch's warm pool, else the run's own
        aligners: list[Any] = []
        try:
            self.states: list[_SessionState] = []
            jobs: list[tuple[_SessionState, SourceJob]] = []
            for s in sessions:
                st = _SessionState(s, aligner=None)
                self.states.append(st)
                session_jobs = [j for j in (self._job(st, spec) for spec in s.manifest.ingest_sources()) if j]
                st.aligner = AlignerActor.options(num_cpus=0).remote(
                    s.manifest.session_id, cfg_json, str(self.out), self.attempt, [j.spec.id for j in session_jobs])
                aligners.append(st.aligner)
                jobs += [(st, j) for j in session_jobs]
            rejected = sum(len(st.quarantine) for st in self.states)  # sources refused before any work
            self.display.run_started(len(sessions), len(jobs) + rejected, rejected)

            cluster_gpus = ray.cluster_resources().get("GPU", 0)
            gpu = embed_actor_resources(self.config.embed.device, cluster_gpus)
            # The ingest actors take every CPU, so an embed actor asking for one would never be
            # scheduled on a single machine (2 CPUs: two 1-CPU ingest actors leave none). Ray's CPU
            # count is a scheduling token, not a limit: on the CPU the embedder asks for none and
            # shares the cores with the ingest actors (its work comes in bursts, between which an
            # ingest actor would otherwise leave a reserved core idle); with a GPU, the GPU is what
            # it is scheduled on, plus a CPU to feed it when the ingest actors leave one over.
            embed_options = {"num_cpus": 1 if gpu and cpus > n_ingest else 0, **gpu}
            n_embed = embed_actor_count(gpu, cluster_gpus, n_ingest, self.config.runtime.embed_actors)
            chains = sorted({(plan_for(j.spec.modality).name, j.tenant) for _st, j in jobs})
            replaced = pool.replaced
            self.timing["actors_ready_s"] = round(pool.ready(self.config, str(self.out), str(self.key_store),
                                                             self.attempt, n_ingest, embed_options, chains,
                                                             n_embed), 3)
            self.actor_pids = {f"{kind}-{i}": pid for (kind, i), pid in sorted(pool.pids.items())}
            if pool.replaced > replaced:
                self.progress(f"{pool.replaced - replaced} actor(s) that Ray had restarted replaced by fresh ones "
                              "(a run starts with every actor's restarts left)")
            self.display.stage("ingest")
            t = time.perf_counter()
            jobs = self._split(jobs, pool.ingest)
            free: queue.Queue = queue.Queue()  # ingest actors with nothing to do
            for actor in pool.ingest:
                free.put(actor)

            # (session, source, range; 0 for a whole source) -> the ingest actor's index
            self.ingested_by: dict[tuple[str, str, int], int] = {}

            def ingest_on_a_free_actor(st: _SessionState, job: SourceJob) -> None:
                actor = free.get()  # never waits long: as many threads as actors
                part = job.range.index if job.range is not None else 0
                index = pool.ingest.index(actor)
                self.ingested_by[(job.session_id, job.spec.id, part)] = index
                try:
                    self._ingest_one(st, job, actor, pool.embedder_for(index))
                finally:
                    free.put(actor)

            # Longest job first (video, then audio, then documents; larger files, or ranges, first),
            # each to whichever ingest actor is free, so the longest source does not start last.
            jobs.sort(key=lambda sj: (MODALITY_ORDER.get(sj[1].spec.modality, len(MODALITY_ORDER)),
                                      -(_file_bytes(sj[1]) or 0) / (sj[1].range.count if sj[1].range else 1)))
            with ThreadPoolExecutor(max_workers=len(pool.ingest)) as executor:
                futures = [executor.submit(ingest_on_a_free_actor, st, job) for st, job in jobs]
                try:
                    for f in futures:
                        f.result()
                except BaseException:
                    self._stop.set()  # the other streams stop at their next item
                    raise
            self._raise_if_halted()

            align = {}
            self.display.stage("align")
            for st in self.states:
                sid = st.session.manifest.session_id
                ta = time.perf_counter()
                align[sid] = self._finish_aligner(st)
                self.metrics.aligned(align[sid], time.perf_counter() - ta)
                self.display.session_aligned()
                st.files.update(align[sid]["files"])
                for k in ("ticks", "gaps", "ctal_rows", "drift_alarms"):
                    self.counts[k] += align[sid][k]
                self._write_session_tables(st)
                self.lineage.session_done(sid, st.lineage, st.files)
                self.progress(f"align {sid}: {align[sid]['ticks']} ticks, {align[sid]['gaps']} gaps, "
                              f"{align[sid]['drift_alarms']} drift alarm(s)")
            cache_stats = merge_cache_stats(self._get([e.flush.remote() for e in pool.embedders], "the embed actor"))
            self.metrics.cache_stats(cache_stats)
            self.timing["processing_s"] = round(time.perf_counter() - t, 3)
        finally:  # a failed run must not leave actors (and their models) behind; a watch keeps its pool
            for a in aligners:
                ray.kill(a)
            if self.pool is None:
                pool.close()
        self._raise_if_halted()
        summary = self._summary(sessions, align, cache_stats, time.time() - started)
        summary["timing"] = dict(self.timing)
        # how the work spread: payload batches each embed actor embedded (most first; a restarted
        # actor counts as another)
        summary["actors"] = {"ingest": n_ingest, "embed": n_embed,
                             "embed_batches": sorted(self.embed_batches.values(), reverse=True),
                             "pids": self.actor_pids}  # the processes the run started on (a watch's stay)
        return summary

    # -- the commit --------------------------------------------------------------------
    def _commit(self, lease: Lease, commits: CommitLog, base: Snapshot | None, summary: dict) -> Snapshot:
        """Build the indexes of the new state, make its files durable, and commit it."""
        sessions = {st.session.manifest.session_id: {"run_id": self.run_id, "files": sorted(st.files)}
                    for st in self.states}
        carried = {sid: s for sid, s in (base.sessions.items() if base else ()) if sid not in sessions}
        features = sorted(f for s in [*sessions.values(), *carried.values()] for f in s["files"]
                          if f.startswith("features/"))
        # a record broke a `fail` quality expectation: QualityGateError, nothing of this run is committed
        quality.check_failures(row for st in self.states for row in st.quarantine)
        events = sorted(f for s in [*sessions.values(), *carried.values()] for f in s["files"]
                        if f.startswith("events/"))
        self.display.stage("commit")
        with storage_faults(self.out):
            t = time.perf_counter()
            monitors = EmbeddingMonitors(self.layout, self.attempt, self.config.monitor.embedding, *self.reference)
            indexes = build_indexes(self.layout, features, self.attempt, monitors)  # one read of the vectors
            monitor = monitors.finish()
            self.metrics.stage("index", time.perf_counter() - t - monitors.seconds)
            self.metrics.stage("monitor", monitors.seconds)
            summary["indexes"] = indexes
            self.metrics.monitored(monitor)
            summary["monitor"] = {k: monitor[k] for k in ("windows", "alarms", "streams")}
            summary["counts"]["monitor_alarms"] = dict(monitor["alarms"])
            t = time.perf_counter()  # the quality-shift check over the committed events (pipeline.quality)
            checked = quality.monitor_quality(self.layout, events, self.attempt, self.config.quality.shift,
                                              *quality.quality_reference(self.config.monitor.reference,
                                                                         self.config.storage))
            self.metrics.stage("quality", time.perf_counter() - t)
            self.metrics.quality_monitored(checked)
            quality.record(summary, checked, self.counts, self.config.quality)
            shared = ([ix["path"] for ix in indexes] + monitor["files"] + checked["files"]
                      + carried_shared(base))  # + the denylist, erasure reports
            if not self.layout.is_s3:  # an object is durable once its upload completed
                new_files = [self.out / f for s in sessions.values() for f in s["files"]] + [self.out / f for f in shared]
                for folder in sorted({p.parent for p in new_files}):
                    fsync_dir(folder)
            lease.check()  # the fence: a writer that lost its lease must not commit
            t = time.perf_counter()
            snap = commits.commit(base, run_id=self.run_id, sessions=sessions, shared=shared, summary=summary)
            self.metrics.stage("commit", time.perf_counter() - t)
        self.progress(f"commit {snap.version} of {self.out}: {len(snap.files())} files, "
                      f"{len(sessions)} session(s) written, {len(carried)} kept")
        return snap

    def _recover(self, base: Snapshot | None, walk: bool = True) -> None:
        """Remove what crashed attempts left (files no commit lists) and restore run.json.
        ``walk`` False: the lease says OUT holds exactly ``base``'s files (``Lease.swept``)."""
        removed = self._sweep(base.files() if base else set()) if walk else 0
        if removed:
            self.progress(f"removed {removed} file(s) of an unfinished earlier run (not committed)")
        if base is not None:
            self.layout.write_json(self.layout.run_json, base.summary)
        else:
            self.layout.delete(self.layout.run_json)  # it described files no commit lists

    def _sweep(self, keep: set[str], quietly: bool = False) -> int:
        try:
            with storage_faults(self.out):
                return sweep(self.layout.store if self.layout.is_s3 else self.out, keep, self.layout.data_folders())
        except EnvironmentFaultError as exc:
            if not quietly:
                raise
            log.warning("could not remove uncommitted files of run %s: %s", self.run_id[:8], exc.message)
            return 0  # already failing (read-only OUT): the next run sweeps

    @staticmethod
    def _holds(lease: Lease) -> bool:
        """Whether this run still holds OUT (a run that lost its lease must not touch the new holder's files)."""
        try:
            lease.check()
        except (OutputLockedError, OSError):
            return False
        return True

    def _halt(self, reason: ModalignError) -> None:
        """Stop the run from another thread (the lease was lost): streams stop at their next item."""
        self._stopped_by = reason
        self._stop.set()

    def _raise_if_halted(self) -> None:
        if self._stopped_by is not None:
            raise self._stopped_by

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
        if isinstance(path, ObjectPath):  # version and size from the listing: no request here
            return self._object_job(st, spec, path)
        if not path.is_file():
            problem = (QuarantineReason.FILE_MISSING, "file not found; check the manifest's uri")
        elif path.stat().st_size == 0:
            problem = (QuarantineReason.FILE_EMPTY, "file is empty (0 bytes)")
        elif path.stat().st_size > self.config.ingest.max_file_bytes:
            problem = (QuarantineReason.LIMIT_EXCEEDED,
                       f"file is larger than ingest.max_file_bytes={self.config.ingest.max_file_bytes}")
        version = stat_version(path) if problem is None or problem[0] != QuarantineReason.FILE_MISSING else None
        if problem is None and (erased := self.denylist.refusal(uri, version, path, m.subjects_of(spec))):
            problem = (QuarantineReason.ERASED, erased)
        return self._job_unless(st, spec, path, version, problem)

    def _object_job(self, st: _SessionState, spec, path: ObjectPath) -> SourceJob | None:
        """``_job`` for a source on object storage: the checks of a local file, on its listing entry."""
        s, m, uri = st.session, st.session.manifest, path.as_uri()
        entry = s.entry(path)
        size = entry.size if entry is not None else None
        problem = None
        if entry is None:
            problem = (QuarantineReason.FILE_MISSING, "object not found under the input prefix; check the manifest's uri")
        elif size == 0:
            problem = (QuarantineReason.FILE_EMPTY, "object is empty (0 bytes)")
        elif size is not None and size > self.config.ingest.max_file_bytes:
            problem = (QuarantineReason.LIMIT_EXCEEDED,
                       f"object is larger than ingest.max_file_bytes={self.config.ingest.max_file_bytes}")
        version = entry.version if entry is not None else None
        # the denylist's content check needs the bytes: on object storage the worker's sha256 is recorded instead
        if problem is None and (erased := self.denylist.refusal(uri, version, None, m.subjects_of(spec))):
            problem = (QuarantineReason.ERASED, erased)
        return self._job_unless(st, spec, path, version, problem, size)

    def _job_unless(self, st: _SessionState, spec, path: Path | ObjectPath, version: str | None,
                    problem: tuple[str, str] | None, size: int | None = None) -> SourceJob | None:
        """The job of a located source, or, with a ``problem`` (reason code, message), None and
        its quarantine row."""
        m, uri = st.session.manifest, path.as_uri()
        if problem:
            if spec.track_of is None:  # a video's own sound shares the video's file and its row
                self.progress(f"quarantine {uri}: {problem[1]}")
                st.quarantine.append(QuarantineRow(
                    session_id=m.session_id, source_id=spec.id, source_uri=uri, source_version=version,
                    stage="discover", reason_code=problem[0], message=problem[1]))
            return None
        return SourceJob(run_id=self.run_id, session_id=m.session_id, spec=spec, path=path, uri=uri,
                         version=version, tenant=m.tenant, subjects=m.subjects_of(spec),
                         reference=self._reference(st, spec), roots=st.session.roots, size=size)

    def _split(self, jobs: list[tuple[_SessionState, SourceJob]], actors: list) -> list[tuple[_SessionState, SourceJob]]:
        """Each source that the ingest actors can process in ranges, as one job per range: a video
        that ``ingest.video.range_s`` cuts, an audio stream (a file, or a video's sound track) that
        ``ingest.audio.range_min_s`` cuts into up to one range per actor. The actors plan them (read
        the packet indexes or headers), all at once; the other jobs stay as they are."""
        self._ranged: dict[tuple[str, str], _RangedSource] = {}
        video, audio = self.config.ingest.video.range_s is not None, self.config.ingest.audio.range_min_s is not None
        cut = [k for k, (_st, j) in enumerate(jobs) if j.reference is None and (
            (video and j.spec.modality == "video" and j.spec.track_of is None)
            or (audio and j.spec.modality == "audio" and len(actors) > 1))]
        if not cut:
            return jobs
        refs = [actors[i % len(actors)].ranges.remote(jobs[k][1], len(actors)) for i, k in enumerate(cut)]
        plans = dict(zip(cut, self._get(refs, "an ingest actor", on_death=lambda exc: [[]] * len(refs))))
        out: list[tuple[_SessionState, SourceJob]] = []
        for k, (st, job) in enumerate(jobs):
            ranges = plans.get(k) or []
            if not ranges:
                out.append((st, job))
                continue
            self._ranged[(job.session_id, job.spec.id)] = _RangedSource(job, len(ranges))
            out += [(st, replace(job, range=r)) for r in ranges]
            for r in ranges:  # the recordings' total counts every range from the start
                self.display.stream_planned(stream_key(replace(job, range=r)), job.spec.modality, r.seconds)
            self.progress(f"ingest {job.session_id}/{job.spec.id} ({job.spec.modality}): {len(ranges)} ranges of "
                          f"about {sum(r.seconds for r in ranges) / len(ranges):.0f} s, processed at once")
        return out

    def _ingest_one(self, st: _SessionState, job: SourceJob, actor, embedder) -> None:
        """Stream one source through an ingest actor, forwarding its items (runs in a driver thread).

        If the actor dies, the source it was processing is cut short: its events so far are
        kept, the rest of its time becomes gaps, and a ``worker_failed`` row says so. A source
        whose stream failed before its first item was only queued on the dying actor: it is
        retried once the actor has restarted."""
        import ray

        src = _SourceStream(job, started=time.perf_counter())
        if job.range is not None:  # embed parts named apart from the other ranges', in time order
            src.part = job.range.index * PARTS_PER_RANGE
        for attempt in range(SOURCE_RETRIES + 1):
            if self._stop.is_set():
                return
            try:
                self._stream(st, src, actor, embedder)
                break
            except ray.exceptions.RayActorError as exc:
                if src.items == 0 and attempt < SOURCE_RETRIES and self._restarted(actor):
                    self.progress(f"retry {job.session_id}/{job.spec.id}: it was queued on an ingest actor that died "
                                  f"({type(exc).__name__})")
                    continue
                self._cut_short(st, src, exc, embedder)
                break
            except ray.exceptions.RayError as exc:
                self._cut_short(st, src, exc, embedder)
                break
        self.display.stream_done(stream_key(job))
        if self._stop.is_set():  # the run is stopping: nothing of this source is recorded
            return
        if job.range is not None:
            self._range_done(st, src, embedder)
            return
        if src.lineage is not None:  # no more events from this source: its ticks can be decided
            cut = src.end_ns if src.done is None else None
            src.pending.append(self._align(st, ("finish_source", job.spec.id, cut)))
        self._collect(st, src.pending)
        self._source_done(st, job, self._done_item(src), src.events)

    def _done_item(self, src: _SourceStream) -> DoneItem:
        """The stream's last item, or (the worker died before it) what the driver knows."""
        if src.done is not None:
            return src.done
        job = src.job
        lineage = src.lineage or source_lineage(job, self.config.policy.tag)
        clock = src.clock.mapping if src.clock else job.spec.clock
        return DoneItem(lineage_row(replace(job, range=None), lineage, clock,
                                    status="partial" if src.events else "quarantined", events=src.events))

    def _range_done(self, st: _SessionState, src: _SourceStream, embedder) -> None:
        """One range of a source is done: the next ranges' held parts go to the aligner, and after
        the last range the source is finished, with one lineage row for all of them."""
        job = src.job
        ranged = self._ranged[(job.session_id, job.spec.id)]
        with ranged.lock:
            ranged.streams[job.range.index] = src
            while ranged.current in ranged.streams:  # this range, and any after it already done
                ranged.current += 1
                for table, path, latency in ranged.held.pop(ranged.current, []):
                    src.pending.append(self._align(st, ("add", job.spec.id, ranged.meta_seq, path, latency), table))
                    ranged.meta_seq += 1
            last = len(ranged.streams) == ranged.count
            if last and ranged.registered:
                tail = ranged.streams[ranged.count - 1]
                cut = tail.end_ns if tail.done is None else None
                src.pending.append(self._align(st, ("finish_source", job.spec.id, cut)))
        self._collect(st, src.pending)
        if not last:
            return
        streams = [ranged.streams[k] for k in range(ranged.count)]
        dones = [self._done_item(s) for s in streams]
        events = sum(s.events for s in streams)
        statuses = {d.row.status for d in dones}
        status = "ingested" if statuses == {"ingested"} else ("partial" if events else "quarantined")
        headers: dict[tuple[str, str], dict] = {}
        counts: Counter = Counter()
        for d in dones:
            counts.update(d.counts)
            for h in d.row.deid:
                agg = headers.setdefault((h.method, h.detector), dict(h.model_dump(), count=0))
                agg["count"] += h.count
        row = dones[0].row.model_copy(update={"status": status, "events": events, "source_sha256": ranged_sha256(streams),
                                              "deid": [DeidHeader(**h) for h in headers.values()]})
        self._source_done(st, ranged.job, DoneItem(row, dict(counts)), events)

    def _source_done(self, st: _SessionState, job: SourceJob, done: DoneItem, events: int) -> None:
        """Record a source's lineage row and counters once its stream (or all its ranges) ended."""
        with self._lock:
            st.lineage.append(done.row)
            self.counts[f"events_{job.spec.modality}"] += events
            self.counts.update(done.counts)
        self.metrics.source_done(job.spec.modality, done.row.status, _source_bytes(job), done.counts)
        self.display.source_done(done.row.status)
        self.progress(f"ingest {job.session_id}/{job.spec.id} ({job.spec.modality}): {events} events, "
                      f"{done.row.status}")

    @staticmethod
    def _restarted(actor, timeout_s: float = 300.0) -> bool:
        """Wait until a dead ingest actor is back (Ray restarts it); False when it stays dead."""
        import ray

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                ray.get(actor.ping.remote(), timeout=max(1.0, deadline - time.monotonic()))
                return True
            except ray.exceptions.ActorUnavailableError:  # still restarting
                time.sleep(0.5)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                return False
        return False

    def _stream(self, st: _SessionState, src: _SourceStream, actor, embedder) -> None:
        import ray

        limit = self.config.runtime.max_in_flight
        stream = actor.ingest.options(num_returns="streaming").remote(src.job)
        for ref in stream:
            if self._stop.is_set():
                return
            item = ray.get(ref)
            src.items += 1
            if isinstance(item, EmbedItem):  # the next stream item is its table: forward that ref unread
                item = EmbedItem(item.modality, item.rows, next(stream))
            self._route(st, src, item, embedder)
            self._poll_aligner(st, src)  # a dead aligner is noticed at once, not at the end
            if len(src.pending) > limit:  # backpressure: at most `limit` downstream calls in flight
                done, src.pending = ray.wait(src.pending, num_returns=len(src.pending) - limit)
                self._collect(st, done)
        if src.done is None and not self._stop.is_set():
            # The stream ended without its last item, quietly: its actor died between an EmbedItem and
            # its table, whose ref then holds the death. Collected now, an embed call handed it raises
            # that death (``_collect``) where the caller cuts the source short; so does a stream whose
            # table went to no call.
            pending, src.pending = src.pending, []
            self._collect(st, pending)
            raise ray.exceptions.RayActorError()

    def _cut_short(self, st: _SessionState, src: _SourceStream, exc: Exception, embedder) -> None:
        """The worker died mid-source: quarantine the missing range, keep what arrived."""
        job = src.job
        start = None if src.last_t_ns is None else src.last_t_ns + 1
        kept = f"its {src.events} events up to there are kept, " if src.events else ""
        self._route(st, src, QuarantineItem(QuarantineRow(
            session_id=job.session_id, source_id=job.spec.id, source_uri=job.uri, source_version=job.version,
            stage=f"ingest/{job.spec.modality}", reason_code=QuarantineReason.WORKER_FAILED,
            start_t_ns=start, end_t_ns=src.end_ns if start is not None else None,
            message=f"ingest worker died while processing this source ({type(exc).__name__}); {kept}"
                    "the rest is reported as gaps: re-run to retry")), embedder)

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
                src.lineage, src.end_ns = lineage, item.end_ns
                self.display.stream_started(stream_key(job), job.spec.modality, item.end_ns)
                clock = src.clock.mapping if src.clock else job.spec.clock
                ranged = self._ranged.get((job.session_id, job.spec.id)) if job.range is not None else None
                if ranged is not None:
                    with ranged.lock:
                        first, ranged.registered = not ranged.registered, True
                        if first:  # inside the lock: no range's parts can reach the aligner before it
                            src.pending.append(self._align(st, ("register", job.spec.id, job.spec.modality,
                                                                lineage.model_dump(), clock)))
                    return
                src.pending.append(self._align(st, ("register", job.spec.id, job.spec.modality, lineage.model_dump(),
                                                    clock)))
                if src.clock and src.clock.windows:
                    src.pending.append(self._align(st, ("observe_offsets", job.spec.id, src.clock.windows)))
            case MetaItem(table=table):
                src.events += table.num_rows
                t_min = t_max = None
                if table.num_rows:
                    span = pc.min_max(table.column("t_ns"))
                    t_min, t_max = span["min"].as_py(), span["max"].as_py()
                    src.last_t_ns = max(src.last_t_ns or 0, t_max)
                pages = pc.unique(table.column("t_ns")).to_pylist() if job.spec.modality == "pdf" else None
                self.display.stream_advanced(stream_key(job), job.spec.modality, table.num_rows, t_min, t_max, pages)
                with self._lock:
                    st.files.add(item.path)
                latency = (time.perf_counter() - src.started) * 1e3
                if job.range is not None:
                    self._range_part(st, src, table, item.path, latency)
                else:
                    src.pending.append(self._align(st, ("add", job.spec.id, src.meta_seq, item.path, latency), table))
                    src.meta_seq += 1
                self.metrics.batch_ingested(job.spec.modality, table.num_rows, item.seconds)
            case EmbedItem(modality=modality, rows=rows, table=table_ref):
                if rows:
                    lineage = src.lineage.model_dump() if src.lineage else {}
                    src.pending.append(embedder.embed.remote(modality, table_ref, lineage, src.part))
                    src.part += 1
                    self.display.embed_submitted()
            case QuarantineItem(row=row):
                self.progress(f"quarantine {row.source_uri}: [{row.reason_code}] {row.message}")
                self.display.quarantined()
                if row.reason_code == QuarantineReason.QUALITY_FAILED:  # a `fail` expectation: the run stops now
                    try:
                        quality.check_failures([row])
                    except QualityGateError as exc:
                        self._halt(exc)
                with self._lock:
                    st.quarantine.append(row)
            case FaultItem(message=message):
                raise EnvironmentFaultError(message)
            case DoneItem():
                src.done = item

    def _range_part(self, st: _SessionState, src: _SourceStream, table: Any, path: str, latency: float) -> None:
        """An event part of a range: to the aligner now if its range's turn has come, else held."""
        job = src.job
        ranged = self._ranged[(job.session_id, job.spec.id)]
        with ranged.lock:
            if job.range.index == ranged.current:
                src.pending.append(self._align(st, ("add", job.spec.id, ranged.meta_seq, path, latency), table))
                ranged.meta_seq += 1
            else:
                ranged.held.setdefault(job.range.index, []).append((table, path, latency))

    def _reference(self, st: _SessionState, spec) -> tuple[Path | ObjectPath, Any] | None:
        """(path or object key, clock) of the source this one's clock is estimated or verified against."""
        ref_id = spec.clock.reference
        if ref_id is None:
            return None
        ref = next(s for s in st.session.manifest.sources if s.id == ref_id)
        try:
            path = st.session.resolve(ref)
        except InputError:
            path = None
        exists = path is not None and (st.session.entry(path) is not None if isinstance(path, ObjectPath)
                                       else path.is_file())
        if not exists:
            self.progress(f"clock {st.session.manifest.session_id}/{spec.id}: reference {ref_id} is missing; "
                          "manifest clock kept")
            return None
        return path, ref.clock

    def _get(self, refs: Any, what: str, on_death: Callable[[Exception], Any] | None = None) -> Any:
        """``ray.get``, with the death of an actor that holds run state reported as what it is
        (``on_death``: what to return instead, for an actor that can be resumed). A call that failed
        on an argument another actor's death left it raises that death (``RayActorError``), not this
        actor's."""
        import ray

        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(cause, ray.exceptions.RayActorError):
                # the call failed on an argument, the result of an actor that died (an ingest actor's
                # table): that actor's death, not this one's
                raise cause from None
            if on_death is not None:
                return on_death(exc)
            raise EnvironmentFaultError(f"{what} died ({type(exc).__name__}): the run cannot finish honestly; "
                                        "check the machine's memory and the Ray logs, then re-run") from None
        except ray.exceptions.RayTaskError as exc:
            # an actor that could not write its tables (OUT full or read-only): the machine's fault, said so
            cause = getattr(exc, "cause", None)
            if isinstance(cause, EnvironmentFaultError):
                raise EnvironmentFaultError(str(cause)) from None
            fault = write_fault(cause, Path(cause.filename or self.out)) if isinstance(cause, OSError) else None
            if fault is not None:
                raise fault from None
            raise

    # -- the aligner: calls logged in submission order, a restarted one resumed from that log --------
    def _align(self, st: _SessionState, entry: tuple, table: Any = None) -> Any:
        """Submit one aligner call, logged first (``pipeline.timeline``: the log a restarted aligner
        replays); ``entry`` is ``(method, source_id, ...)`` as ``TimelineWriter.resume`` reads it."""
        method, source_id, *args = entry
        with st.align_lock:
            st.align_log.append(entry)
            if method == "add":  # logged by the event part's file, sent with its table
                seq, _path, latency = args
                ref = st.aligner.add.remote(source_id, table, latency, seq)
            else:
                ref = getattr(st.aligner, method).remote(source_id, *args)
            st.align_refs[ref] = len(st.align_log) - 1
        return ref

    def _poll_aligner(self, st: _SessionState, src: _SourceStream) -> None:
        """Collect this stream's aligner calls that have answered (without waiting)."""
        import ray

        mine = [r for r in src.pending if r in st.align_refs]
        if not mine:
            return
        ready, _ = ray.wait(mine, num_returns=len(mine), timeout=0)
        if ready:
            gone = set(ready)
            src.pending = [r for r in src.pending if r not in gone]
            self._collect(st, ready)

    def _collect_aligner(self, st: _SessionState, refs: list) -> None:
        """Answers of aligner calls: a death or a ``NEEDS_RESUME`` answer resumes it (or fails the run)."""
        from modalign.pipeline.timeline import NEEDS_RESUME

        with st.align_lock:
            first = min(st.align_refs.pop(r) for r in refs)
        sid = st.session.manifest.session_id
        died: list[Exception] = []
        results = self._get(refs, f"the aligner of session {sid}", on_death=lambda exc: died.append(exc) or [])
        if died or any(isinstance(r, str) and r == NEEDS_RESUME for r in results):
            self._resume_aligner(st, died[0] if died else None, first)

    def _resume_aligner(self, st: _SessionState, cause: Exception | None, since: int) -> None:
        """Wait until the session's restarted aligner is up, then replay the log of calls to it
        (``cause``: the failed call, None: a call answered ``NEEDS_RESUME``; ``since``: the log index
        of the first call that failed). A dead aligner that Ray cannot restart any more fails the
        run here, as soon as it is noticed."""
        from modalign.pipeline.actors import ALIGNER_RESTARTS

        sid = st.session.manifest.session_id
        what = f"the aligner of session {sid}"
        with st.align_lock:
            for _ in range(ALIGNER_RESTARTS + 1):
                held = self._aligner_up(st, what)
                if not held and (cause is None or since < st.align_resumed_at):
                    return  # resumed already, with a log that holds the failed calls
                replay = list(st.align_log)
                res = self._get(st.aligner.resume.remote(replay), what, on_death=lambda exc: exc)
                if isinstance(res, Exception):  # it died again while replaying
                    cause = res
                    continue
                st.align_resumed_at = len(replay)
                self.progress(f"align {sid}: the aligner was restarted; resumed from its checkpoint after "
                              f"{res['restored_parts'] or 0} part(s), {res['replayed_parts']} event part(s) re-read "
                              "from OUT")
                return
        raise EnvironmentFaultError(f"{what} kept dying while it was resumed: check the machine's memory and the Ray "
                                    "logs, then re-run")

    @staticmethod
    def _aligner_up(st: _SessionState, what: str, timeout_s: float = 300.0) -> bool:
        """Wait until the aligner answers; whether it is held (restarted, waiting for its log)."""
        import ray

        from modalign.pipeline.actors import ALIGNER_RESTARTS

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return ray.get(st.aligner.held.remote(), timeout=max(1.0, deadline - time.monotonic()))
            except ray.exceptions.ActorUnavailableError:  # still restarting
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):  # restarts used up
                break
        raise EnvironmentFaultError(f"{what} died and cannot be restarted (at most {ALIGNER_RESTARTS} restarts): the "
                                    "run cannot finish honestly; check the machine's memory and the Ray logs, then "
                                    "re-run") from None

    def _finish_aligner(self, st: _SessionState) -> dict:
        """The session's last part and summary from its aligner (resumed first if it restarted)."""
        from modalign.pipeline.actors import ALIGNER_RESTARTS

        what = f"the aligner of session {st.session.manifest.session_id}"
        for _ in range(ALIGNER_RESTARTS + 2):
            res = self._get(st.aligner.finish.remote(), what, on_death=lambda exc: exc)
            if isinstance(res, dict):
                return res
            self._resume_aligner(st, res if isinstance(res, Exception) else None, len(st.align_log))
        raise EnvironmentFaultError(f"{what} kept restarting before it could finish; check the Ray logs, then re-run")

    def _collect(self, st: _SessionState, results: list) -> None:
        import ray

        refs = [r for r in results if isinstance(r, ray.ObjectRef)]
        results = [r for r in results if not isinstance(r, ray.ObjectRef)]
        with st.align_lock:
            align = [r for r in refs if r in st.align_refs]
        if align:
            self._collect_aligner(st, align)
            gone = set(align)
            refs = [r for r in refs if r not in gone]
        input_died = None
        for ref in refs:  # embedder calls: the embed actor holds the run's state
            try:
                results.append(self._get(ref, "the embed actor"))
            except ray.exceptions.RayActorError as exc:  # its table's ingest actor died (``_get``): raised
                input_died = input_died or exc  # once the other calls' files are counted
        for r in results:
            if isinstance(r, dict) and "granularities" in r:
                self.display.embed_done()
                with self._lock:
                    if "pid" in r:
                        self.embed_batches[r["pid"]] += 1
                    self.metrics.embedded(r)
                    for g, n in r["granularities"].items():
                        self.counts[f"features_{g}"] += n
                    st.files.update(r["files"])
        if input_died is not None:
            raise input_died

    def _write_session_tables(self, st: _SessionState) -> None:
        sid = st.session.manifest.session_id
        for path, row, rows in ((self.layout.quarantine(sid, self.attempt), QuarantineRow, st.quarantine),
                                (self.layout.lineage_sources(sid, self.attempt), SourceLineageRow, st.lineage)):
            with storage_faults(path):
                written = self.layout.write_table(path, rows_to_table(row, [r.model_dump(mode="json") for r in rows]))
            if written is not None:
                st.files.add(self.layout.relative(path))
        self.counts["quarantined"] += len(st.quarantine)
        for row in st.quarantine:
            self.metrics.quarantine(row.reason_code)

    def _summary(self, sessions, align, cache_stats, elapsed_s: float) -> dict:
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
            "indexes": [],  # filled in by the commit, which builds them
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


def stream_key(job: SourceJob) -> str:
    """How a progress display names one source stream (a video's range: ``range K/N``)."""
    key = f"{job.session_id}/{job.spec.id}"
    return key if job.range is None else f"{key} range {job.range.index + 1}/{job.range.count}"


def ranged_sha256(streams: list[_SourceStream]) -> str | None:
    """The sha256 of a source read in ranges (its planner hashed it whole), once a range ingested it."""
    return streams[0].job.range.sha256 if any(s.done is not None for s in streams) else None


def _source_bytes(job: SourceJob) -> int | None:
    """Size of a source: the listing's (an object), else its file's; None for a video's own sound
    track (its file is counted once) and for a file gone meanwhile."""
    if job.spec.track_of is not None:
        return None
    if getattr(job, "size", None) is not None:
        return job.size
    try:
        return Path(job.path).stat().st_size
    except (OSError, TypeError):
        return None


def _file_bytes(job: SourceJob) -> int | None:
    """Size of the file a source is read from (a video's own sound track: the video's file)."""
    if getattr(job, "size", None) is not None:
        return job.size
    try:
        return Path(job.path).stat().st_size
    except (OSError, TypeError):
        return None


def init_ray(rt: RuntimeConfig) -> int:
    """Join ``rt.address``, or start the local Ray (once per process); returns the cluster's CPUs."""
    import os

    import ray

    if ray.is_initialized():
        return int(ray.cluster_resources().get("CPU", 1))
    if rt.address:
        from modalign.pipeline.local_ray import join_ray

        join_ray(rt.address)
    else:  # loopback only, in the private temp folder, after reaping what killed runs left there
        from modalign.pipeline.local_ray import start_local_ray

        start_local_ray(rt.num_cpus or os.cpu_count() or 2, ray_temp_dir(rt.ray_temp_dir))
    return int(ray.cluster_resources().get("CPU", 1))


def build_indexes(layout: OutputLayout, feature_files: list[str], attempt: str,
                  monitors: EmbeddingMonitors | None = None) -> list[dict]:
    """One FAISS index per (model, granularity) of ``feature_files`` (relative to OUT); ids = feature_id.

    ``monitors``: handed each group's table as it is read, so the vectors are read once per commit."""
    import numpy as np

    from modalign.operators.cache.index import FeatureIndex

    built = []
    for (model, gran), files in sorted(layout.feature_groups(feature_files).items()):
        t = read_group(layout, files, MONITOR_COLUMNS if monitors is not None else ["feature_id", "vector", "dim"])
        if monitors is not None:
            monitors.observe_group((model, gran), t)
        if t.num_rows == 0:
            continue
        dim = t.column("dim")[0].as_py()
        vecs = np.asarray(t.column("vector").combine_chunks().flatten().to_numpy(), dtype=np.float32).reshape(-1, dim)
        index = FeatureIndex(dim)
        index.add(t.column("feature_id").to_numpy(), vecs)
        path = layout.index(model, gran, attempt)
        if layout.is_s3:
            layout.write_bytes(path, index.to_bytes())
        else:
            index.save(path)
        built.append({"model_id": model, "granularity": gran, "vectors": t.num_rows, "dim": dim,
                      "path": layout.relative(path)})
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
    source = input_path if isinstance(input_path, str) else Path(input_path)  # a path, or s3://bucket/prefix
    return Runner(resolve_config(config), out if isinstance(out, str) else Path(out), progress).run(source)

