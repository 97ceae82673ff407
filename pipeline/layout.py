"""The output folder: where each table lives, and atomic writes under attempt-unique names.

Each table has a folder of its own (the row model's ``PATH``, ``schemas.tables``). Every
file name carries the writing attempt (``attempt_of(run_id)``), so a run never overwrites a
file of the committed state: it writes beside it, commits, then removes what the new commit
no longer lists (``modalign.pipeline.commits``). Every write goes to a temporary name in the
same folder, fsynced and renamed into place, so a reader never sees half a file. Between
runs each folder holds exactly the committed files; during one, read through the commit
(``modalign.open``), not by listing folders.

    OUT/_modalign/commits/v….json                                   the commit log (the truth)
    OUT/_modalign/lease/out/g….json                                 the writer's lease
    OUT/run.json                                                    copy of the committed run summary
    OUT/events/{video,audio,pdf}/SESSION/SOURCE-ATTEMPT-PART.parquet   de-identified events
    OUT/records/SESSION/ATTEMPT.parquet                             aligned timeline: tick x source
    OUT/ctal/log/SESSION/ATTEMPT.parquet                            CTAL log (non-clean decisions)
    OUT/ctal/jsonl/SESSION/ATTEMPT.jsonl                            the same log as JSON lines
    OUT/ctal/summary/SESSION/ATTEMPT.parquet                        residual stats and offsets per source
    OUT/ctal/alarms/SESSION/ATTEMPT.parquet                         drift alarms
    OUT/features/MODEL/GRANULARITY/SESSION/SOURCE-ATTEMPT-PART.parquet   embeddings
    OUT/index/MODEL__GRANULARITY-ATTEMPT.faiss                      FAISS index (ids = features.feature_id)
    OUT/cache/                                                      content-addressed feature cache
    OUT/lineage/sources/SESSION/ATTEMPT.parquet                     per source: version, operators, policy, removals
    OUT/quarantine/SESSION/ATTEMPT.parquet                          rejected inputs and ranges, with reasons
"""

from __future__ import annotations

import errno
import json
import re
import secrets
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from modalign.schemas.errors import EnvironmentFaultError
from modalign.schemas.files import atomic_write
from modalign.schemas.tables import (ALL_TABLES, CtalRow, CtalSummaryRow, DriftAlarmRow, FeatureRow, QuarantineRow,
                                     RecordRow, SourceLineageRow, _Row)

TABLES: dict[str, type[_Row]] = {row.TABLE: row for row in ALL_TABLES}

_SAFE = re.compile(r"[^A-Za-z0-9_.@=-]+")


def safe_name(name: str) -> str:
    """A file-name-safe form of an id (model ids contain '@', kept)."""
    return _SAFE.sub("_", name)


def attempt_of(run_id: str) -> str:
    """The token of one run in its file names (unique per attempt, short enough to read)."""
    return run_id[:12]


@dataclass(frozen=True)
class OutputLayout:
    root: Path

    def table_dir(self, row: type[_Row] | str) -> Path:
        """The folder of one table (a row model or its ``TABLE`` name)."""
        return self.root / (TABLES[row] if isinstance(row, str) else row).PATH

    def relative(self, path: Path) -> str:
        """``path`` as the commit log names it: relative to OUT, with ``/``."""
        return Path(path).relative_to(self.root).as_posix()

    def events(self, row: type[_Row], session_id: str, source_id: str, attempt: str, part: int) -> Path:
        return self.events_dir(row, session_id) / f"{safe_name(source_id)}-{attempt}-{part:05d}.parquet"

    def events_dir(self, row: type[_Row], session_id: str) -> Path:
        return self.table_dir(row) / safe_name(session_id)

    def _per_session(self, row: type[_Row], session_id: str, attempt: str) -> Path:
        return self.table_dir(row) / safe_name(session_id) / f"{attempt}.parquet"

    def records(self, session_id: str, attempt: str) -> Path:
        return self._per_session(RecordRow, session_id, attempt)

    def ctal(self, session_id: str, attempt: str) -> Path:
        return self._per_session(CtalRow, session_id, attempt)

    def ctal_jsonl(self, session_id: str, attempt: str) -> Path:
        return self.root / CTAL_JSONL / safe_name(session_id) / f"{attempt}.jsonl"

    def ctal_summary(self, session_id: str, attempt: str) -> Path:
        return self._per_session(CtalSummaryRow, session_id, attempt)

    def drift_alarms(self, session_id: str, attempt: str) -> Path:
        return self._per_session(DriftAlarmRow, session_id, attempt)

    def features(self, model_id: str, granularity: str, session_id: str, source_id: str, attempt: str,
                 part: int) -> Path:
        return (self.table_dir(FeatureRow) / safe_name(model_id) / granularity / safe_name(session_id)
                / f"{safe_name(source_id)}-{attempt}-{part:05d}.parquet")

    def index(self, model_id: str, granularity: str, attempt: str) -> Path:
        return self.root / INDEX / f"{safe_name(model_id)}__{granularity}-{attempt}.faiss"

    @property
    def cache_dir(self) -> Path:
        return self.root / "cache"

    def lineage_sources(self, session_id: str, attempt: str) -> Path:
        return self._per_session(SourceLineageRow, session_id, attempt)

    def quarantine(self, session_id: str, attempt: str) -> Path:
        return self._per_session(QuarantineRow, session_id, attempt)

    @property
    def run_json(self) -> Path:
        return self.root / "run.json"

    @staticmethod
    def feature_groups(files: Iterable[str]) -> dict[tuple[str, str], list[str]]:
        """Feature files (relative to OUT: features/MODEL/GRANULARITY/SESSION/FILE) by (model folder,
        granularity), in the given order."""
        groups: dict[tuple[str, str], list[str]] = {}
        for f in files:
            _, model, gran, *_ = f.split("/")
            groups.setdefault((model, gran), []).append(f)
        return groups

    def data_folders(self) -> list[str]:
        """Every folder (relative to OUT) that holds committed files: the sweep's reach."""
        return sorted({row.PATH for row in TABLES.values()} | {CTAL_JSONL, INDEX})


