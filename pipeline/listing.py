"""What ``modalign watch`` polls: a listing of INPUT as (key, version), and the sessions in it.

Where it sits: the first step of the watch loop (``modalign.pipeline.watch``). Each poll lists
INPUT (``Listing.list``: key -> ``Entry``), then turns the listing into ``Candidate`` sessions
(``Listing.sessions``), built exactly as ``modalign run`` builds them from a folder
(``discovery.folder_sessions``): each manifest, and each media file no manifest names as a
one-source session. A candidate's ``version`` is the set of (source URI, source version)
pairs that the runner will record in its lineage and quarantine rows, so the watch can
compare what it found with what OUT has committed, and nothing else.

``LocalListing`` serves a folder: a key is a path relative to it, a version
``schemas.files.stat_version`` (size and mtime). ``S3Listing`` serves ``s3://bucket/prefix``:
a key is relative to the prefix, a version ``etag:<ETag>:<size>`` (``object_version``) and
``modified_at`` the object's LastModified, from ``ListObjectsV2`` pages alone; a manifest is
read by GET once per version (cached), a media object never. Both build their candidates
with the same code (``_FolderListing.sessions``) over ``discovery.folder_sessions``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Protocol

from modalign.pipeline.discovery import MANIFEST_SUFFIXES, ObjectPath, Session, SourcePath, folder_sessions
from modalign.pipeline.objstore import Location, S3Options, S3Store
from modalign.schemas.files import stat_version
from modalign.schemas.load import MAX_FILE_BYTES


@dataclass(frozen=True)
class Entry:
    """One listed object: its version, and when it last changed (None: unknown; the watch
    then counts its settle time from when it first saw this version)."""

    version: str
    modified_at: float | None = None
    size: int | None = None  # bytes, where the listing says (object storage)


def object_version(etag: str, size: int) -> str:
    """An object's version as lineage records it: its ETag (quotes stripped) and size."""
    return f"etag:{etag.strip(chr(34))}:{size}"


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


class _FolderListing:
    """What both listings share: a listing's candidates, built from ``folder_sessions``."""

    def _files(self, entries: dict[str, Entry]) -> list[SourcePath]:
        raise NotImplementedError

    def _key(self, path: SourcePath) -> str:
        raise NotImplementedError

    def _entry(self, path: SourcePath, entries: dict[str, Entry]) -> Entry | None:
        """The entry of a source a manifest names (None: it does not exist)."""
        raise NotImplementedError

    def _sessions(self, entries: dict[str, Entry], allowed_roots: tuple[Path, ...], invalid) -> list[Session]:
        return folder_sessions(self._files(entries), tuple(allowed_roots), invalid)

    def sessions(self, entries: dict[str, Entry], allowed_roots: tuple[Path, ...] = ()) -> Found:
        out = Found()

        def invalid(path: SourcePath, exc) -> None:
            out.problems[self._key(path)] = exc.message

        sessions = self._sessions(entries, tuple(allowed_roots), invalid)
        manifests = [k for k in entries if PurePosixPath(k).suffix.lower() in MANIFEST_SUFFIXES]
        for s in sessions:
            keys: dict[str, Entry] = {}
            waiting = []
            if s.manifest_path is not None:
                origin = self._key(s.manifest_path)
                keys[origin] = entries[origin]
            else:  # a lone file: it waits for the manifests that might still claim it to settle
                origin = self._key(s.base_dir / s.manifest.sources[0].uri if isinstance(s.base_dir, Path)
                                   else s.base_dir.join(s.manifest.sources[0].uri))
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
                entry = self._entry(path, entries)
                if entry is None:
                    waiting.append(f"its source {spec.uri}")
                    continue
                keys[path.as_uri()] = entry
                pairs.add((path.as_uri(), entry.version))
            out.candidates.append(Candidate(s, keys, frozenset(pairs), tuple(waiting), origin))
        return out


