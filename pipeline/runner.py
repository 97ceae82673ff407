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
import os
import platform
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


from modalign.operators.ingest.base import SourceContext, file_version
from modalign.pipeline.discovery import Session, discover
from modalign.schemas.errors import ConfigError
from modalign.pipeline.layout import OutputLayout, write_json, write_table
from modalign.schemas.arrow import rows_to_table
from modalign.schemas.config import RunConfig
from modalign.schemas.tables import QuarantineRow, SourceLineageRow

log = logging.getLogger("modalign")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_QUARANTINED = 3  # the run completed, some inputs (or ranges) were quarantined


def default_key_store() -> Path:
    return Path(os.environ.get("MODALIGN_KEY_STORE", Path.home() / ".modalign" / "keys"))


@dataclass
class _SessionState:
    session: Session
    aligner: Any
    quarantine: list[dict] = field(default_factory=list)
    lineage: list[dict] = field(default_factory=list)


@dataclass
class _SourceJob:
    """State of one source's ingest stream on the driver."""

    ctx: SourceContext
    started: float
    lineage: dict
    events: int = 0
    part: int = 0
    pending: list = field(default_factory=list)
    lineage_row: dict | None = None
    clock: Any = None  # ClockMapping when estimated/verified in the worker
    windows: list = field(default_factory=list)
    registered: bool = False