CTAL_JSONL = "ctal/jsonl"
INDEX = "index"


WRITE_FAULTS = frozenset({errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EIO})


def check_writable(root: Path, min_free_bytes: int) -> None:
    """Fail before any work when OUT cannot take the run: read-only, not ours, or nearly full."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        name = f".modalign-write-probe-{secrets.token_hex(6)}"  # own name: two runs starting at once must not race
        probe = atomic_write(root / name, lambda tmp: Path(tmp).write_bytes(b"ok"))
        probe.unlink()
        free = shutil.disk_usage(root).free
    except OSError as exc:
        raise EnvironmentFaultError(f"the output folder {root} is not writable ({exc.strerror}); "
                                    "fix its mount or permissions, or choose another --out") from None
    if free < min_free_bytes:
        raise EnvironmentFaultError(f"the output folder {root} has {free // 2**20} MiB free, under "
                                    f"runtime.min_free_mb={min_free_bytes // 2**20}; free space or choose another --out")


def write_fault(exc: OSError, path: Path) -> EnvironmentFaultError | None:
    """The environment fault an OSError while writing ``path`` is (None: not a storage fault)."""
    if exc.errno not in WRITE_FAULTS:
        return None
    return EnvironmentFaultError(f"cannot write {path} ({exc.strerror}); the output folder is read-only, full or "
                                 "failing: fix it and re-run")


@contextmanager
def storage_faults(path: Path) -> Iterator[None]:
    """Re-raise an OSError of writing ``path`` as the ``EnvironmentFaultError`` it is (others as they are)."""
    try:
        yield
    except OSError as exc:
        fault = write_fault(exc, path)
        if fault is None:
            raise
        raise fault from None


def write_table(path: Path, table: pa.Table) -> Path:
    """Write Parquet (zstd) atomically; a table with no rows has no file (an earlier one is removed).

    Readers treat a missing file as no rows, but some refuse a 0-row Parquet file (Hugging
    Face datasets: "BatchSize must be greater than 0"), which would make the whole folder of a
    table unreadable for one session without drift alarms or quarantined inputs."""
    if table.num_rows == 0:
        path.unlink(missing_ok=True)
        return path
    return atomic_write(path, lambda tmp: pq.write_table(table, tmp, compression="zstd"))


def write_json(path: Path, obj: Any) -> Path:
    def w(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=True, default=str)
            f.write("\n")

    return atomic_write(path, w)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    def w(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, sort_keys=True, default=str) + "\n")

    return atomic_write(path, w)


def with_lineage(table: pa.Table, lineage: dict[str, Any], schema: pa.Schema) -> pa.Table:
    """Add constant lineage columns to ``table`` and cast it to the output ``schema``."""
    n = table.num_rows
    cols = []
    for field in schema:
        if field.name in table.column_names:
            cols.append(table.column(field.name).cast(field.type))
        elif field.name in lineage:
            cols.append(pa.array([lineage[field.name]] * n, type=field.type))
        elif field.nullable:  # an optional column the producing operator does not compute
            cols.append(pa.nulls(n, type=field.type))
        else:
            raise KeyError(f"column {field.name!r} missing for table {schema.metadata.get(b'table', b'?').decode()}")
    return pa.Table.from_arrays(cols, schema=schema)