class LocalListing(_FolderListing):
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

    def _files(self, entries: dict[str, Entry]) -> list[SourcePath]:
        return [self.path / k for k in entries]

    def _key(self, path: Path) -> str:
        return path.relative_to(self.path).as_posix()

    def _entry(self, path: Path, entries: dict[str, Entry]) -> Entry | None:
        return _local_entry(path)  # symlinks followed, as the runner will


class S3Listing(_FolderListing):
    """An S3 prefix (``s3://bucket/prefix``): one ``ListObjectsV2`` walk per ``list()``; keys
    relative to the prefix. Manifests are read by GET, once per version."""

    def __init__(self, location: Location | str, options: S3Options | None = None, *,
                 store: S3Store | None = None) -> None:
        self.location = location if isinstance(location, Location) else Location.parse(location)
        if not self.location.is_s3:
            raise ValueError(f"{self.location.uri} is not an s3:// location")
        assert self.location.bucket is not None
        self.store = store or S3Store(Location(bucket=self.location.bucket), options)  # keys: full keys
        self.prefix = ObjectPath(self.location.bucket, self.location.prefix)
        self.root = self.location.uri
        self._manifests: dict[tuple[str, str], bytes | None] = {}  # (key, version) -> bytes
        self.listed: dict[str, Entry] = {}  # full key -> entry, of the last listing (``paths``)

    def entries(self, objects: list[dict]) -> dict[str, Entry]:
        """The listing of ``S3Store.list_objects`` rows under the prefix (relative keys)."""
        pre = self.location.prefix
        found: dict[str, Entry] = {}
        for o in objects:
            if pre and not o["key"].startswith(pre + "/"):
                continue
            rel = o["key"][len(pre) + 1:] if pre else o["key"]
            if rel and not rel.endswith("/"):  # a "folder" marker object is no source
                found[rel] = Entry(object_version(o["etag"], o["size"]), o["modified_at"], o["size"])
        return found

    def list(self) -> dict[str, Entry]:
        pre = self.location.prefix
        return self.entries(self.store.list_objects(pre + "/" if pre else ""))

    def _files(self, entries: dict[str, Entry]) -> list[SourcePath]:
        return self.paths(entries)

    def paths(self, entries: dict[str, Entry]) -> list[ObjectPath]:
        """The keys of ``entries`` as ``ObjectPath``s; ``listed`` becomes their entries by full key
        (what ``read`` and the sessions' ``objects`` use)."""
        files = [ObjectPath(self.prefix.bucket, self._full(k)) for k in entries]
        self.listed = {f.key: entries[k] for f, k in zip(files, entries)}
        return files

    def _full(self, rel: str) -> str:
        return f"{self.prefix.key}/{rel}" if self.prefix.key else rel

    def _key(self, path: ObjectPath) -> str:
        return path.relative_to(self.prefix)

    def _entry(self, path: ObjectPath, entries: dict[str, Entry]) -> Entry | None:
        return entries.get(self._key(path)) if path.is_relative_to(self.prefix) else None

    def read(self, path: ObjectPath) -> bytes | None:
        """A manifest candidate's bytes (None: gone, or over the manifest size limit), cached by version."""
        entry = self.listed.get(path.key)
        version = entry.version if entry else ""
        if (path.key, version) not in self._manifests:
            if entry is not None and entry.size is not None and entry.size > MAX_FILE_BYTES:
                data = None
            else:
                data = self.store.get(path.key)
            self._manifests[(path.key, version)] = data
        return self._manifests[(path.key, version)]

    def _sessions(self, entries: dict[str, Entry], allowed_roots: tuple[Path, ...], invalid) -> list[Session]:
        files = self._files(entries)
        live = {(k, e.version) for k, e in self.listed.items()}
        for gone in [k for k in self._manifests if k not in live]:  # memory stays bounded
            del self._manifests[gone]
        return folder_sessions(files, (), invalid, read=self.read, objects=dict(self.listed))


def _claimers(key: str, manifests: Iterable[str]) -> list[str]:
    """The manifest candidates in ``key``'s folder or above it (a manifest's sources lie in or
    under its own folder)."""
    folder = PurePosixPath(key).parent
    return [m for m in manifests if folder.is_relative_to(PurePosixPath(m).parent)]
