"""The quality expectations of one source stream (``schemas.config.QualityExpectation``), applied by
the ingest worker to each batch of events before they are written.

A record breaks an expectation when its property is below ``min`` or above ``max`` (a record without a
value never does). Per action:

- ``warn``: counted per expectation (``Verdict.counts``);
- ``drop``: the record is not written. Each expectation keeps its runs of consecutive breaking
  records of the stream open across batches, so that a run that crosses a batch boundary is one
  ``DroppedRun`` (one quarantine row), closed by the stream's next record that keeps the expectation
  or by its end (``finish``). A run spans ``start_t_ns`` (its first record's time) to ``end_t_ns``
  (its last record's ``end_t_ns`` where the table has one, as a text block's page does, else its
  ``t_ns``). A record is dropped when any drop expectation drops it; one that breaks two of them is
  in a run of each. The stream is what one worker outputs: a video cut into ranges
  (``ingest.video.range_s``) is one stream per range, so a run over a range border is one row per
  range; the borders depend on the file and the config only, so the rows are the same for any
  batching and any number of actors.
- ``fail``: the first breaking record is the ``Failure``; the worker stops the source there, and the
  run stops before its commit (``schemas.errors.QualityGateError``).

Ray-free and I/O-free: Arrow tables in, masks and small records out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from modalign.schemas.config import QualityExpectation
from modalign.schemas.tables import QUALITY_PROPERTIES


@dataclass
class DroppedRun:
    """Consecutive records of a stream that one ``drop`` expectation withheld."""

    index: int  # the expectation's index in ``quality.expectations``
    expectation: QualityExpectation
    start_t_ns: int
    end_t_ns: int | None
    records: int
    low: float  # the values' range in the run
    high: float

    def message(self) -> str:
        e = self.expectation
        return (f"{self.records} record(s) dropped: {e.property} {self.low:.4g}..{self.high:.4g} outside "
                f"{e.describe()} (quality.expectations[{self.index}], action drop); the timeline shows gaps "
                "there; fix the source or change the expectation, then re-run")


@dataclass(frozen=True)
class Failure:
    """The first record that broke a ``fail`` expectation."""

    index: int
    expectation: QualityExpectation
    value: float
    t_ns: int

    def message(self) -> str:
        e = self.expectation
        return (f"{e.property} = {self.value:.4g} at session time {self.t_ns / 1e9:.3f} s is outside "
                f"{e.describe()} (quality.expectations[{self.index}], action fail)")


@dataclass
class Verdict:
    """What the gate decided for one table."""

    keep: np.ndarray | None = None  # rows to write (None: all)
    closed: list[DroppedRun] = field(default_factory=list)  # drop runs that ended in this table
    failure: Failure | None = None


def property_values(table: pa.Table, column: tuple[str, ...]) -> np.ndarray:
    """float64 values of a property column (``("quality", name)`` or a top-level column); NaN where null
    or absent (a table written without the quality column)."""
    if column[0] not in table.column_names:
        return np.full(table.num_rows, np.nan)
    arr = table.column(column[0])
    for name in column[1:]:
        arr = pc.struct_field(arr, name)
    return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=np.float64)


class QualityGate:
    """The expectations of one modality over one stream of event tables, in order."""

    def __init__(self, expectations: Sequence[QualityExpectation], modality: str) -> None:
        self.modality = modality
        self.rules = [(i, e) for i, e in enumerate(expectations) if e.modality == modality]
        self.counts: dict[str, int] = {}  # "quality:ACTION:MODALITY:INDEX" -> records that broke it
        self._open: dict[int, DroppedRun] = {}  # expectation index -> its run still open at the last row

    @staticmethod
    def counter(action: str, modality: str, index: int) -> str:
        """The run.json counter of one expectation (``pipeline.quality.summary`` reads it back)."""
        return f"quality:{action}:{modality}:{index}"

    def check(self, table: pa.Table) -> Verdict:
        """The verdict on the next table of the stream (its rows in stream order)."""
        verdict = Verdict()
        n = table.num_rows
        if not self.rules or n == 0:
            return verdict
        t_ns = table.column("t_ns").to_numpy()
        ends = table.column("end_t_ns").to_pylist() if "end_t_ns" in table.column_names else None
        drop = np.zeros(n, dtype=bool)
        for i, e in self.rules:
            values = property_values(table, QUALITY_PROPERTIES[self.modality][e.property].column)
            with np.errstate(invalid="ignore"):
                bad = ((values < e.min) if e.min is not None else np.zeros(n, bool)) | \
                      ((values > e.max) if e.max is not None else np.zeros(n, bool))
            bad &= ~np.isnan(values)
            hits = int(bad.sum())
            if e.action == "fail":
                if hits:
                    k = int(np.argmax(bad))
                    self._count(e.action, i, 1)
                    verdict.failure = verdict.failure or Failure(i, e, float(values[k]), int(t_ns[k]))
                continue
            if hits:
                self._count(e.action, i, hits)
            if e.action == "drop":
                drop |= bad
                verdict.closed += self._runs(i, e, bad, values, t_ns, ends)
        if drop.any():
            verdict.keep = ~drop
        return verdict

    def finish(self) -> list[DroppedRun]:
        """The runs still open at the end of the stream, in expectation order."""
        runs = [self._open[i] for i in sorted(self._open)]
        self._open.clear()
        return runs

    def _count(self, action: str, index: int, n: int) -> None:
        key = self.counter(action, self.modality, index)
        self.counts[key] = self.counts.get(key, 0) + n

    def _runs(self, i: int, e: QualityExpectation, bad: np.ndarray, values: np.ndarray, t_ns: np.ndarray,
              ends: list | None) -> list[DroppedRun]:
        """Update expectation ``i``'s open run with this table's breaking rows; the runs that ended."""
        closed: list[DroppedRun] = []
        n = len(bad)
        edges = np.diff(np.r_[0, bad.astype(np.int8), 0])
        starts, stops = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)  # runs [a, b)
        if self._open.get(i) is not None and (len(starts) == 0 or starts[0] != 0):
            closed.append(self._open.pop(i))  # the table's first row keeps the expectation
        for a, b in zip(starts.tolist(), stops.tolist()):
            seg = values[a:b]
            end = ends[b - 1] if ends is not None else int(t_ns[b - 1])
            run = self._open.pop(i, None) if a == 0 else None
            if run is None:
                run = DroppedRun(i, e, int(t_ns[a]), end, 0, float(seg.min()), float(seg.max()))
            run.records += b - a
            run.end_t_ns = end
            run.low, run.high = min(run.low, float(seg.min())), max(run.high, float(seg.max()))
            if b == n:
                self._open[i] = run  # may go on in the next table
            else:
                closed.append(run)
        return closed
