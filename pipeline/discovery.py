"""Source discovery: turn ``modalign run INPUT`` into validated sessions.

INPUT is a manifest (YAML/JSON), a folder (its manifests, plus every media file no
manifest names, each as a one-source session), or a lone media file. Manifests are
validated before any work starts; an invalid one stops the run with a ConfigError that
names the file and field.

On object storage (``s3://bucket/prefix``: a prefix of manifests and media objects, or the key
of one manifest or object) the same rules hold over keys (``ObjectPath``): the prefix is
listed once, manifests are read by GET, and media objects are never read here; a source's
version is its ETag and size from the listing (``Session.objects``).

Containment: a source resolves only inside its root (the manifest's folder, or the lone
file's folder) or one of ``ingest.allowed_roots``, after symlinks. A ``..``, an absolute
path, a ``file://`` URI or a symlink that leads elsewhere is refused before any byte of it
is read: for a manifest given as INPUT, a ConfigError naming ``sources.N.uri``; inside a
folder run, a quarantine row (``path_outside_root``) for that source while the run goes on.
On object storage a key resolves lexically (S3 keys have no symlinks) and only inside the
manifest's own "folder" of keys; an absolute path or a ``..`` that climbs out is refused the
same way, before any request for that key.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
import unicodedata
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Union

from urllib.parse import unquote, urlparse

from modalign.schemas.errors import ConfigError, InputError, QuarantineReason
from modalign.schemas.load import load_model, parse_mapping, read_mapping, validate_mapping
from modalign.schemas.manifest import MEDIA_SUFFIXES, Manifest, SourceSpec

MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")


@dataclass(frozen=True, order=True)
class ObjectPath:
    """A key in a bucket, where a source (or manifest) lives on object storage. It answers the
    few questions discovery asks of a ``Path`` (name, suffix, parent, containment, URI), so the
    same code walks a folder and a listing. ``key`` has no leading or trailing ``/``."""

    bucket: str
    key: str = ""

    @property
    def _pure(self) -> PurePosixPath:
        return PurePosixPath(self.key or ".")

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def stem(self) -> str:
        return self._pure.stem

    @property
    def suffix(self) -> str:
        return self._pure.suffix

    @property
    def parent(self) -> "ObjectPath":
        return ObjectPath(self.bucket, self.key.rpartition("/")[0])

    def resolve(self) -> "ObjectPath":
        return self  # keys are literal: resolution (``..``) happened when the key was made

    def is_relative_to(self, other: "ObjectPath") -> bool:
        return (isinstance(other, ObjectPath) and self.bucket == other.bucket
                and (not other.key or self.key == other.key or self.key.startswith(other.key + "/")))

    def relative_to(self, other: "ObjectPath") -> str:
        if not self.is_relative_to(other):
            raise ValueError(f"{self.as_uri()} is not under {other.as_uri()}")
        return self.key[len(other.key):].lstrip("/") if other.key else self.key

    def join(self, rel: str) -> "ObjectPath | None":
        """The key ``rel`` names relative to this "folder" (``..`` resolved lexically); None for an
        absolute path or one that climbs above the bucket."""
        if rel.startswith("/") or rel.startswith("\\"):
            return None
        key = posixpath.normpath(posixpath.join(self.key, rel)) if rel else self.key
        if key == "." or key == ".." or key.startswith("../"):
            return None
        return ObjectPath(self.bucket, key)

    def as_uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def __str__(self) -> str:
        return self.as_uri()


SourcePath = Union[Path, ObjectPath]


@dataclass(frozen=True)
class Session:
    """One session to process: its manifest, where its sources resolve from (``base_dir``: a
    folder, or an ``ObjectPath`` prefix), and the manifest it came from (None: a lone file).
    On object storage ``objects`` holds the listing's entry (``listing.Entry``: version, size)
    of every key discovery saw, so nothing needs a request to know a source's version."""

    manifest: Manifest
    base_dir: Path | ObjectPath
    manifest_path: Path | ObjectPath | None
    allowed_roots: tuple[Path, ...] = ()
    objects: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

    @property
    def on_object_store(self) -> bool:
        return isinstance(self.base_dir, ObjectPath)

    @property
    def roots(self) -> tuple[Path | ObjectPath, ...]:
        """Where this session's sources may resolve (symlinks resolved; on object storage, the
        manifest's own prefix)."""
        if isinstance(self.base_dir, ObjectPath):
            return (self.base_dir,)
        return (self.base_dir.resolve(), *(Path(r).expanduser().resolve() for r in self.allowed_roots))

    def entry(self, path: ObjectPath) -> Any:
        """The listing entry of an object key (None: it was not listed)."""
        return (self.objects or {}).get(path.key)

    def _field(self, spec: SourceSpec) -> str:
        i = next((k for k, s in enumerate(self.manifest.sources) if s.id == spec.id), None)
        return f"sources.{i}.uri" if i is not None else f"source {spec.id}"

    def resolve(self, spec: SourceSpec) -> Path | ObjectPath:
        """The source's local path, resolved (symlinks followed), or its object key; refused
        outside the roots.

        Raises InputError(``path_outside_root``) naming the manifest field; nothing is opened."""
        uri = spec.uri
        where = self.manifest_path or self.base_dir
        local = not isinstance(self.base_dir, ObjectPath)
        if "://" in uri:
            parsed = urlparse(uri)
            if not local or parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
                raise InputError(f"{where}: {self._field(spec)}: {parsed.scheme}:// sources are not read here; "
                                 "give a path inside the manifest's folder", source_uri=uri, stage="discover",
                                 code=QuarantineReason.UNSUPPORTED)
            uri = unquote(parsed.path)
        if local:
            p = Path(uri)
            path: Path | ObjectPath | None = (p if p.is_absolute() else self.base_dir / p).resolve()
        else:
            path = self.base_dir.join(uri)
        if path is None or not any(path.is_relative_to(root) for root in self.roots):
            raise InputError(
                f"{where}: {self._field(spec)}: the source resolves outside the input root ({self.roots[0]}); "
                "move it there, or add its folder to ingest.allowed_roots", source_uri=spec.uri,
                stage="discover", code=QuarantineReason.PATH_OUTSIDE_ROOT)
        return path

    def source_uri(self, spec: SourceSpec) -> str:
        return self.resolve(spec).as_uri()

    def locate_all(self) -> tuple[dict[str, Path | ObjectPath], list[tuple[SourceSpec, InputError]]]:
        """Every source resolved once: (source id -> path, sources that may not be read)."""
        paths, refused = {}, []
        for spec in self.manifest.sources:
            try:
                paths[spec.id] = self.resolve(spec)
            except InputError as exc:
                refused.append((spec, exc))
        return paths, refused

    def refusals(self) -> list[tuple[SourceSpec, InputError]]:
        """Sources that may not be read (outside the roots, or not a local path)."""
        return self.locate_all()[1]


