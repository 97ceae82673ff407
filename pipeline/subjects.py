"""The subject registry: which identifiers (names, e-mails, phones) belong to a data subject.

Manifests name data subjects by opaque ids only (``subject-0001``), so OUT can say which
sources a subject appears in, but not which documents of *other* sessions merely mention
them: those hold only keyed pseudonyms (``<PERSON_3f9a1c2b>``). The optional registry maps
a subject id to the identifiers a compliance team knows, and is kept **outside OUT, next
to the key store** (``<key store>/subjects.yaml`` by default), because it is personal data
itself. With it, ``modalign lineage access`` and ``erase`` compute the subject's keyed
pseudonyms with the tenant key, exactly as the text operator did, and find every document
event that carries one. No identifier is ever written to OUT or printed: reports name the
subject id, the pseudonyms and the events.

    # <key store>/subjects.yaml (mode 0600, like the keys)
    subject-0001:
      tenant: default                  # whose pseudonym key (the manifest's tenant)
      person: [Ada Lovelace, A. Lovelace]
      email: [ada@example.org]
      phone: ["+44 20 7946 0958"]

A name that OCR read another way keeps its pseudonym (the operator normalises before it
hashes, and so does this), but a spelling the registry does not list is not found: list
the forms a person is written in.
"""

from __future__ import annotations

from os import PathLike
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, RootModel, TypeAdapter, ValidationError

from modalign.operators.deid.tokens import TOKEN_PATTERN
from modalign.schemas.environment import key_store_dir
from modalign.schemas.errors import ConfigError
from modalign.schemas.load import read_mapping, validate_mapping
from modalign.schemas.manifest import SubjectId

REGISTRY_NAME = "subjects.yaml"
Identifiers = list[str]


class SubjectEntry(BaseModel):
    """The identifiers of one data subject, by the text operator's entity kinds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant: str = Field("default", pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")
    person: Identifiers = Field(default_factory=list, max_length=1_000)
    email: Identifiers = Field(default_factory=list, max_length=1_000)
    phone: Identifiers = Field(default_factory=list, max_length=1_000)
    iban: Identifiers = Field(default_factory=list, max_length=1_000)
    card: Identifiers = Field(default_factory=list, max_length=1_000)
    national_id: Identifiers = Field(default_factory=list, max_length=1_000)
    date_of_birth: Identifiers = Field(default_factory=list, max_length=1_000)
    address: Identifiers = Field(default_factory=list, max_length=1_000)

    def identifiers(self) -> list[tuple[str, str]]:
        """(kind, value) of every non-blank identifier, in a stable order."""
        return [(kind, v) for kind in KINDS for v in getattr(self, kind) if v.strip()]


KINDS = tuple(k for k in SubjectEntry.model_fields if k != "tenant")


class SubjectRegistry(RootModel[dict[SubjectId, SubjectEntry]]):
    """``subject id -> SubjectEntry``, as read from the registry file."""

    def entry(self, subject: str) -> SubjectEntry | None:
        return self.root.get(subject)


def registry_path(configured: str | PathLike | None = None, key_store: str | PathLike | None = None) -> Path:
    """The registry file: ``configured``, else ``subjects.yaml`` in the key store."""
    return Path(configured).expanduser() if configured else key_store_dir(key_store) / REGISTRY_NAME


def load_registry(path: str | PathLike, out: str | PathLike | None = None) -> SubjectRegistry:
    """The registry at ``path`` (``ConfigError`` naming the file or field when it is missing or
    invalid, or when it lies inside the output folder ``out``: it holds personal data)."""
    path = Path(path)
    if out is not None:
        real, root = path.resolve(), Path(out).resolve()
        if real == root or root in real.parents:
            raise ConfigError(f"the subject registry {path} is inside the output folder {out}: it holds names "
                              "and e-mails, which are never outputs; keep it next to the key store")
    if not path.is_file():
        raise ConfigError(f"no subject registry at {path}: write one (see runbooks/erasure.md) or pass --registry")
    try:  # a parser's message quotes the offending line, which may be a name: not repeated
        data = read_mapping(path)
    except ConfigError:
        raise ConfigError(f"the subject registry {path} is not a readable YAML/JSON mapping (under 4 MiB); the "
                          "parser's message is withheld because the file holds personal data") from None
    ids = TypeAdapter(SubjectId)
    for n, key in enumerate(data, 1):
        try:
            ids.validate_python(key)
        except ValidationError:
            raise ConfigError(f"the subject registry {path}: key number {n} is not a data-subject id (letters, "
                              "digits, '_', '.', ':', '-'; e.g. subject-0001); the key is not repeated") from None
    return validate_mapping(SubjectRegistry, data, path)


def subject_pseudonyms(entry: SubjectEntry, key_store: str | PathLike | None = None) -> dict[str, str]:
    """``pseudonym token -> kind`` of every identifier of ``entry``: the ``<KIND_xxxxxxxx>``
    token the ``pseudonymise`` action writes, and the 64-hex-digit digest of ``hash``, both
    keyed with the tenant's key. A tenant without a key has no pseudonyms (nothing was ever
    pseudonymised with it, or its key was shredded): empty."""
    from modalign.operators.deid.keystore import KeyStore
    from modalign.operators.deid.text import keyed_digest, pseudonym

    store = KeyStore(key_store)
    if not store.exists(entry.tenant):
        return {}
    key = store.key(entry.tenant)
    out: dict[str, str] = {}
    for kind, value in entry.identifiers():
        out[pseudonym(key, kind, value)] = kind
        out[keyed_digest(key, kind, value)] = kind
    return out


def mentions(store, tokens: dict[str, str], sessions: list[str] | None = None) -> list[dict]:
    """Document events (``events_pdf``) of any committed session (or of ``sessions``) whose
    words carry one of ``tokens`` (``subject_pseudonyms``): (session, source, event, kind,
    pseudonym, occurrences), sorted. ``store`` is a ``modalign.pipeline.lineage.LineageStore``."""
    if not tokens:
        return []
    # a token may share its word with punctuation ("(<PERSON_3f9a1c2b>,"): the tokens in each word
    found = (f"SELECT session_id, source_id, event_id, unnest(regexp_extract_all(w.text, '{TOKEN_PATTERN}')) AS t "
             f"FROM (SELECT session_id, source_id, event_id, unnest(words) AS w FROM "
             f"({store.source('events_pdf', sessions)}))")
    rows = store.query(
        f"SELECT session_id, source_id, event_id, t AS pseudonym, count(*) AS occurrences FROM ({found}) "
        "WHERE t IN (SELECT unnest(?)) GROUP BY ALL ORDER BY 1, 2, 3, 4", [sorted(tokens)])
    return [{**r, "kind": tokens[r["pseudonym"]]} for r in rows]
