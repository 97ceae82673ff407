"""The ingest worker: decode one source and de-identify it, inside one process.

This is the body of the Ray ingest actor (``modalign.pipeline.actors``) but knows nothing
about Ray, so it runs in tests in-process. Raw payload (pixels, waveform, OCR text) exists
only between the source operator and the de-identification chain of this process; what
leaves (the yielded items and the event files) is de-identified. Which operators run,
what is stored and what is embedded comes from the modality's plan
(``modalign.operators.modalities``); the items it yields are ``modalign.pipeline.items``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from modalign.operators.ingest.audio import AudioRange
from modalign.operators.ingest.base import SourceContext
from modalign.operators.ingest.video import VideoRange
from modalign.operators.modalities import DeidContext, ModalityPlan, plan_for
from modalign.operators.quality.gate import DroppedRun, Failure, QualityGate
from modalign.pipeline.discovery import ObjectPath
from modalign.pipeline.items import (ClockItem, DoneItem, EmbedItem, FaultItem, Item, MetaItem, QuarantineItem,
                                     SourceItem, SourceJob)
from modalign.pipeline.layout import OutputLayout, attempt_of, storage_faults, with_lineage
from modalign.schemas.config import RunConfig
from modalign.schemas.errors import ComplianceError, EnvironmentFaultError, InputError, QuarantineReason
from modalign.schemas.files import MemoryFile, SeekableHashingReader, sha256_file
from modalign.schemas.manifest import ClockMapping
from modalign.schemas.tables import DeidHeader, LineageColumns, QuarantineRow, SourceLineageRow
from modalign.schemas.units import NS_PER_S

log = logging.getLogger(__name__)

HEADER_COLUMNS = ("deid", "text_deid")  # de-identification header columns an event table may carry
PARTS_PER_RANGE = 10_000  # event parts of one video range (at 32 frames a part: 3.5 h of 25 fps)


def sample_every(t_ns: np.ndarray, fps: float, state: dict) -> np.ndarray:
    """Mask keeping the first event at or after each 1/fps step (state carries across batches)."""
    step = int(round(NS_PER_S / fps))
    keep = np.zeros(len(t_ns), dtype=bool)
    nxt = state.get("next")
    for i, t in enumerate(t_ns.tolist()):
        if nxt is None or t >= nxt:
            keep[i] = True
            nxt = (t // step + 1) * step
    state["next"] = nxt
    return keep


def rows_where(table: pa.Table, mask: np.ndarray) -> pa.Table:
    """The rows of ``table`` where ``mask`` holds: the table itself when it holds everywhere, a
    zero-copy slice when it holds on one run of rows (a video range's own frames in a batch),
    else a filtered copy. A batch of frames is ~16 MB of pixels: filtering copied every one."""
    hits = np.flatnonzero(mask)
    if hits.size == len(mask):
        return table
    if hits.size and hits[-1] - hits[0] + 1 == hits.size:
        return table.slice(int(hits[0]), int(hits.size))
    return table.filter(pa.array(mask))


def quarantine_row(job: SourceJob, version: str | None, exc: InputError | ComplianceError) -> QuarantineRow:
    """The quarantine row of an error raised while ingesting ``job``'s source."""
    return QuarantineRow(
        session_id=job.session_id, source_id=job.spec.id, source_uri=job.uri, source_version=version,
        stage=exc.stage or f"ingest/{job.spec.modality}", reason_code=exc.code, message=exc.message,
        start_t_ns=getattr(exc, "start_t_ns", None), end_t_ns=getattr(exc, "end_t_ns", None))


def quality_row(job: SourceJob, what: DroppedRun | Failure) -> QuarantineRow:
    """The quarantine row of a run of records a ``drop`` expectation withheld, or of the record that
    broke a ``fail`` expectation (``operators.quality.gate``): source, expectation, session times."""
    if isinstance(what, Failure):
        return QuarantineRow(
            session_id=job.session_id, source_id=job.spec.id, source_uri=job.uri, source_version=job.version,
            stage="quality", reason_code=QuarantineReason.QUALITY_FAILED, start_t_ns=what.t_ns, end_t_ns=what.t_ns,
            message=what.message() + "; the source was stopped there and the run stops before its commit")
    return QuarantineRow(
        session_id=job.session_id, source_id=job.spec.id, source_uri=job.uri, source_version=job.version,
        stage="quality", reason_code=QuarantineReason.QUALITY_EXPECTATION, start_t_ns=what.start_t_ns,
        end_t_ns=what.end_t_ns, message=what.message())


def source_lineage(job: SourceJob, policy: str, operators: str = "") -> LineageColumns:
    """The lineage columns every row of ``job``'s source carries."""
    return LineageColumns(session_id=job.session_id, source_id=job.spec.id, source_uri=job.uri,
                          source_version=job.version, operators=operators, policy=policy)


def lineage_row(job: SourceJob, lineage: LineageColumns, clock: ClockMapping, *, status: str, events: int = 0,
                deid: list[DeidHeader] | None = None, sha256: str | None = None) -> SourceLineageRow:
    """The ``lineage/sources`` row of one source: what it is, how it was timed, what was removed."""
    return SourceLineageRow(
        run_id=job.run_id, session_id=job.session_id, source_id=job.spec.id, source_uri=job.uri,
        source_version=lineage.source_version, modality=job.spec.modality, status=status, events=events,
        operators=lineage.operators, policy=lineage.policy, deid=deid or [], subjects=list(job.subjects),
        clock_offset_ns=clock.offset_ns, clock_skew_ppm=clock.skew_ppm,
        clock_method="estimated" if clock.estimated else "manifest", clock_reference=clock.reference,
        track_of=job.spec.track_of, source_sha256=sha256)


class _EmbedBatcher:
    """The payload of consecutive batches, handed on in ``EmbedItem``s of ``limits[0]`` rows (or
    once it holds ``limits[1]`` bytes), the rest by ``flush``; ``limits`` None hands each batch's
    payload on at once (``ModalityPlan.embed_batch``). A batch whose schema differs (a stream that
    changed its frame size) first hands on what was gathered."""

    def __init__(self, modality: str, limits: tuple[int, int] | None) -> None:
        self.modality, self.limits = modality, limits
        self.tables: list[pa.Table] = []
        self.rows = self.bytes = 0

    def add(self, payload: pa.Table) -> Iterator[EmbedItem]:
        if payload.num_rows == 0:
            return
        if self.tables and payload.schema != self.tables[0].schema:
            yield from self.flush()
        self.tables.append(payload)
        self.rows += payload.num_rows
        self.bytes += payload.nbytes
        if self.limits is None or self.bytes >= self.limits[1]:
            yield from self.flush()
        elif self.rows >= self.limits[0]:
            table, n = pa.concat_tables(self.tables), self.limits[0]
            full = table.num_rows // n * n
            for start in range(0, full, n):
                yield EmbedItem(self.modality, n, table.slice(start, n))
            rest = table.slice(full)
            self.tables, self.rows, self.bytes = ([rest] if rest.num_rows else []), rest.num_rows, rest.nbytes

    def flush(self) -> Iterator[EmbedItem]:
        if not self.tables:
            return
        table = self.tables[0] if len(self.tables) == 1 else pa.concat_tables(self.tables)
        self.tables, self.rows, self.bytes = [], 0, 0
        yield EmbedItem(self.modality, table.num_rows, table)


class IngestWorker:
    """Holds the ingest and de-identification operators of one actor (models loaded once)."""

    def __init__(self, config: RunConfig, out_root: Path | str, key_store_dir: Path) -> None:
        self.config = config
        self.layout = OutputLayout.of(out_root, config.storage)  # a folder or s3://bucket/prefix
        self.key_store_dir = Path(key_store_dir)
        self._chains: dict[tuple[str, str], list[Any]] = {}
        self._openers: dict[str, Any] = {}  # bucket -> object_reader.ObjectOpener

    def chain(self, modality: str, tenant: str = "default") -> list[Any]:
        """The source operator and de-identification chain of a modality, built once per tenant."""
        key = (modality, tenant)
        if key not in self._chains:
            plan, ctx = plan_for(modality), DeidContext(self.config, tenant, self.key_store_dir)
            self._chains[key] = [plan.source(ctx)] + [build(ctx) for build in plan.deid]
        return self._chains[key]

    # -- one source -----------------------------------------------------------------------
    def ingest(self, job: SourceJob) -> Iterator[Item]:
        """Ingest one source: clock, lineage columns, then batches of metadata and payload."""
        plan = plan_for(job.spec.modality)
        ops = self.chain(plan.name, job.tenant)
        clock = job.spec.clock
        lineage = source_lineage(job, self.config.policy.tag, ";".join(op.tag for op in ops))
        if job.roots and not any(job.path.resolve().is_relative_to(r) for r in job.roots):  # swapped since
            err = InputError("the source now resolves outside the input root (a symlink changed since discovery); "
                             "it was not read", source_uri=job.uri, stage="read",
                             code=QuarantineReason.PATH_OUTSIDE_ROOT)
            yield QuarantineItem(quarantine_row(job, job.version, err))
            yield DoneItem(lineage_row(job, lineage, clock, status="quarantined"))
            return
        on_store = isinstance(job.path, ObjectPath)
        reader: Any = None
        memory: MemoryFile | None = None
        try:  # an object is opened first (gone, or the store unreachable?), a local file probed first
            if on_store:
                reader, memory = self._open_object(plan, job)
            has_stream, end_local_ns = self._probe(plan, job)
        except InputError as err:  # the object is gone, changed, or too large to hold
            self._close(reader, memory)
            if job.spec.track_of is None:  # a video's own sound shares the video's row
                yield QuarantineItem(quarantine_row(job, job.version, err))
            yield DoneItem(lineage_row(job, lineage, clock, status="quarantined"))
            return
        except EnvironmentFaultError as exc:
            self._close(reader, memory)
            yield FaultItem(exc.message)
            return
        if job.spec.track_of is not None and not has_stream:
            self._close(reader, memory)
            yield DoneItem(lineage_row(job, lineage, clock, status="no_stream"))
            return
        try:  # the decoder reads the source through this reader, which hashes it on the way: one read
            if not on_store:
                reader = SeekableHashingReader(job.path) if plan.reads_stream else None
        except OSError as exc:  # vanished or unreadable since discovery
            err = InputError(f"cannot read the source ({exc.strerror})", source_uri=job.uri, stage="read",
                             code=QuarantineReason.FILE_MISSING)
            yield QuarantineItem(quarantine_row(job, job.version, err))
            yield DoneItem(lineage_row(job, lineage, clock, status="quarantined"))
            return
        path = memory.path if memory is not None else (None if on_store else job.path)
        ctx = SourceContext(session_id=job.session_id, spec=job.spec, path=path, uri=job.uri,
                            version=job.version, reader=reader, window=job.range)
        if job.range is not None and not job.range.last:  # this worker's part ends where the next begins
            end_local_ns = job.range.end_local_ns
        try:
            if job.reference is not None:
                ctx, clock_item = self._clock(ctx, job.path, *job.reference)
                clock = clock_item.mapping
                yield clock_item
            yield SourceItem(lineage, None if end_local_ns is None else ctx.clock.to_session(end_local_ns))
            events, status, deid, counts = yield from self._batches(job, plan, ops, ctx, lineage)
            sha256 = job.range.sha256 if job.range is not None else self._content_hash(job, reader, memory)
        except EnvironmentFaultError as exc:
            yield FaultItem(exc.message)
            return
        finally:
            self._close(reader, memory)
        yield DoneItem(lineage_row(job, lineage, clock, status=status, events=events, sha256=sha256,
                                   deid=[DeidHeader(**h) for h in deid.values()]), counts)

    def _batches(self, job: SourceJob, plan: ModalityPlan, ops: list[Any], ctx: SourceContext,
                 lineage: LineageColumns) -> Generator[Item, None, tuple[int, str, dict, dict[str, int]]]:
        """Decode, de-identify, gate, store and hand on every batch; returns (events, status, deid, counters).

        The quality expectations (``quality.expectations``, ``operators.quality.gate``) see each batch's
        own rows before they are written: ``drop`` withholds records (a ``quality_expectation`` row per
        contiguous run), ``fail`` stops the source at its first breaking record (a ``quality_failed``
        row, which makes the runner stop before its commit), ``warn`` is counted."""
        events, status = 0, "ingested"
        part = 0 if job.range is None else job.range.index * PARTS_PER_RANGE  # part names stay apart and in order
        deid: dict[tuple[str, str], dict] = {}
        counts: dict[str, int] = {}
        sampler: dict = {}
        columns = lineage.model_dump()
        gate = QualityGate(self.config.quality.expectations, plan.name)
        payloads = _EmbedBatcher(plan.name, plan.embed_batch(self.config))
        dropped = 0
        failure = None
        stream = self._deidentified(ops, ctx)
        try:
            t = time.perf_counter()
            for decoded in stream:
                # The embedding sampler sees a range's overlap too, so it stands where a whole decode would.
                sampled = self._embed_mask(plan, decoded, sampler)
                owned = self._owned(job, decoded)
                clean = decoded if owned is None else rows_where(decoded, owned)
                if owned is not None and sampled is not None:
                    sampled = sampled[owned]
                if clean.num_rows == 0:
                    continue
                verdict = gate.check(clean)
                for run in verdict.closed:
                    yield QuarantineItem(quality_row(job, run))
                if verdict.failure is not None:
                    failure = verdict.failure
                    break  # closes the stream: what the operators held back is withheld
                if verdict.keep is not None:
                    dropped += int(np.count_nonzero(~verdict.keep))
                    clean = rows_where(clean, verdict.keep)
                    if sampled is not None:
                        sampled = sampled[verdict.keep]
                    if clean.num_rows == 0:
                        t = time.perf_counter()
                        continue
                self._count(plan, clean, deid, counts)
                stored = with_lineage(plan.to_events(clean, self.config), columns, plan.event_row.schema())
                path = self.layout.events(plan.event_row, job.session_id, job.spec.id, attempt_of(job.run_id), part)
                with storage_faults(path):  # OUT read-only or full: the machine's fault, not the input's
                    self.layout.write_table(path, stored)
                part += 1
                events += clean.num_rows
                yield MetaItem(clean.select(list(plan.meta_columns)), self.layout.relative(path),
                               time.perf_counter() - t)
                payload = (clean if sampled is None else clean.filter(pa.array(sampled))).select(list(plan.embed_columns))
                yield from payloads.add(payload)
                t = time.perf_counter()
        except EnvironmentFaultError:
            raise
        except (InputError, ComplianceError) as exc:
            status = "partial" if events else "quarantined"
            yield QuarantineItem(quarantine_row(job, job.version, exc))
        except Exception as exc:  # an operator bug must not end the run; nothing raw in the message
            log.exception("internal error ingesting %s", job.uri)
            status = "partial" if events else "quarantined"
            err = InputError(f"internal error ({type(exc).__name__}); see the worker log", source_uri=job.uri,
                             stage=f"ingest/{plan.name}", code=QuarantineReason.INTERNAL_ERROR)
            yield QuarantineItem(quarantine_row(job, job.version, err))
        finally:
            stream.close()
        yield from payloads.flush()  # what was stored is embedded, wherever the stream ended
        for run in gate.finish():  # runs still open at the end of the stream (or where it broke off)
            yield QuarantineItem(quality_row(job, run))
        if failure is not None:
            yield QuarantineItem(quality_row(job, failure))
        if failure is not None or dropped:
            status = "partial" if events else "quarantined"
        counts.update(gate.counts)
        return events, status, deid, counts

    @staticmethod
    def _deidentified(ops: list[Any], ctx: SourceContext) -> Iterator[pa.Table]:
        """Each decoded batch through the de-identification chain, then, at the end of the
        stream, what the operators held back for look-ahead (``flush()``, e.g. frame text)
        through the rest of the chain. A source error (damage) ends the stream: what came
        before it is still flushed, then the error is raised. After any other error the
        operators ``reset()``: what they held is withheld, never written raw."""
        batches = iter(ops[0].read(ctx))
        source_error: InputError | None = None
        try:
            while True:
                try:
                    raw = next(batches)
                except StopIteration:
                    break
                except InputError as exc:  # the source is damaged from here: flush what came before
                    source_error = exc
                    break
                transform = getattr(ops[0], "waveform_transform", None)
                if transform is not None:  # tells the voice policy the MFCCs are of anonymised speech
                    from modalign.operators.deid.voice import mark_transformed

                    raw = mark_transformed(raw, transform)
                clean = raw
                for op in ops[1:]:  # the de-identification operators of this modality, in order
                    clean = op.process(clean)
                del raw  # the raw batch ends here, in this process
                yield clean
            # end of stream: held-back rows, in order (a video range that is not the last ends in a cut)
            window = getattr(ctx, "window", None)
            cut = window is not None and not window.last and source_error is None
            for k, op in enumerate(ops[1:], start=2):
                for held in (op.flush(cut=True) if cut else op.flush()):  # (an operator of before cut: flush())
                    for later in ops[k:]:
                        held = later.process(held)
                    yield held
        except BaseException:
            for op in ops[1:]:
                op.reset()
            raise
        if source_error is not None:
            raise source_error

    @staticmethod
    def _content_hash(job: SourceJob, reader: SeekableHashingReader | None,
                      memory: MemoryFile | None = None) -> str | None:
        """``sha256:<hex>`` of the source: from the decoder's read, the copy in memory, or (tools
        read the path) apart."""
        try:
            if memory is not None:
                return "sha256:" + memory.hexdigest()
            return "sha256:" + (reader.hexdigest() if reader is not None else sha256_file(job.path))
        except (OSError, InputError, EnvironmentFaultError):  # gone while it was processed: content unknown
            log.warning("could not hash %s after reading it", job.uri)
            return None

    @staticmethod
    def _close(reader: Any, memory: MemoryFile | None) -> None:
        if reader is not None:
            reader.close()
        if memory is not None:
            memory.close()

    def _opener(self, bucket: str) -> Any:
        from modalign.pipeline.object_reader import ObjectOpener
        from modalign.pipeline.objstore import S3Options

        if bucket not in self._openers:
            self._openers[bucket] = ObjectOpener(bucket, S3Options.from_config(self.config.storage))
        return self._openers[bucket]

    def _open_object(self, plan: ModalityPlan, job: SourceJob) -> tuple[SeekableHashingReader | None,
                                                                         MemoryFile | None]:
        """Open an object-store source: a hashing reader over ranged GETs for a decoder, or (tools
        read a path) a copy in anonymous memory; see ``pipeline.object_reader``."""
        from modalign.pipeline.object_reader import etag_of

        path, etag = job.path, etag_of(job.version)
        assert isinstance(path, ObjectPath)
        opener = self._opener(path.bucket)
        if plan.reads_stream:
            return SeekableHashingReader(opener=lambda: opener.open(path, etag)), None
        cap = self.config.ingest.max_object_memory_bytes
        if job.size is not None and job.size > cap:  # refused before any byte is read
            from modalign.schemas.errors import LimitExceededError

            raise LimitExceededError(
                f"the object is {job.size} bytes, over ingest.max_object_memory_bytes={cap}: a document on object "
                "storage is held in memory (never on disk) while its tools read it; raise the limit or split it",
                source_uri=job.uri, stage="read", code=QuarantineReason.LIMIT_EXCEEDED)
        return None, opener.in_memory(path, cap, etag)

    def _source_file(self, source: "Path | ObjectPath") -> tuple[Path | None, Any]:
        """(path, reader) to decode ``source`` apart from the ingest read (probe, clock reference)."""
        if isinstance(source, ObjectPath):
            return None, self._opener(source.bucket).open(source, block_bytes=2**20)
        return source, None

    def _probe(self, plan: ModalityPlan, job: SourceJob) -> tuple[bool, int | None]:
        """(has the stream, local ns where it ends) from the container header; documents: (True, None)."""
        from modalign.operators.ingest._av import probe_stream

        if not plan.reads_stream:
            return True, None
        path, reader = self._source_file(job.path)
        return probe_stream(reader if reader is not None else path, plan.name)

    def _decode_audio(self, source: "Path | ObjectPath", rate: int) -> tuple[np.ndarray, int]:
        from modalign.operators.ingest.audio import decode_audio

        path, reader = self._source_file(source)
        uri = source.as_uri() if isinstance(source, ObjectPath) else None
        return decode_audio(path, rate, reader=reader, uri=uri)

    def _clock(self, ctx: SourceContext, source: "Path | ObjectPath", ref_path: "Path | ObjectPath",
               ref_clock: ClockMapping) -> tuple[SourceContext, ClockItem]:
        """Estimate (or verify) the source's clock against a reference recording, in this process.

        The decoded audio of both stays here; only the mapping and window offsets leave. If no
        offset can be found, the manifest's mapping is kept and no windows are reported.
        """
        from modalign.operators.align.offset import estimate_offset

        clock, rate = ctx.spec.clock, self.config.ingest.audio.sample_rate_hz
        try:
            ref, ref_start = self._decode_audio(ref_path, rate)
            other, other_start = self._decode_audio(source, rate)
            est = estimate_offset(ref, other, rate, ref_start_ns=ref_start, other_start_ns=other_start,
                                  ref_clock=ref_clock, source_uri=ctx.uri)
            del ref, other
        except InputError as exc:
            log.warning("clock of %s not estimated against %s: %s", ctx.uri, ref_path.name, exc.message)
            return ctx, ClockItem(clock, [])
        if clock.estimate_from:
            clock = est.clock_mapping(estimate_from=clock.estimate_from)
            ctx = replace(ctx, spec=ctx.spec.model_copy(update={"clock": clock}))
        return ctx, ClockItem(clock, est.observations())

    @staticmethod
    def _count(plan: ModalityPlan, table: pa.Table, deid: dict, counts: dict[str, int]) -> None:
        """Sum the de-identification headers per method and detector, and into run.json counters."""
        for col in HEADER_COLUMNS:
            if col not in table.column_names:
                continue
            for h in table.column(col).to_pylist():
                agg = deid.setdefault((h["method"], h["detector"]), dict(h, count=0))
                agg["count"] += h["count"]
                hit = plan.counter(col, h, 1)
                if hit is not None:
                    counts[hit[0]] = counts.get(hit[0], 0) + hit[1]

    def _embed_mask(self, plan: ModalityPlan, clean: pa.Table, sampler: dict) -> np.ndarray | None:
        """Which rows are embedded (None: all of them)."""
        fps = plan.embed_fps(self.config)
        if fps is None:
            return None
        return sample_every(clean.column("t_ns").to_numpy(), fps, sampler)

    @staticmethod
    def _owned(job: SourceJob, clean: pa.Table) -> np.ndarray | None:
        """Which rows are this job's to output: a video range's own frames, not its overlap (None: all)."""
        return None if job.range is None else job.range.rows_owned(clean)

    def ranges(self, job: SourceJob, parts: int) -> list[VideoRange] | list[AudioRange]:
        """The ranges several workers can process ``job``'s source in ([]: whole): a video's
        (``video_ranges``), or an audio stream's when ``parts`` (the ingest actors) is 2 or more."""
        if job.spec.modality == "audio":
            return self.audio_ranges(job, parts)
        return self.video_ranges(job)

    def audio_ranges(self, job: SourceJob, parts: int) -> list[AudioRange]:
        """Up to ``parts`` ranges of ``job``'s audio stream (``ingest.audio.range_min_s``), each with the
        whole file's sha256; [] when it is processed whole: short, splitting off, one part, a clock
        estimated from its content, on object storage (every range reads the stream from its start),
        or not a stream this can plan (the ingest then reports what is wrong with it)."""
        from modalign.operators.ingest.audio import plan_ranges

        cfg = self.config.ingest.audio
        if (cfg.range_min_s is None or parts < 2 or job.spec.modality != "audio" or job.reference is not None
                or isinstance(job.path, ObjectPath)):
            return []
        return self._planned(job, lambda container: plan_ranges(container, cfg, parts, cfg.range_min_s))

    def video_ranges(self, job: SourceJob) -> list[VideoRange]:
        """The ranges several workers can decode ``job``'s video in (``ingest.video.range_s``), each
        with the whole file's sha256; [] when it is decoded whole: short, splitting off, a clock
        estimated from its content, on object storage (a second whole read), keyframes only, or
        not a video this can plan (the ingest then reports what is wrong with it)."""
        from modalign.operators.ingest.video import plan_ranges

        cfg = self.config.ingest.video
        if (cfg.range_s is None or job.spec.modality != "video" or job.spec.track_of is not None
                or job.reference is not None or cfg.keyframes_only or isinstance(job.path, ObjectPath)):
            return []
        return self._planned(job, lambda container: plan_ranges(container, cfg.range_s, cfg.range_overlap_s)
                             if container.streams.video else [])

    @staticmethod
    def _planned(job: SourceJob, plan: Callable[[Any], list]) -> list:
        """``plan(container)``'s ranges of ``job``'s file, each with the whole file's sha256 (read on the
        way, the rest after); [] when it makes none or the file cannot be planned (its whole decode then
        reports what is wrong with it)."""
        from modalign.operators.ingest._av import open_container

        try:
            with SeekableHashingReader(job.path) as reader:
                with open_container(job.path, job.uri, stage="plan", reader=reader) as container:
                    ranges = plan(container)
                if not ranges:
                    return []
                sha256 = "sha256:" + reader.hexdigest()  # reads only what the demuxer did not
        except (InputError, OSError, ValueError) as exc:
            log.info("%s is processed whole: it could not be planned (%s)", job.uri, type(exc).__name__)
            return []
        except Exception:  # noqa: BLE001 -- PyAV errors: the whole decode reports them as input errors
            log.info("%s is processed whole: it could not be planned", job.uri, exc_info=True)
            return []
        return [replace(r, sha256=sha256) for r in ranges]
