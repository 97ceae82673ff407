"""The commit protocol of an output folder: what OUT holds is what its latest commit lists.

One protocol for every table and every writer (a batch run, a re-run, later streaming and
erasure), in the spirit of Delta Lake's log, with whole snapshots instead of actions::

    OUT/_modalign/commits/v00000000000000000007.json   the committed state, version 7

1. A writer holds the output's lease (``modalign.pipeline.lease``) for the whole attempt.
2. It writes new parts under names unique to the attempt (``layout.attempt_of(run_id)``
   in every file name), so nothing a reader of the current commit uses is touched.
3. It makes them durable (each file fsynced when written, their folders before the commit)
   and creates the next version's record, which lists exactly the files of the new state:
   per session (the sessions it wrote, replaced whole; the others carried over), plus the
   shared files (FAISS indexes) and the run summary. ``create`` is write-if-absent, so two
   writers can never both commit version N (an object store does it with ``If-None-Match``).
4. Only then it deletes the files of the previous commit that the new one does not list
   (parts of sources that are gone or got shorter, the last attempt's names).

Readers (``modalign.open``, ``inspect``, ``search``, ``cache``, the FAISS build) list files
from the latest commit only, so they see the old state or the new one, never a mix. A crash
at any point before step 3 leaves the previous commit intact and readable; whatever the
crashed attempt wrote is not listed anywhere, and the next writer's ``sweep`` removes it.
A reader still reading a previous commit's files when step 4 deletes them gets
``FileNotFoundError`` and re-opens the folder.
"""

from __future__ import annotations

import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from modalign.pipeline.objstore import open_store
from modalign.pipeline.store import Sequence, Store
from modalign.schemas.errors import ConfigError, OutputLockedError

LOG_PREFIX = "_modalign/commits"
FORMAT = 1
KEEP_RECORDS = 20  # commit records kept for audit (the files of older ones are gone)


@dataclass(frozen=True)
class Snapshot:
    """One committed state of an output folder (the record of one version)."""

    version: int
    run_id: str
    committed_at: str
    sessions: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> {"run_id", "files"}
    shared: tuple[str, ...] = ()  # files derived from every session (FAISS indexes)
    summary: dict[str, Any] = field(default_factory=dict)  # the run summary (run.json)
    # file -> "sha256:<hex>" of its bytes when it was committed (a store that cannot hash: none)
    digests: dict[str, str] = field(default_factory=dict)

    def files(self) -> set[str]:
        """Every file of the committed state, relative to OUT."""
        return {f for s in self.sessions.values() for f in s["files"]} | set(self.shared)

    def under(self, folder: str) -> list[str]:
        """The committed files inside ``folder`` (relative to OUT), sorted."""
        prefix = folder.rstrip("/") + "/"
        return sorted(f for f in self.files() if f.startswith(prefix))

    def to_json(self) -> bytes:
        """Compact (one line): a commit lists every file of OUT, and ``json`` encodes an indented
        document in pure Python, which at 1,000 sessions is 0.1 s of every erasure's commit."""
        return json.dumps({"format": FORMAT, "version": self.version, "run_id": self.run_id,
                           "committed_at": self.committed_at, "sessions": self.sessions,
                           "shared": list(self.shared), "summary": self.summary, "digests": self.digests},
                          separators=(",", ":"), sort_keys=True, default=str).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Snapshot":
        d = json.loads(data)
        if d.get("format", 0) > FORMAT:
            raise ConfigError(f"commit {d.get('version')} was written by a newer modalign (format {d['format']}, "
                              f"this one reads {FORMAT}); upgrade modalign to read or write this folder")
        return cls(version=d["version"], run_id=d["run_id"], committed_at=d["committed_at"],
                   sessions=d["sessions"], shared=tuple(d["shared"]), summary=d["summary"],
                   digests=d.get("digests", {}))


