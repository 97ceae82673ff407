"""Source discovery: turn ``modalign run INPUT`` into validated sessions.

INPUT is a manifest (YAML/JSON), a folder (its manifests, plus every media file no
manifest names, each as a one-source session), or a lone media file. Manifests are
validated before any work starts; an invalid one stops the run with a ConfigError that
names the file and field.

Containment: a source resolves only inside its root (the manifest's folder, or the lone
file's folder) or one of ``ingest.allowed_roots``, after symlinks. A ``..``, an absolute
path, a ``file://`` URI or a symlink that leads elsewhere is refused before any byte of it
is read: for a manifest given as INPUT, a ConfigError naming ``sources.N.uri``; inside a
folder run, a quarantine row (``path_outside_root``) for that source while the run goes on.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from urllib.parse import unquote, urlparse

from modalign.schemas.errors import ConfigError, InputError, QuarantineReason
from modalign.schemas.load import load_model, read_mapping, validate_mapping
from modalign.schemas.manifest import MEDIA_SUFFIXES, Manifest, SourceSpec

MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")


@dataclass(frozen=True)
class Session:
    manifest: Manifest
    base_dir: Path
    manifest_path: Path | None
    allowed_roots: tuple[Path, ...] = ()

    @property
    def roots(self) -> tuple[Path, ...]:
        """Where this session's sources may resolve (symlinks resolved)."""
        return (self.base_dir.resolve(), *(Path(r).expanduser().resolve() for r in self.allowed_roots))

    def _field(self, spec: SourceSpec) -> str:
        i = next((k for k, s in enumerate(self.manifest.sources) if s.id == spec.id), None)
        return f"sources.{i}.uri" if i is not None else f"source {spec.id}"

    def resolve(self, spec: SourceSpec) -> Path:
        """The source's local path, resolved (symlinks followed); refused outside the roots.

        Raises InputError(``path_outside_root``) naming the manifest field; nothing is opened."""
        uri = spec.uri
        where = self.manifest_path or self.base_dir
        if "://" in uri:
            parsed = urlparse(uri)
            if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
                raise InputError(f"{where}: {self._field(spec)}: {parsed.scheme}:// sources are not read here; "
                                 "give a path inside the manifest's folder", source_uri=uri, stage="discover",
                                 code=QuarantineReason.UNSUPPORTED)
            uri = unquote(parsed.path)
        p = Path(uri)
        path = (p if p.is_absolute() else self.base_dir / p).resolve()
        if not any(path.is_relative_to(root) for root in self.roots):
            raise InputError(
                f"{where}: {self._field(spec)}: the source resolves outside the input root ({self.roots[0]}); "
                "move it there, or add its folder to ingest.allowed_roots", source_uri=spec.uri,
                stage="discover", code=QuarantineReason.PATH_OUTSIDE_ROOT)
        return path

    def source_uri(self, spec: SourceSpec) -> str:
        return self.resolve(spec).as_uri()

    def locate_all(self) -> tuple[dict[str, Path], list[tuple[SourceSpec, InputError]]]:
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


def _manifest_data(path: Path) -> dict | None:
    """The parsed mapping of a manifest candidate, or None when ``path`` is not a manifest."""
    if path.suffix.lower() not in MANIFEST_SUFFIXES:
        return None
    try:
        data = read_mapping(path)
    except ConfigError:
        return None
    return data if "sources" in data and "session_id" in data else None


_NOT_ID = re.compile(r"[^A-Za-z0-9_.-]+")


def session_id_for(path: Path) -> str:
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


def single_source_session(path: Path, allowed_roots: tuple[Path, ...] = ()) -> Session:
    modality = MEDIA_SUFFIXES.get(path.suffix.lower())
    if modality is None:
        raise ConfigError(f"{path}: not a manifest and not a known media type ({', '.join(sorted(MEDIA_SUFFIXES))})")
    manifest = Manifest(session_id=session_id_for(path),
                        sources=[SourceSpec(id="source", uri=path.name, modality=modality)])
    return Session(manifest, path.parent, None, allowed_roots)


def folder_sessions(files: Iterable[Path], allowed_roots: tuple[Path, ...] = (),
                    invalid: Callable[[Path, ConfigError], None] | None = None) -> list[Session]:
    """The sessions of a folder's ``files``: each manifest, then each media file no manifest
    names, as a one-source session. How ``run`` and ``watch`` both read a folder.

    An invalid manifest raises ConfigError, or, given ``invalid``, is handed to it and skipped
    (the watch loop, for which a manifest may still be being written)."""
    files = sorted(files)
    sessions: list[Session] = []
    claimed: set[Path] = set()
    for p in files:
        data = _manifest_data(p)
        if data is not None:  # parsed once, validated once
            try:
                s = Session(validate_mapping(Manifest, data, p), p.parent, p, allowed_roots)
            except ConfigError as exc:
                if invalid is None:
                    raise
                invalid(p, exc)
                continue
            sessions.append(s)
            claimed.update(s.locate_all()[0].values())
    for p in files:
        if p.suffix.lower() in MEDIA_SUFFIXES and p.resolve() not in claimed:
            sessions.append(single_source_session(p, allowed_roots))
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
    ids = [s.manifest.session_id for s in sessions]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ConfigError(f"duplicate session ids under {input_path}: {', '.join(dupes)}")
    if not sessions:
        raise ConfigError(f"no manifests or media files under {input_path}")
    return sessions
