"""Source discovery: turn ``modalign run INPUT`` into validated sessions.

INPUT is a manifest (YAML/JSON), a folder (its manifests, plus every media file no
manifest names, each as a one-source session), or a lone media file. Manifests are
validated before any work starts; an invalid one stops the run with a ConfigError that
names the file and field.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from modalign.schemas.errors import ConfigError
from modalign.schemas.load import load_model, read_mapping, validate_mapping
from modalign.schemas.manifest import MEDIA_SUFFIXES, Manifest, SourceSpec

MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")


@dataclass(frozen=True)
class Session:
    manifest: Manifest
    base_dir: Path
    manifest_path: Path | None

    def resolve(self, spec: SourceSpec) -> Path:
        """Local path of a source (URIs relative to the manifest's folder)."""
        uri = spec.uri.removeprefix("file://")
        p = Path(uri)
        return p if p.is_absolute() else (self.base_dir / p)

    def source_uri(self, spec: SourceSpec) -> str:
        return self.resolve(spec).resolve().as_uri()


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


def single_source_session(path: Path) -> Session:
    modality = MEDIA_SUFFIXES.get(path.suffix.lower())
    if modality is None:
        raise ConfigError(f"{path}: not a manifest and not a known media type ({', '.join(sorted(MEDIA_SUFFIXES))})")
    manifest = Manifest(session_id=session_id_for(path),
                        sources=[SourceSpec(id="source", uri=path.name, modality=modality)])
    return Session(manifest, path.parent, None)


def discover(input_path: Path) -> list[Session]:
    """All sessions under INPUT, validated; raises ConfigError before any work.

    Paths are absolute (workers run in other folders than the driver)."""
    input_path = Path(input_path).absolute()
    if not input_path.exists():
        raise ConfigError(f"input {input_path} does not exist")
    if input_path.is_file():
        if input_path.suffix.lower() in MANIFEST_SUFFIXES:
            m = load_model(Manifest, input_path)
            return [Session(m, input_path.parent, input_path)]
        return [single_source_session(input_path)]

    sessions: list[Session] = []
    claimed: set[Path] = set()
    for p in sorted(input_path.rglob("*")):
        data = _manifest_data(p) if p.is_file() else None
        if data is not None:  # parsed once, validated once
            s = Session(validate_mapping(Manifest, data, p), p.parent, p)
            sessions.append(s)
            claimed.update(s.resolve(spec).resolve() for spec in s.manifest.sources)
    for p in sorted(input_path.rglob("*")):
        if p.is_file() and p.suffix.lower() in MEDIA_SUFFIXES and p.resolve() not in claimed:
            sessions.append(single_source_session(p))
    ids = [s.manifest.session_id for s in sessions]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ConfigError(f"duplicate session ids under {input_path}: {', '.join(dupes)}")
    if not sessions:
        raise ConfigError(f"no manifests or media files under {input_path}")
    return sessions