class CommitLog:
    """The versions of one output folder's state."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.records = Sequence(store, LOG_PREFIX, "v")

    @classmethod
    def of(cls, out: Path | str) -> "CommitLog":
        """The log of OUT, a folder or ``s3://bucket/prefix``."""
        return cls(open_store(out))

    def versions(self) -> list[int]:
        return self.records.numbers()

    def latest(self) -> Snapshot | None:
        """The committed state (None: nothing was ever committed here)."""
        versions = self.versions()
        if not versions:
            return None
        data = self.store.get(self.records.key(versions[-1]))
        return Snapshot.from_json(data) if data is not None else self.latest()  # pruned meanwhile

    def commit(self, parent: Snapshot | None, *, run_id: str, sessions: dict[str, dict[str, Any]],
               shared: list[str], summary: dict[str, Any]) -> Snapshot:
        """Create the version after ``parent``: ``sessions`` replace the parent's of the same id.

        The record keeps the sha256 of every file it lists: the parent's for the files it
        carries, and those of the new files, hashed here (they were just written, so this
        reads the page cache). An erasure report names the content of every file it leaves
        without reading 14,000 of them again.

        Raises ``OutputLockedError`` if another writer committed that version first (which
        the lease prevents; this is the last line of defence)."""
        merged = dict(parent.sessions) if parent else {}
        merged.update(sessions)
        snap = Snapshot(version=(parent.version if parent else 0) + 1, run_id=run_id,
                        committed_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        sessions=merged, shared=tuple(sorted(shared)), summary=summary)
        snap = replace(snap, digests=self._digests(snap, parent))
        if not self.store.create(self.records.key(snap.version), snap.to_json()):
            raise OutputLockedError(f"another writer committed version {snap.version} of {self.store.root} "
                                    "during this run; nothing of this run was committed: re-run")
        for old in self.versions()[:-KEEP_RECORDS]:
            self.store.delete(self.records.key(old))
        return snap

    def _digests(self, snap: Snapshot, parent: Snapshot | None) -> dict[str, str]:
        """The sha256 of each of ``snap``'s files: ``parent``'s where it had one, else hashed now
        (a file is never rewritten under its name: every writer names its files by attempt)."""
        known = parent.digests if parent else {}
        files = sorted(snap.files())
        new = [f for f in files if f not in known]
        with ThreadPoolExecutor(max_workers=4, thread_name_prefix="modalign-digest") as pool:
            hashed = dict(zip(new, pool.map(self.store.digest, new)))
        return {f: d for f in files if (d := known.get(f) or hashed.get(f))}


# Files a writer may remove in OUT: its own kinds only, never anything else a user keeps there.
_OURS = re.compile(r"(.*\.(parquet|jsonl|faiss)|\..*\.tmp)")


def sweep(root: Path | Store, keep: set[str], folders: list[str]) -> int:
    """Delete every file of ours in ``folders`` (relative to ``root``) that ``keep`` does not list:
    a crashed attempt's parts, temporary files, the previous commit's files. Empty folders go
    too. Only the lease holder may sweep. Returns the number of files removed.

    ``root`` is OUT's folder, or the ``S3Store`` of an s3:// OUT: there the objects under each
    folder are listed (any depth) and ours not in ``keep`` deleted; the other keys stay."""
    if not isinstance(root, (str, os.PathLike)):
        return _sweep_store(root, keep, folders)
    return sum(_sweep_folder(os.path.join(root, folder), folder.strip("/"), keep)[0] for folder in folders
               if os.path.isdir(os.path.join(root, folder)))


def _sweep_store(store: Any, keep: set[str], folders: list[str]) -> int:
    doomed = [key for folder in folders for key in store.walk(folder.strip("/"))
              if _OURS.fullmatch(key.rsplit("/", 1)[-1]) and key not in keep]
    for key in doomed:
        store.delete(key)
    return len(doomed)


def _sweep_folder(path: str, rel: str, keep: set[str]) -> tuple[int, bool]:
    """(files removed, whether the folder was left empty and removed) for one folder, depth first.
    ``os.scandir``, not ``Path.rglob``: an OUT of 1,000 sessions holds 14,000 files."""
    removed, left = 0, 0
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                n, gone = _sweep_folder(entry.path, f"{rel}/{entry.name}", keep)
                removed, left = removed + n, left + (not gone)
            elif _OURS.fullmatch(entry.name) and f"{rel}/{entry.name}" not in keep:
                try:
                    os.unlink(entry.path)
                    removed += 1
                except FileNotFoundError:
                    pass
            else:
                left += 1
    if left:
        return removed, False
    try:
        os.rmdir(path)
    except OSError:  # something appeared meanwhile
        return removed, False
    return removed, True