class Runner:
    def __init__(self, config: RunConfig, out: Path, progress: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.out = Path(out)
        self.layout = OutputLayout(self.out)
        self.progress = progress or (lambda msg: log.info(msg))
        self.key_store = Path(config.key_store) if config.key_store else default_key_store()
        if self.key_store.resolve().is_relative_to(self.out.resolve()):
            raise ConfigError("key_store must be outside the output folder (pseudonym keys are never outputs)")
        self.run_id = uuid.uuid4().hex
        self._lock = threading.Lock()
        self.counts: Counter = Counter()

    # -- Ray ---------------------------------------------------------------------------
    def _init_ray(self) -> int:
        import ray

        rt = self.config.runtime
        if ray.is_initialized():
            return int(ray.cluster_resources().get("CPU", 1))
        if rt.address:
            ray.init(address=rt.address, log_to_driver=False)
        else:
            temp = str(rt.ray_temp_dir) if rt.ray_temp_dir else os.environ.get("RAY_TMPDIR")
            ray.init(num_cpus=rt.num_cpus or os.cpu_count() or 2, include_dashboard=False, log_to_driver=False,
                     configure_logging=False, _temp_dir=temp)
        return int(ray.cluster_resources().get("CPU", 1))

    # -- the run -----------------------------------------------------------------------
    def run(self, input_path: Path) -> dict:
        import ray

        from modalign.operators.embed.device import embed_actor_resources
        from modalign.pipeline.actors import AlignerActor, EmbedActor, IngestActor

        started = time.time()
        sessions = discover(Path(input_path))  # ConfigError before any work
        self.out.mkdir(parents=True, exist_ok=True)
        self.key_store.mkdir(parents=True, exist_ok=True, mode=0o700)
        cpus = self._init_ray()
        n_ingest = self.config.runtime.ingest_actors or max(1, cpus - 1)
        cfg_json = self.config.model_dump_json()
        self.progress(f"run {self.run_id[:8]}: {len(sessions)} session(s), {n_ingest} ingest actor(s), {cpus} CPU(s)")

        ingest_actors = [IngestActor.options(num_cpus=1).remote(cfg_json, str(self.out), str(self.key_store))
                         for _ in range(n_ingest)]
        gpu = embed_actor_resources(self.config.embed.device, ray.cluster_resources().get("GPU", 0))
        embedder = EmbedActor.options(num_cpus=1 if cpus > 1 else 0, **gpu).remote(cfg_json, str(self.out))

        states: list[_SessionState] = []
        jobs: list[tuple[_SessionState, SourceContext]] = []
        for s in sessions:
            st = _SessionState(s, aligner=None)
            states.append(st)
            ctxs = [c for c in (self._context(st, spec) for spec in s.manifest.sources) if c is not None]
            st.aligner = AlignerActor.options(num_cpus=0).remote(
                s.manifest.session_id, cfg_json, str(self.out), [c.spec.id for c in ctxs])
            jobs += [(st, c) for c in ctxs]

        with ThreadPoolExecutor(max_workers=n_ingest) as pool:
            futures = [pool.submit(self._ingest_one, st, ctx, ingest_actors[i % n_ingest], embedder)
                       for i, (st, ctx) in enumerate(jobs)]
            for f in futures:
                f.result()

        align = {}
        for st in states:
            sid = st.session.manifest.session_id
            align[sid] = ray.get(st.aligner.finish.remote())
            self.counts["ticks"] += align[sid]["ticks"]
            self.counts["gaps"] += align[sid]["gaps"]
            self.counts["ctal_rows"] += align[sid]["ctal_rows"]
            self.counts["drift_alarms"] += align[sid]["drift_alarms"]
            self._write_session_tables(st)
            self.progress(f"align {sid}: {align[sid]['ticks']} ticks, {align[sid]['gaps']} gaps, "
                          f"{align[sid]['drift_alarms']} drift alarm(s)")
        cache_stats = ray.get(embedder.flush.remote())
        indexes = build_indexes(self.layout)
        for a in ingest_actors + [embedder] + [st.aligner for st in states]:
            ray.kill(a)

        summary = self._summary(sessions, align, cache_stats, indexes, time.time() - started)
        write_json(self.layout.run_json, summary)
        return summary

    def _context(self, st: _SessionState, spec) -> SourceContext | None:
        s = st.session
        path = s.resolve(spec)
        uri = s.source_uri(spec)
        problem = None
        if not path.is_file():
            problem = ("missing", "file not found; check the manifest's uri")
        elif path.stat().st_size == 0:
            problem = ("empty", "file is empty (0 bytes)")
        elif path.stat().st_size > self.config.ingest.max_file_bytes:
            problem = ("limit_exceeded", f"file is larger than ingest.max_file_bytes={self.config.ingest.max_file_bytes}")
        version = file_version(path) if problem is None or problem[0] == "limit_exceeded" else None
        if problem:
            self.progress(f"quarantine {uri}: {problem[1]}")
            st.quarantine.append(dict(session_id=s.manifest.session_id, source_id=spec.id, source_uri=uri,
                                      source_version=version, stage="discover", reason_code=problem[0],
                                      message=problem[1]))
            return None
        return SourceContext(session_id=s.manifest.session_id, spec=spec, path=path, uri=uri, version=version)

    def _ingest_one(self, st: _SessionState, ctx: SourceContext, actor, embedder) -> None:
        """Stream one source through an ingest actor, forwarding its items (runs in a driver thread)."""
        import ray

        m = st.session.manifest
        job = _SourceJob(ctx, started=time.perf_counter(), lineage=dict(
            session_id=ctx.session_id, source_id=ctx.spec.id, source_uri=ctx.uri, source_version=ctx.version,
            operators="", policy=self.config.policy.tag, model_id=None))
        limit = self.config.runtime.max_in_flight
        try:
            stream = actor.ingest.options(num_returns="streaming").remote(
                ctx, m.tenant, tuple(m.subjects), self._reference(st, ctx))
            for ref in stream:
                kind, payload = ray.get(ref)
                if kind == "embed":  # the next item is the payload table itself: forward its ref unread
                    modality, n = payload
                    payload = (modality, next(stream), n)
                self._route(st, job, kind, payload, embedder)
                if len(job.pending) > limit:  # backpressure: at most `limit` downstream calls in flight
                    done, job.pending = ray.wait(job.pending, num_returns=len(job.pending) - limit)
                    self._collect(done)
        except ray.exceptions.RayError as exc:  # the worker died mid-source: quarantine, keep the run going
            self._route(st, job, "quarantine", dict(
                session_id=ctx.session_id, source_id=ctx.spec.id, source_uri=ctx.uri, source_version=ctx.version,
                stage=f"ingest/{ctx.spec.modality}", reason_code="worker_failed",
                message=f"ingest worker failed ({type(exc).__name__}); re-run to retry"), embedder)
        if job.registered:  # no more events from this source: its ticks can be decided
            job.pending.append(st.aligner.finish_source.remote(ctx.spec.id))
        self._collect(ray.get(job.pending))
        row = job.lineage_row or dict(job.lineage, modality=ctx.spec.modality, status="quarantined",
                                      events=job.events, deid=[], subjects=list(m.subjects))
        clock = job.clock or ctx.spec.clock
        row.update(clock_offset_ns=clock.offset_ns, clock_skew_ppm=clock.skew_ppm,
                   clock_method="estimated" if clock.estimated else "manifest", clock_reference=clock.reference)
        with self._lock:
            row["run_id"] = self.run_id
            st.lineage.append(row)
            self.counts[f"events_{ctx.spec.modality}"] += job.events
            for h in row["deid"]:
                self.counts[removed_kind(ctx.spec.modality, h)] += h["count"]
        self.progress(f"ingest {ctx.session_id}/{ctx.spec.id} ({ctx.spec.modality}): {job.events} events, "
                      f"{row['status']}")

    def _route(self, st: _SessionState, job: "_SourceJob", kind: str, payload: Any, embedder) -> None:
        """Forward one ingest item: metadata to the aligner, payload to the embedder, rows to the driver."""
        ctx = job.ctx
        if kind == "clock":  # the mapping the source was ingested with, and measured window offsets
            job.clock, job.windows = payload
            if job.clock.estimated:
                self.progress(f"clock {ctx.session_id}/{ctx.spec.id}: offset {job.clock.offset_ns / 1e6:+.1f} ms, "
                              f"skew {job.clock.skew_ppm:+.1f} ppm (estimated against {job.clock.estimate_from})")
        elif kind == "source":  # the lineage columns every row of this source carries
            job.lineage = payload
            clock = job.clock or ctx.spec.clock
            job.pending.append(st.aligner.register.remote(ctx.spec.id, ctx.spec.modality, payload, clock))
            if job.windows:
                job.pending.append(st.aligner.observe_offsets.remote(ctx.spec.id, job.windows))
            job.registered = True
        elif kind == "meta":
            job.events += payload.num_rows
            latency = (time.perf_counter() - job.started) * 1e3
            job.pending.append(st.aligner.add.remote(ctx.spec.id, payload, latency))
        elif kind == "embed":
            modality, table_ref, n = payload
            if n:
                job.pending.append(embedder.embed.remote(modality, table_ref, job.lineage, job.part))
                job.part += 1
        elif kind == "quarantine":
            self.progress(f"quarantine {payload['source_uri']}: [{payload['reason_code']}] {payload['message']}")
            with self._lock:
                st.quarantine.append(payload)
        elif kind == "lineage":
            job.lineage_row = payload

    def _reference(self, st: _SessionState, ctx: SourceContext) -> tuple[Path, Any] | None:
        """(path, clock) of the source this one's clock is estimated or verified against."""
        ref_id = ctx.spec.clock.reference
        if ref_id is None:
            return None
        ref = next(s for s in st.session.manifest.sources if s.id == ref_id)
        path = st.session.resolve(ref)
        if not path.is_file():
            self.progress(f"clock {ctx.session_id}/{ctx.spec.id}: reference {ref_id} is missing; manifest clock kept")
            return None
        return path, ref.clock

    def _collect(self, results: list) -> None:
        import ray

        refs = [r for r in results if isinstance(r, ray.ObjectRef)]
        if refs:
            results = [r for r in results if not isinstance(r, ray.ObjectRef)] + ray.get(refs)
        for r in results:
            if isinstance(r, dict) and "granularities" in r:
                with self._lock:
                    for g, n in r["granularities"].items():
                        self.counts[f"features_{g}"] += n

    def _write_session_tables(self, st: _SessionState) -> None:
        sid = st.session.manifest.session_id
        write_table(self.layout.quarantine(sid), rows_to_table(QuarantineRow, st.quarantine))
        rows = [{k: r[k] for k in SourceLineageRow.model_fields} for r in st.lineage]
        write_table(self.layout.lineage_sources(sid), rows_to_table(SourceLineageRow, rows))
        self.counts["quarantined"] += len(st.quarantine)

    def _summary(self, sessions, align, cache_stats, indexes, elapsed_s: float) -> dict:
        from importlib.metadata import version

        from modalign.operators.base import REGISTRY

        c = self.counts
        return {
            "run_id": self.run_id,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "elapsed_s": round(elapsed_s, 2),
            "counts": {
                "sessions": len(sessions),
                "ticks": c["ticks"],
                "events": {m: c[f"events_{m}"] for m in ("video", "audio", "pdf")},
                "gaps": c["gaps"],
                "ctal_rows": c["ctal_rows"],
                "drift_alarms": c["drift_alarms"],
                "faces_blurred": c["faces_blurred"],
                "pii_replaced": c["pii_replaced"],
                "frame_text_blurred": c["frame_text_blurred"],
                "features": {g: c[f"features_{g}"] for g in ("frame", "roi", "patch")},
                "cache": {k: cache_stats[k] for k in ("hits", "misses", "hit_rate")},
                "quarantined": c["quarantined"],
            },
            "alignment": {sid: a["summary"] for sid, a in align.items()},
            "indexes": indexes,
            "versions": {
                "modalign": version("modalign"),
                "python": platform.python_version(),
                "policy": self.config.policy.tag,
                "operators": {k: op.version for k, op in sorted(REGISTRY.items())},
                **{p: version(p) for p in ("ray", "torch", "pyarrow", "av", "faiss-cpu")},
            },
            "config": self.config.model_dump(mode="json"),
            "exit_code": EXIT_QUARANTINED if c["quarantined"] else EXIT_OK,
        }


def removed_kind(modality: str, header: dict) -> str:
    """The run.json counter a de-identification header adds to."""
    if modality == "video":
        return "faces_blurred" if header["detector"].startswith("mediapipe") else "frame_text_blurred"
    if modality == "pdf":
        return "pii_replaced"
    return "voice_" + header["method"]


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


def run(input_path: Path, out: Path, config: RunConfig | None = None, progress=None) -> dict:
    return Runner(config or RunConfig(), out, progress).run(input_path)

