"""One session's timeline written as the aligner decides it: numbered parts, a checkpoint after each.

Sits inside the pipeline's aligner actor (``pipeline.actors.AlignerActor``) around the Ray-free
``TickAligner`` (``operators.align.aligner``, ``retain=False``). Events arrive batch by batch;
whenever the watermarks allow ``align.part_s`` seconds of ticks, they are decided and written
as part N of ``records``, ``ctal`` (Parquet and JSON lines) and ``drift_alarms``
(``OutputLayout.records_part`` ...; an empty table has no file), then the aligner's state is
checkpointed (``OutputLayout.align_checkpoint``: ids, times and counters, no payload; never
committed, the sweep removes it). ``finish`` writes the last part and the one ``ctal_summary``
file. Nothing decided is kept in memory, so memory is flat however long the session.

Restart: a new instance loads the checkpoint (or starts empty) and is *held*: it answers
every call with ``NEEDS_RESUME`` and does nothing until ``resume(log)`` replays the driver's
log of calls (registrations, offsets, the event parts it sent, finished sources; the driver
submits calls in log order, so whatever a held instance ignored is in the log it replays).
Replayed event parts are re-read from their files in OUT; each has a per-source sequence
number, and the ones the checkpoint had consumed are skipped. Decisions depend only on which events
arrived, not when (``TickAligner``), so the resumed run writes the rows a clean one would;
a part rewritten after a crash has the same name and replaces the old file.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pyarrow as pa

from modalign.operators.align.aligner import TickAligner
from modalign.pipeline.layout import OutputLayout
from modalign.schemas.config import RunConfig
from modalign.schemas.errors import EnvironmentFaultError

NEEDS_RESUME = "needs-resume"  # what a held (restarted) aligner answers until the driver resumes it
CHECKPOINT_VERSION = 1


class _Consumed:
    """The sequence numbers of one source's event parts already added: a prefix and a few beyond it."""

    def __init__(self, n: int = 0, extra: list[int] | None = None) -> None:
        self.n = n
        self.extra = set(extra or ())

    def __contains__(self, seq: int) -> bool:
        return seq < self.n or seq in self.extra

    def add(self, seq: int) -> None:
        self.extra.add(seq)
        while self.n in self.extra:
            self.extra.discard(self.n)
            self.n += 1

    def state(self) -> list:
        return [self.n, sorted(self.extra)]