def _manifest_data(path: SourcePath, read: Callable[[SourcePath], bytes | None] | None = None) -> dict | None:
    """The parsed mapping of a manifest candidate, or None when ``path`` is not a manifest.
    ``read``: how to get its bytes (object storage: a GET; None when it has gone)."""
    if path.suffix.lower() not in MANIFEST_SUFFIXES:
        return None
    try:
        if read is None:
            data = read_mapping(path)
        else:
            raw = read(path)
            if raw is None:
                return None
            data = parse_mapping(raw, path)
    except ConfigError:
        return None
    return data if "sources" in data and "session_id" in data else None


_NOT_ID = re.compile(r"[^A-Za-z0-9_.-]+")


def session_id_for(path: SourcePath) -> str:
    """A valid session id for a lone media file, from its name.

    Any legal file name works: letters are folded to ASCII (``ü`` -> ``u``), other characters
    become ``_``, and when that changed the name a short hash of the full name keeps two
    files that fold alike (``ü.mp4``, ``u.mp4``) apart."""
    stem = path.stem
    folded = unicodedata.normalize("NFKD", stem).encode("ascii", "ignore").decode("ascii")
    sid = _NOT_ID.sub("_", folded).strip("_.-")[:100] or "session"
    if sid != stem:
        sid += "-" + hashlib.sha256(path.name.encode("utf-8", "surrogateescape")).hexdigest()[:8]
    return sid


def single_source_session(path: SourcePath, allowed_roots: tuple[Path, ...] = (),
                          objects: Mapping[str, Any] | None = None) -> Session:
    modality = MEDIA_SUFFIXES.get(path.suffix.lower())
    if modality is None:
        raise ConfigError(f"{path}: not a manifest and not a known media type ({', '.join(sorted(MEDIA_SUFFIXES))})")
    manifest = Manifest(session_id=session_id_for(path),
                        sources=[SourceSpec(id="source", uri=path.name, modality=modality)])
    return Session(manifest, path.parent, None, allowed_roots, objects)


