"""The output folder: where each table lives, and atomic writes under attempt-unique names.

Each table has a folder of its own (the row model's ``PATH``, ``schemas.tables``). Every
file name carries the writing attempt (``attempt_of(run_id)``), so a run never overwrites a
file of the committed state: it writes beside it, commits, then removes what the new commit
no longer lists (``modalign.pipeline.commits``). Every write goes to a temporary name in the
same folder, fsynced and renamed into place, so a reader never sees half a file. Between
runs each folder holds exactly the committed files; during one, read through the commit
(``modalign.open``), not by listing folders.

OUT may also be ``s3://bucket/prefix`` (``OutputLayout.of``): the same names, relative to the
prefix, as objects. Workers write them straight to the store (Parquet through the pyarrow S3
filesystem, JSON and FAISS bytes with one PUT); an object appears whole when its upload
completes, so there is no temporary name, and deletes go through ``S3Store`` (pyarrow's
``delete_file`` would leave "folder" marker objects behind). The layout's ``write_*`` methods
are the one way to write into OUT, local or not; the feature cache is not kept on S3
(``cache_dir`` is None there).

    OUT/_modalign/commits/v….json                                   the commit log (the truth)
    OUT/_modalign/lease/out/g….json                                 the writer's lease
    OUT/run.json                                                    copy of the committed run summary
    OUT/events/{video,audio,pdf}/SESSION/SOURCE-ATTEMPT-PART.parquet   de-identified events
    OUT/records/SESSION/ATTEMPT-PART.parquet                        aligned timeline: tick x source, in parts
    OUT/ctal/log/SESSION/ATTEMPT-PART.parquet                       CTAL log (non-clean decisions)
    OUT/ctal/jsonl/SESSION/ATTEMPT-PART.jsonl                       the same log as JSON lines
    OUT/ctal/summary/SESSION/ATTEMPT.parquet                        residual stats and offsets per source
    OUT/ctal/alarms/SESSION/ATTEMPT-PART.parquet                    drift alarms
    OUT/_modalign/checkpoints/align/SESSION/ATTEMPT.jsonl           aligner state after its last part (not committed)
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
from functools import cached_property
from os import PathLike
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from modalign.pipeline.objstore import Location, S3Options, open_store, s3_filesystem
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
    """Where each file of OUT lives. ``root`` is the folder (a ``Path``), or on object storage
    the pyarrow path of the prefix (``PurePosixPath("bucket/prefix")``, with ``location`` and the
    store ``options`` set); every path method returns a path under ``root`` of the same kind."""

    root: PurePath
    location: Location | None = None  # set when OUT is s3://bucket/prefix
    options: S3Options | None = None

    @classmethod
    def of(cls, out: "str | PathLike | Location", storage: Any = None) -> "OutputLayout":
        """The layout of OUT, a folder or ``s3://bucket/prefix``; ``storage`` is the run config's
        ``storage`` section (endpoint, retries), which reaches every worker with the config."""
        loc = out if isinstance(out, Location) else Location.parse(out if isinstance(out, str) else Path(out))
        if not loc.is_s3:
            assert loc.path is not None
            return cls(loc.path)
        return cls(PurePosixPath(loc.arrow_path()), loc, S3Options.from_config(storage) if storage else None)

    @property
    def is_s3(self) -> bool:
        return self.location is not None

    @property
    def where(self) -> "Path | str":
        """OUT as every process can reach it: an absolute folder, or ``s3://bucket/prefix``
        (workers run in other folders, and on other nodes)."""
        return self.location.uri if self.location is not None else Path(self.root).absolute()

    @property
    def uri(self) -> str:
        """OUT as a user names it (a folder, or ``s3://bucket/prefix``)."""
        return self.location.uri if self.location is not None else str(self.root)

    def uri_of(self, path: PurePath) -> str:
        """A path of this layout as a user names it (``s3://bucket/key`` on object storage)."""
        return f"s3://{path}" if self.is_s3 else str(path)

    @cached_property
    def fs(self) -> Any:
        """The pyarrow filesystem of OUT (None for a local folder: pyarrow's default)."""
        return s3_filesystem(self.location, self.options) if self.location is not None else None

    @cached_property
    def store(self) -> Any:
        """OUT's ``Store`` (``S3Store`` or ``LocalStore``): the commit log, the lease, deletes on S3."""
        return open_store(self.location if self.location is not None else Path(self.root), self.options)

    def path(self, rel: str) -> PurePath:
        """The path of ``rel`` (relative to OUT, as the commit log names files)."""
        return self.root / rel

    def table_dir(self, row: type[_Row] | str) -> PurePath:
        """The folder of one table (a row model or its ``TABLE`` name)."""
        return self.root / (TABLES[row] if isinstance(row, str) else row).PATH

    def relative(self, path: PurePath | str) -> str:
        """``path`` as the commit log names it: relative to OUT, with ``/``."""
        return type(self.root)(path).relative_to(self.root).as_posix()

    def events(self, row: type[_Row], session_id: str, source_id: str, attempt: str, part: int) -> PurePath:
        return self.events_dir(row, session_id) / f"{safe_name(source_id)}-{attempt}-{part:05d}.parquet"

    def events_dir(self, row: type[_Row], session_id: str) -> PurePath:
        return self.table_dir(row) / safe_name(session_id)

    def _per_session(self, row: type[_Row], session_id: str, attempt: str) -> PurePath:
        return self.table_dir(row) / safe_name(session_id) / f"{attempt}.parquet"

    def records(self, session_id: str, attempt: str) -> PurePath:
        return self._per_session(RecordRow, session_id, attempt)

    def ctal(self, session_id: str, attempt: str) -> PurePath:
        return self._per_session(CtalRow, session_id, attempt)

    def ctal_jsonl(self, session_id: str, attempt: str) -> PurePath:
        return self.root / CTAL_JSONL / safe_name(session_id) / f"{attempt}.jsonl"

    def ctal_summary(self, session_id: str, attempt: str) -> PurePath:
        return self._per_session(CtalSummaryRow, session_id, attempt)

    def drift_alarms(self, session_id: str, attempt: str) -> PurePath:
        return self._per_session(DriftAlarmRow, session_id, attempt)

    # The timeline in parts, written as the aligner's watermarks advance (``pipeline.timeline``).
    def _part(self, row: type[_Row], session_id: str, attempt: str, part: int) -> PurePath:
        return self.table_dir(row) / safe_name(session_id) / f"{attempt}-{part:05d}.parquet"

    def records_part(self, session_id: str, attempt: str, part: int) -> PurePath:
        return self._part(RecordRow, session_id, attempt, part)

    def ctal_part(self, session_id: str, attempt: str, part: int) -> PurePath:
        return self._part(CtalRow, session_id, attempt, part)

    def ctal_jsonl_part(self, session_id: str, attempt: str, part: int) -> PurePath:
        return self.root / CTAL_JSONL / safe_name(session_id) / f"{attempt}-{part:05d}.jsonl"

    def drift_alarms_part(self, session_id: str, attempt: str, part: int) -> PurePath:
        return self._part(DriftAlarmRow, session_id, attempt, part)

    def align_checkpoint(self, session_id: str, attempt: str) -> PurePath:
        """The aligner's state after its last written part (never committed; the sweep removes it)."""
        return self.root / ALIGN_CHECKPOINTS / safe_name(session_id) / f"{attempt}.jsonl"

    def features(self, model_id: str, granularity: str, session_id: str, source_id: str, attempt: str,
                 part: int) -> PurePath:
        return (self.table_dir(FeatureRow) / safe_name(model_id) / granularity / safe_name(session_id)
                / f"{safe_name(source_id)}-{attempt}-{part:05d}.parquet")

    def monitor(self, row: type[_Row], attempt: str) -> PurePath:
        """A monitor's table of one commit (``EmbeddingWindowRow``, ``MonitorAlarmRow``): rebuilt by every commit."""
        return self.table_dir(row) / f"{attempt}.parquet"

    def index(self, model_id: str, granularity: str, attempt: str) -> PurePath:
        return self.root / INDEX / f"{safe_name(model_id)}__{granularity}-{attempt}.faiss"

    @property
    def cache_dir(self) -> Path | None:
        """The feature cache's folder; None on object storage, where there is none (a re-run into
        an s3:// OUT recomputes its features; the cache is a folder store of local files)."""
        return None if self.is_s3 else Path(self.root) / "cache"

    def lineage_sources(self, session_id: str, attempt: str) -> PurePath:
        return self._per_session(SourceLineageRow, session_id, attempt)

    def quarantine(self, session_id: str, attempt: str) -> PurePath:
        return self._per_session(QuarantineRow, session_id, attempt)

    @property
    def run_json(self) -> PurePath:
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
        """Every folder (relative to OUT) that holds committed files, and the aligner's checkpoints
        (never committed): the sweep's reach."""
        return sorted({row.PATH for row in TABLES.values()} | {CTAL_JSONL, INDEX, ALIGN_CHECKPOINTS})

    # -- writing and reading OUT's files (local: atomic rename + fsync; S3: one upload each) --------
    def write_table(self, path: PurePath, table: pa.Table) -> PurePath | None:
        """Write Parquet (zstd); returns ``path``, or None when ``table`` has no rows (no file:
        ``write_table`` says why)."""
        if not self.is_s3:
            write_table(Path(path), table)
            return path if table.num_rows else None
        if table.num_rows == 0:
            self.delete(path)
            return None
        with self._s3_faults(path, "write"):
            pq.write_table(table, str(path), filesystem=self.fs, compression="zstd")
        return path

    def write_json(self, path: PurePath, obj: Any) -> PurePath:
        return write_json(Path(path), obj) if not self.is_s3 else self.write_bytes(path, json_bytes(obj))

    def write_jsonl(self, path: PurePath, rows: list[dict]) -> PurePath:
        return write_jsonl(Path(path), rows) if not self.is_s3 else self.write_bytes(path, jsonl_bytes(rows))

    def write_bytes(self, path: PurePath, data: bytes) -> PurePath:
        """Write ``data`` whole (atomically, fsynced, locally; one PUT on S3)."""
        if not self.is_s3:
            return atomic_write(Path(path), lambda tmp: Path(tmp).write_bytes(data))
        self.store.put(self.relative(path), data)  # EnvironmentFaultError naming bucket and endpoint
        return path

    def read_bytes(self, path: PurePath) -> bytes | None:
        """The bytes of one file of OUT (None: there is none)."""
        if self.is_s3:
            return self.store.get(self.relative(path))
        try:
            return Path(path).read_bytes()
        except FileNotFoundError:
            return None

    def exists(self, path: PurePath) -> bool:
        if self.is_s3:
            from pyarrow import fs

            with self._s3_faults(path, "read"):
                return self.fs.get_file_info(str(path)).type == fs.FileType.File
        return Path(path).is_file()

    def size(self, path: PurePath) -> int | None:
        """Bytes of one file of OUT (None: there is none)."""
        if self.is_s3:
            with self._s3_faults(path, "read"):
                info = self.fs.get_file_info(str(path))
            return info.size if info.is_file else None
        try:
            return Path(path).stat().st_size
        except FileNotFoundError:
            return None

    def delete(self, path: PurePath) -> None:
        if self.is_s3:
            self.store.delete(self.relative(path))
        else:
            Path(path).unlink(missing_ok=True)

    def check_writable(self, min_free_bytes: int) -> None:
        """Fail before any work when OUT cannot take the run (``check_writable``; on S3 a probe
        object put and deleted through both clients the run uses, and the conditional-write check
        the commit log and the lease rely on). ``EnvironmentFaultError`` names bucket and endpoint."""
        if not self.is_s3:
            return check_writable(Path(self.root), min_free_bytes)
        probe = self.path(f".modalign-write-probe-{secrets.token_hex(6)}")
        self.store.put(self.relative(probe), b"ok")  # boto3: the commit log, the lease, deletes
        self.store.delete(self.relative(probe))
        with self._s3_faults(probe, "write"):  # pyarrow: the workers' Parquet
            with self.fs.open_output_stream(str(probe)) as f:
                f.write(b"ok")
        self.store.delete(self.relative(probe))
        self.store.ensure_conditional_writes()

    def faults(self, path: PurePath, op: str = "write") -> Any:
        """A context in which a storage error of ``op`` on ``path`` is raised as the
        ``EnvironmentFaultError`` it is (``storage_faults`` locally; pyarrow's S3 errors on S3)."""
        return self._s3_faults(path, op) if self.is_s3 else storage_faults(Path(path))

    @contextmanager
    def _s3_faults(self, path: PurePath, op: str) -> Iterator[None]:
        """pyarrow's S3 errors (``OSError`` with the AWS error name) as the ``EnvironmentFaultError``
        they are, naming the object, bucket and endpoint (never a credential)."""
        try:
            yield
        except OSError as exc:
            m = re.search(r"AWS Error ([A-Z_]+)", str(exc))
            what = m.group(1) if m else type(exc).__name__
            endpoint = (self.options or S3Options()).resolved_endpoint() or "the AWS S3 endpoint"
            assert self.location is not None
            hint = {"NO_SUCH_BUCKET": f"bucket {self.location.bucket} does not exist there: create it, or check --out",
                    "ACCESS_DENIED": "the credentials were refused: check the AWS credentials (environment, profile, "
                                     "role) and that they may use this bucket",
                    "NETWORK_CONNECTION": "the endpoint cannot be reached: is it right and up?"}.get(
                what, "fix the store or the location, then re-run")
            raise EnvironmentFaultError(f"cannot {op} {self.uri_of(path)} on {endpoint} (bucket "
                                        f"{self.location.bucket}): {what}; {hint}") from None


CTAL_JSONL = "ctal/jsonl"
INDEX = "index"
ALIGN_CHECKPOINTS = "_modalign/checkpoints/align"


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


def json_bytes(obj: Any) -> bytes:
    """How OUT's JSON files read: indented, sorted keys, one trailing newline."""
    return (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode("utf-8")


def jsonl_bytes(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, sort_keys=True, default=str) + "\n" for r in rows).encode("utf-8")


def write_json(path: Path, obj: Any) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(json_bytes(obj)))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(jsonl_bytes(rows)))


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