class TimelineWriter:
    """The streaming aligner of one session and the writer of its parts (see the module docstring)."""

    def __init__(self, session_id: str, config: RunConfig, layout: OutputLayout, attempt: str,
                 expected_sources: list[str], *, restarted: bool = False) -> None:
        self.session_id = session_id
        self.config = config
        self.layout = layout
        self.attempt = attempt
        self.part_ticks = max(1, round(config.align.part_s * config.align.tick_hz))
        self.checkpoint_path = layout.align_checkpoint(session_id, attempt)
        ckpt = self._load_checkpoint()
        if ckpt is None:
            trace = hashlib.sha256(f"{attempt}/{session_id}".encode()).hexdigest()[:32]  # same after a restart
            self.aligner = TickAligner(session_id, config.align, retain=False, trace_id=trace,
                                       expected_sources=expected_sources)
            self.parts, self.files, self.ctal_rows, self.drift_alarms = 0, [], 0, 0
            self.consumed: dict[str, _Consumed] = {}
        else:
            self.aligner = TickAligner.from_state(ckpt["aligner"], config.align)
            self.parts, self.files = int(ckpt["parts"]), list(ckpt["files"])
            self.ctal_rows, self.drift_alarms = int(ckpt["ctal_rows"]), int(ckpt["drift_alarms"])
            self.consumed = {s: _Consumed(n, extra) for s, (n, extra) in ckpt["consumed"].items()}
        self.restored_parts = self.parts if ckpt is not None else None
        self.held = restarted or ckpt is not None  # a checkpoint of this attempt: this is a restart

    # --- the aligner's inputs (each one idempotent, so the driver may replay them) ------------------

    def register(self, source_id: str, modality: str, lineage: dict, clock: Any) -> str | None:
        if self.held:
            return NEEDS_RESUME
        self.aligner.register(source_id, modality, lineage, clock)
        return None

    def observe_offsets(self, source_id: str, windows: list) -> int | str:
        if self.held:
            return NEEDS_RESUME
        return self.aligner.observe_offsets(source_id, windows)

    def add(self, source_id: str, events: pa.Table, latency_ms: float = 0.0, seq: int | None = None) -> int | str:
        """Add one event part (``seq``: its number in the source's stream; None: not deduplicated)."""
        if self.held:
            return NEEDS_RESUME
        done = self.consumed.setdefault(source_id, _Consumed())
        if seq is not None and seq in done:
            return 0
        n = self.aligner.add(source_id, events, latency_ms)
        if seq is not None:
            done.add(seq)
        self._advance()
        return n

    def finish_source(self, source_id: str, cut_short_at_ns: int | None = None) -> str | None:
        if self.held:
            return NEEDS_RESUME
        if cut_short_at_ns is not None:
            self.aligner.expect_until(source_id, cut_short_at_ns)
        self.aligner.finish_source(source_id)
        self._advance()
        return None

    def resume(self, log: list[tuple]) -> dict:
        """Replay the driver's log of calls after a restart (parts already consumed are skipped), then
        decide again. Log entries: ``("register", source_id, modality, lineage, clock)``,
        ``("observe_offsets", source_id, windows)``, ``("add", source_id, seq, path, latency_ms)``,
        ``("finish_source", source_id, cut_short_at_ns)``."""
        modality = {e[1]: e[2] for e in log if e[0] == "register"}
        replayed = 0
        for entry in log:
            kind, source_id, *args = entry
            if kind == "register":
                self.aligner.register(source_id, *args)
            elif kind == "observe_offsets":
                self.aligner.observe_offsets(source_id, *args)
            elif kind == "add":
                seq, path, latency_ms = args
                if seq in self.consumed.setdefault(source_id, _Consumed()):
                    continue
                self.aligner.add(source_id, self._read_events(path, modality.get(source_id)), latency_ms)
                self.consumed[source_id].add(seq)
                replayed += 1
            elif kind == "finish_source":
                cut = args[0]
                if cut is not None:
                    self.aligner.expect_until(source_id, cut)
                self.aligner.finish_source(source_id)
            else:
                raise ValueError(f"unknown aligner log entry {kind!r}")
        self.held = False
        self._advance()
        return dict(restored_parts=self.restored_parts, replayed_parts=replayed, parts=self.parts)

    # --- output ----------------------------------------------------------------------------------

    def finish(self) -> dict | str:
        """Decide the rest, write the last part and the summary; counts and every file written."""
        if self.held:
            return NEEDS_RESUME
        res = self.aligner.finish()
        self._write_part(res.records, res.ctal, res.alarms)
        lay, sid, a = self.layout, self.session_id, self.attempt
        files = list(self.files)
        if lay.write_table(lay.ctal_summary(sid, a), res.summary) is not None:
            files.append(lay.relative(lay.ctal_summary(sid, a)))
        summary = res.summary.to_pylist()
        return dict(ticks=res.ticks, ctal_rows=self.ctal_rows, drift_alarms=self.drift_alarms,
                    gaps=int(sum(r["gaps"] for r in summary)), summary=summary, files=files, parts=self.parts)

    def _advance(self) -> None:
        """Write a part when the watermarks allow ``part_s`` of ticks."""
        if self.aligner.ready_ticks() < self.part_ticks:
            return
        batch = self.aligner.poll()
        if self._write_part(batch.records, batch.ctal, batch.alarms):
            self._write_checkpoint()

    def _write_part(self, records: pa.Table, ctal: pa.Table, alarms: pa.Table) -> bool:
        """Part ``self.parts`` of each table (tables without rows have no file); False: nothing to write."""
        if not (records.num_rows or ctal.num_rows or alarms.num_rows):
            return False
        lay, sid, a, k = self.layout, self.session_id, self.attempt, self.parts
        written = [lay.write_table(lay.records_part(sid, a, k), records), lay.write_table(lay.ctal_part(sid, a, k), ctal),
                   lay.write_table(lay.drift_alarms_part(sid, a, k), alarms)]
        jsonl = lay.ctal_jsonl_part(sid, a, k)
        if ctal.num_rows:
            written.append(lay.write_jsonl(jsonl, ctal.to_pylist()))
        else:
            lay.delete(jsonl)  # a part rewritten after a restart may have had rows before
        self.files += [lay.relative(p) for p in written if p is not None]
        self.parts += 1
        self.ctal_rows += ctal.num_rows
        self.drift_alarms += alarms.num_rows
        return True

    # --- checkpoint --------------------------------------------------------------------------------

    def _write_checkpoint(self) -> None:
        state = dict(kind="align_checkpoint", version=CHECKPOINT_VERSION, session_id=self.session_id,
                     attempt=self.attempt, parts=self.parts, files=self.files, ctal_rows=self.ctal_rows,
                     drift_alarms=self.drift_alarms, consumed={s: c.state() for s, c in self.consumed.items()},
                     aligner=self.aligner.state())
        self.layout.write_jsonl(self.checkpoint_path, [state])

    def _load_checkpoint(self) -> dict | None:
        data = self.layout.read_bytes(self.checkpoint_path)
        if data is None:
            return None
        try:
            state = json.loads(data.decode("utf-8").splitlines()[0])
        except (UnicodeDecodeError, IndexError, json.JSONDecodeError) as exc:
            raise EnvironmentFaultError(f"the aligner checkpoint {self.layout.uri_of(self.checkpoint_path)} is "
                                        f"unreadable ({type(exc).__name__}); re-run the session") from None
        if state.get("version") != CHECKPOINT_VERSION or state.get("session_id") != self.session_id:
            raise EnvironmentFaultError(f"the aligner checkpoint {self.layout.uri_of(self.checkpoint_path)} is not "
                                        f"one of session {self.session_id} (version {CHECKPOINT_VERSION}); re-run it")
        return state

    def _read_events(self, rel: str, modality: str | None) -> pa.Table:
        """The aligner's columns of one event part in OUT (no payload column is read)."""
        import pyarrow.parquet as pq

        cols = ["event_id", "t_ns"] + (["end_t_ns"] if modality == "pdf" else [])
        path = self.layout.path(rel)
        try:
            return pq.read_table(str(path), columns=cols, filesystem=self.layout.fs)
        except OSError as exc:
            raise EnvironmentFaultError(f"cannot re-read the event part {self.layout.uri_of(path)} to resume the "
                                        f"aligner of session {self.session_id} ({exc}); re-run the session") from None