def folder_sessions(files: Iterable[SourcePath], allowed_roots: tuple[Path, ...] = (),
                    invalid: Callable[[SourcePath, ConfigError], None] | None = None, *,
                    read: Callable[[SourcePath], bytes | None] | None = None,
                    objects: Mapping[str, Any] | None = None) -> list[Session]:
    """The sessions of a folder's ``files``: each manifest, then each media file no manifest
    names, as a one-source session. How ``run`` and ``watch`` both read a folder, and a
    listing of object keys (``files`` are ``ObjectPath``s, ``read`` GETs a manifest, ``objects``
    is the listing by key).

    An invalid manifest raises ConfigError, or, given ``invalid``, is handed to it and skipped
    (the watch loop, for which a manifest may still be being written)."""
    files = sorted(files)
    sessions: list[Session] = []
    claimed: set[SourcePath] = set()
    for p in files:
        data = _manifest_data(p, read)
        if data is not None:  # parsed once, validated once
            try:
                s = Session(validate_mapping(Manifest, data, p), p.parent, p, allowed_roots, objects)
            except ConfigError as exc:
                if invalid is None:
                    raise
                invalid(p, exc)
                continue
            sessions.append(s)
            claimed.update(s.locate_all()[0].values())
    for p in files:
        if p.suffix.lower() in MEDIA_SUFFIXES and p.resolve() not in claimed:
            sessions.append(single_source_session(p, allowed_roots, objects))
    return sessions


def discover(input_path: Path, allowed_roots: tuple[Path, ...] = ()) -> list[Session]:
    """All sessions under INPUT, validated; raises ConfigError before any work.

    Paths are absolute (workers run in other folders than the driver). A manifest given as
    INPUT whose source resolves outside its roots is a ConfigError; in a folder run that
    source is left to quarantine (``Session.refusals``)."""
    input_path = Path(input_path).absolute()
    roots = tuple(allowed_roots)
    if not input_path.exists():
        raise ConfigError(f"input {input_path} does not exist")
    if input_path.is_file():
        if input_path.suffix.lower() in MANIFEST_SUFFIXES:
            session = Session(load_model(Manifest, input_path), input_path.parent, input_path, roots)
            for _spec, exc in session.refusals()[:1]:
                raise ConfigError(exc.message)
            return [session]
        session = single_source_session(input_path, roots)
        for _spec, exc in session.refusals()[:1]:  # a symlink to a file elsewhere
            raise ConfigError(exc.message)
        return [session]

    sessions = folder_sessions([p for p in input_path.rglob("*") if p.is_file()], roots)
    return _checked(sessions, str(input_path), "no manifests or media files")


def _checked(sessions: list[Session], where: str, none: str, hint: str = "") -> list[Session]:
    """``sessions``, unless two share an id or there are none (ConfigError naming ``where``)."""
    ids = [s.manifest.session_id for s in sessions]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ConfigError(f"duplicate session ids under {where}: {', '.join(dupes)}")
    if not sessions:
        raise ConfigError(f"{none} under {where}{hint}")
    return sessions


def discover_input(input_path: "str | Path", allowed_roots: tuple[Path, ...] = (), options: Any = None) -> list[Session]:
    """``discover`` for a local INPUT, ``discover_objects`` for ``s3://bucket/prefix``."""
    from modalign.pipeline.objstore import Location

    location = Location.parse(input_path if isinstance(input_path, str) else Path(input_path))
    if location.is_s3:
        return discover_objects(location, options)
    assert location.path is not None
    return discover(location.path, allowed_roots)


def discover_objects(location: Any, options: Any = None, *, store: Any = None) -> list[Session]:
    """All sessions under ``s3://bucket/prefix`` (a "folder" of keys, or the key of one manifest
    or media object), validated; ConfigError before any work, as ``discover``.

    One listing (``ListObjectsV2`` pages; the object's parent "folder" too when INPUT is one
    object); manifests read by GET; media objects not read at all. Each session carries the
    listing (``Session.objects``), so the runner knows every source's ETag and size."""
    from modalign.pipeline.listing import S3Listing
    from modalign.pipeline.objstore import Location

    assert location.bucket is not None
    listing = S3Listing(location, options, store=store)
    objects = listing.store.list_objects(location.prefix)
    one = location.prefix and any(o["key"] == location.prefix for o in objects)
    if one:  # INPUT names one object: its sources are its siblings
        key = ObjectPath(location.bucket, location.prefix)
        listing = S3Listing(Location(bucket=location.bucket, prefix=key.parent.key), store=listing.store)
        entries = listing.list()
        listing.paths(entries)
        if key.suffix.lower() in MANIFEST_SUFFIXES:
            raw = listing.read(key)
            if raw is None:
                raise ConfigError(f"manifest {key} could not be read (gone, or over the size limit)")
            session = Session(validate_mapping(Manifest, parse_mapping(raw, key), key), key.parent, key,
                              (), dict(listing.listed))
        else:
            session = single_source_session(key, (), dict(listing.listed))
        for _spec, exc in session.refusals()[:1]:
            raise ConfigError(exc.message)
        return [session]
    entries = listing.entries(objects)
    sessions = folder_sessions(listing.paths(entries), (), read=listing.read, objects=dict(listing.listed))
    return _checked(sessions, location.uri, "no manifests or media objects", " (endpoint and bucket were reachable)")
