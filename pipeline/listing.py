"""What ``modalign watch`` polls: a listing of INPUT as (key, version), and the sessions in it.

Where it sits: the first step of the watch loop (``modalign.pipeline.watch``). Each poll lists
INPUT (``Listing.list``: key -> ``Entry``), then turns the listing into ``Candidate`` sessions
(``Listing.sessions``), built exactly as ``modalign run`` builds them from a folder
(``discovery.folder_sessions``): each manifest, and each media file no manifest names as a
one-source session. A candidate's ``version`` is the set of (source URI, source version)
pairs that the runner will record in its lineage and quarantine rows, so the watch can
compare what it found with what OUT has committed, and nothing else.

``LocalListing`` serves a folder: a key is a path relative to it, a version
``schemas.files.stat_version`` (size and mtime). An object-store listing gives the object's
ETag and size as the version and its LastModified as ``modified_at``; it implements the same
two methods (and builds its candidates from its own key resolution).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Protocol

from modalign.pipeline.discovery import MANIFEST_SUFFIXES, Session, folder_sessions
from modalign.schemas.files import stat_version


@dataclass(frozen=True)
class Entry:
    """One listed object: its version, and when it last changed (None: unknown; the watch
    then counts its settle time from when it first saw this version)."""

    version: str
    modified_at: float | None = None


SourceVersion = tuple[str, "str | None"]  # (source URI, source version) as lineage rows record them


@dataclass(frozen=True)
class Candidate:
    """A session found in a listing.

    ``keys``: every object its readiness waits on (the manifest, its sources, and for a lone
    file the manifests beside or above it that could still claim it), each with its entry;
    ``version``: the (source URI, source version) pairs a run of it records; ``waiting_for``:
    why it cannot be processed yet, whatever its settle time (a source it names does not exist
    yet; a manifest beside a lone file is invalid and might be meant to claim it)."""

    session: Session
    keys: dict[str, Entry]
    version: frozenset[SourceVersion]
    waiting_for: tuple[str, ...] = ()
    origin: str = ""  # the key it was found by (manifest or lone file), for messages

    @property
    def session_id(self) -> str:
        return self.session.manifest.session_id


@dataclass
class Found:
    """The sessions of one listing, and the keys that could not become one (key -> why)."""

    candidates: list[Candidate] = field(default_factory=list)
    problems: dict[str, str] = field(default_factory=dict)


class Listing(Protocol):
    """The polled view of INPUT."""

    root: str  # how messages name INPUT (a folder, s3://bucket/prefix)

    def list(self) -> dict[str, Entry]:
        """Every object under the root: key (relative, ``/``-separated) -> entry."""

    def sessions(self, entries: dict[str, Entry], allowed_roots: tuple[Path, ...] = ()) -> Found:
        """The sessions in ``entries`` (one listing), as ``modalign run`` would find them."""


def _local_entry(path: str | os.PathLike) -> Entry | None:
    """The entry of a regular file (symlinks followed), or None when there is none."""
    try:
        st = os.stat(path)
    except OSError:  # gone, or a broken symlink
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return Entry(stat_version(path), st.st_mtime)


class LocalListing:
    """A local folder, walked the way ``discover`` walks it (symlinked folders not entered)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.path = Path(root).absolute()
        self.root = str(self.path)

    def list(self) -> dict[str, Entry]:
        found: dict[str, Entry] = {}
        for folder, _dirs, names in os.walk(self.path):
            for name in names:
                full = os.path.join(folder, name)
                entry = _local_entry(full)
                if entry is not None:
                    found[Path(full).relative_to(self.path).as_posix()] = entry
        return found

    def _key(self, path: Path) -> str:
        return path.relative_to(self.path).as_posix()

    def sessions(self, entries: dict[str, Entry], allowed_roots: tuple[Path, ...] = ()) -> Found:
        out = Found()

        def invalid(path: Path, exc) -> None:
            out.problems[self._key(path)] = exc.message

        sessions = folder_sessions([self.path / k for k in entries], tuple(allowed_roots), invalid)
        manifests = [k for k in entries if PurePosixPath(k).suffix.lower() in MANIFEST_SUFFIXES]
        for s in sessions:
            keys: dict[str, Entry] = {}
            waiting = []
            if s.manifest_path is not None:
                origin = self._key(s.manifest_path)
                keys[origin] = entries[origin]
            else:  # a lone file: it waits for the manifests that might still claim it to settle
                origin = self._key(s.base_dir / s.manifest.sources[0].uri)
                claimers = _claimers(origin, manifests)
                keys.update((k, entries[k]) for k in claimers)
                waiting += [f"the invalid manifest {k}" for k in claimers if k in out.problems]
            pairs: set[SourceVersion] = set()
            paths, refused = s.locate_all()
            for spec, _exc in refused:  # the runner quarantines it under the manifest's uri
                pairs.add((spec.uri, None))
            for spec in s.manifest.sources:
                path = paths.get(spec.id)
                if path is None:
                    continue
                entry = _local_entry(path)
                if entry is None:
                    waiting.append(f"its source {spec.uri}")
                    continue
                keys[path.as_uri()] = entry
                pairs.add((path.as_uri(), entry.version))
            out.candidates.append(Candidate(s, keys, frozenset(pairs), tuple(waiting), origin))
        return out


def _claimers(key: str, manifests: Iterable[str]) -> list[str]:
    """The manifest candidates in ``key``'s folder or above it (a manifest's sources lie in or
    under its own folder)."""
    folder = PurePosixPath(key).parent
    return [m for m in manifests if folder.is_relative_to(PurePosixPath(m).parent)]
