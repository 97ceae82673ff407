"""Erasure (GDPR Art. 17): ``modalign lineage erase OUT --subject S | --source URI`` and ``lineage verify REPORT``.

Sits beside the lineage store (``pipeline.lineage``), as a writer of OUT like a run: what
an erasure removes is exactly what ``access`` lists for the same sources
(``lineage.report_of``), found in the committed state by the lineage store, and removed
through the commit protocol (``pipeline.commits``) under OUT's one-writer lease
(``pipeline.lease``):

1. take the lease, sweep what a crashed writer left (as a run does), open the store;
2. the erased sources: every committed source whose lineage row lists the subject
   (``--scope source``, the default; ``--scope session``: every source of each session
   one of whose sources lists it), or whose ``source_uri`` is the URI (``--source``);
3. per committed file of their sessions: no erased row -> kept as it is; only erased rows
   -> dropped; both -> rewritten without the erased rows under the erasure's attempt name
   (``layout.attempt_of``), the old file untouched. Tables: events, timeline, CTAL log
   (and its JSON lines), CTAL summary, drift alarms, features, quarantine, lineage;
4. each FAISS index holding an erased feature id is loaded, the ids removed, and saved
   under a new name; the feature-cache entries erased rows name, the patch grids they were
   pooled from and what else was pooled from those are removed (the cache is outside the
   commit and only saves work: losing an entry costs a miss, never a row); the monitors'
   tables (``monitor/``) are rebuilt over the features left, as a run's commit builds them;
5. the denylist entry (``OUT/lineage/denylist/ATTEMPT.json``: the subject and each erased
   source version as keyed hashes) and the signed report (``OUT/lineage/erasure/ID.json``)
   are written, every new file made durable, then the next commit is created: sessions
   left without files leave the commit, the others list their new files;
6. only then the old files are removed (``sweep``) and ``run.json`` rewritten.

A crash before step 5's commit leaves the previous commit whole (its files are never
touched); after it, the erasure is done and the next writer sweeps the old files. The
denylist and the reports are shared files every later commit carries (``carried_shared``),
so ``modalign run`` into OUT refuses an erased source version, or any source of an erased
subject, with a quarantine row of reason ``erased`` (``Denylist.refusal``).

Keys (``ErasureKeys``) live in the key store, outside OUT, in a folder of their own
(``<key store>/erasure/``): ``denylist`` keys the hashes (HMAC-SHA256) of subjects, source
versions and contents; ``report-signing`` signs reports (HMAC-SHA256: the ``cryptography``
package for Ed25519 is not a dependency). Pseudonym keys are per tenant
(``operators.deid.keystore``), not per subject, so an erasure shreds none of them: see
``runbooks/erasure.md``.

``verify`` checks a report's signature, that the files it lists as remaining are still
those of the current commit (or what changed since), that no removed file is back, and
re-runs the access query for the erased sources and subject, which must come back empty.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import time
import uuid
from collections import Counter, defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cached_property
from os import PathLike
from pathlib import Path
from typing import Any, Callable

from modalign.pipeline.commits import CommitLog, Snapshot, sweep
from modalign.pipeline.layout import CTAL_JSONL, TABLES, OutputLayout, attempt_of, write_json, write_table
from modalign.schemas.arrow import bool_mask
from modalign.schemas.errors import ConfigError
from modalign.schemas.files import atomic_write, fsync_dir, sha256_file

ERASURE = "lineage/erasure"
DENYLIST = "lineage/denylist"
MONITOR = "monitor"  # the monitors' tables of a commit (pipeline.monitors), rebuilt over what is left
KEY_FOLDER = "erasure"  # <key store>/erasure/: the denylist and signing keys, apart from the tenants' pseudonym keys
DENYLIST_KEY, SIGNING_KEY = "denylist", "report-signing"
SCOPES = ("source", "session")
FORMAT = 1
SIGNATURE_ALG = "HMAC-SHA256"
RUNBOOK = "runbooks/erasure.md"
_ATTEMPT_IN_NAME = re.compile(r"^(?P<head>(?:.*-)?)(?P<attempt>[0-9a-f]{12})(?P<tail>(?:-\d+)?\.(?:parquet|jsonl))$")
_LOCAL_VERSION = re.compile(r"^local:(?P<size>\d+):\d+$")


def carried_shared(base: Snapshot | None) -> list[str]:
    """The denylist and erasure-report files of ``base``: every later commit (run or erasure) keeps them."""
    return sorted(f for f in (base.shared if base else ()) if f.startswith((DENYLIST + "/", ERASURE + "/")))


# -- keys and keyed hashes ------------------------------------------------------------------

class ErasureKeys:
    """The erasure's two secrets in the key store (outside OUT): ``denylist`` and ``report-signing``."""

    def __init__(self, key_store: str | PathLike | None = None, out: str | PathLike | None = None) -> None:
        from modalign.operators.deid.keystore import KeyStore
        from modalign.schemas.environment import key_store_dir

        root = key_store_dir(key_store).absolute()
        if out is not None and root.resolve().is_relative_to(Path(out).resolve()):
            raise ConfigError(f"key store {root} is inside the output folder {out}; erasure keys are never outputs: "
                              "give --key-store (or $MODALIGN_KEY_STORE) outside it")
        self.root = root
        self.store = KeyStore(root / KEY_FOLDER)

    def get(self, name: str, *, create: bool) -> bytes | None:
        """The key ``name``, created on first use when ``create`` (None: absent and not created)."""
        if not create and not self.store.exists(name):
            return None
        return self.store.key(name)


def keyed(key: bytes, kind: str, value: str) -> str:
    """HMAC-SHA256 of ``kind`` and ``value`` (hex): how OUT names an erased subject, source or content."""
    return hmac.new(key, f"{kind}\x1f{value}".encode(), hashlib.sha256).hexdigest()


def key_id(key: bytes) -> str:
    """A public name of a key (16 hex), from which the key cannot be recovered."""
    return keyed(key, "key-id", "modalign")[:16]


def _canonical(doc: dict) -> bytes:
    return json.dumps({k: v for k, v in doc.items() if k != "signature"}, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True, default=str).encode()


def sign(doc: dict, key: bytes) -> dict:
    """``doc`` with its signature: HMAC-SHA256 over its canonical JSON (every field but ``signature``)."""
    return {**doc, "signature": {"alg": SIGNATURE_ALG, "key_id": key_id(key),
                                 "value": hmac.new(key, _canonical(doc), hashlib.sha256).hexdigest()}}


def signature_ok(doc: dict, key: bytes) -> bool:
    sig = doc.get("signature")
    if not isinstance(sig, dict) or sig.get("alg") != SIGNATURE_ALG or not isinstance(sig.get("value"), str):
        return False
    return hmac.compare_digest(hmac.new(key, _canonical(doc), hashlib.sha256).hexdigest(), sig["value"])


# -- the denylist ---------------------------------------------------------------------------

def _sha_hex(sha: str | None) -> str | None:
    return sha.removeprefix("sha256:") if sha else None


@dataclass(frozen=True)
class Denylist:
    """The committed denylist of an output folder: what ``modalign run`` must not ingest again.

    Entries (one JSON file per erasure, ``lineage/denylist/ATTEMPT.json``): ``subject`` (the
    keyed subject id), ``source`` (the keyed ``source_uri`` + ``source_version``, with the
    version itself) and ``content`` (the keyed sha256 of the source bytes, with their size,
    so only files of a denied size are hashed)."""

    entries: tuple[dict, ...] = ()
    key: bytes | None = None

    @classmethod
    def load(cls, out: str | PathLike | OutputLayout, snapshot: Snapshot | None,
             key_store: str | PathLike | None) -> "Denylist":
        """The denylist of ``snapshot`` (OUT a folder, or the layout of one on object storage);
        ``ConfigError`` when it is not empty and the key store lacks its key."""
        layout = out if isinstance(out, OutputLayout) else OutputLayout(Path(out))
        entries = _committed_entries(layout, snapshot)
        out = layout.uri
        if not entries:
            return cls()
        keys = ErasureKeys(key_store)
        key = keys.get(DENYLIST_KEY, create=False)
        wanted = sorted({e["key_id"] for e in entries})
        if key is None or key_id(key) not in wanted:
            raise ConfigError(f"the denylist of {out} (erased subjects and sources) was keyed with key "
                              f"{', '.join(wanted)}, which the key store {keys.root} does not hold; run with the key "
                              f"store the erasure used (key_store or $MODALIGN_KEY_STORE), see {RUNBOOK}")
        return cls(tuple(entries), key)

    @cached_property
    def _by_kind(self) -> dict[str, dict[str, dict]]:
        """kind -> keyed hash -> entry, built once per run (``refusal`` is asked per source)."""
        by_kind: dict[str, dict[str, dict]] = defaultdict(dict)
        for e in self.entries:
            by_kind[e["kind"]][e["key"]] = e
        return by_kind

    def refusal(self, uri: str, version: str | None, path: Path | None,
                subjects: tuple[str, ...] | list[str]) -> str | None:
        """Why a source may not be ingested (a quarantine message that names no subject), or None."""
        if not self.entries:
            return None
        assert self.key is not None
        by_kind = self._by_kind
        hit = next((by_kind["subject"][k] for k in (keyed(self.key, "subject", s) for s in subjects)
                    if k in by_kind["subject"]), None)
        what = "a data subject of this source was erased"
        if hit is None and version is not None:
            hit = by_kind["source"].get(keyed(self.key, "source", f"{uri}\x1f{version}"))
            what = "this source version was erased"
        if hit is None and path is not None and by_kind["content"]:
            sizes = {e.get("size_bytes") for e in by_kind["content"].values()}
            if None in sizes or path.stat().st_size in sizes:
                hit = by_kind["content"].get(keyed(self.key, "content", sha256_file(path)))
                what = "a source with these exact bytes was erased"
        if hit is None:
            return None
        return (f"{what} from this output folder (erasure {hit['erasure_id'][:12]}, {hit['erased_at']}); the "
                f"denylist refuses to ingest it again, see {RUNBOOK}")


def _committed_entries(layout: OutputLayout, snapshot: Snapshot | None) -> list[dict]:
    entries = []
    for f in carried_shared(snapshot):
        if f.startswith(DENYLIST + "/"):
            data = layout.read_bytes(layout.path(f))
            if data is None:
                raise FileNotFoundError(f"{layout.uri_of(layout.path(f))}: a committed denylist file is missing")
            entries += json.loads(data.decode("utf-8"))["entries"]
    return entries


def _denylist_entries(key: bytes, erasure_id: str, erased_at: str, subject: str | None,
                      sources: list[dict]) -> list[dict]:
    base = {"key_id": key_id(key), "erasure_id": erasure_id, "erased_at": erased_at}
    entries = [{**base, "kind": "subject", "key": keyed(key, "subject", subject)}] if subject else []
    for s in sources:
        version = s["source_version"]
        entries.append({**base, "kind": "source", "key": keyed(key, "source", f"{s['source_uri']}\x1f{version}"),
                        "source_version": version})
        sha = _sha_hex(s.get("source_sha256"))
        if sha:
            m = _LOCAL_VERSION.fullmatch(s["source_version"])
            entries.append({**base, "kind": "content", "key": keyed(key, "content", sha),
                            "size_bytes": int(m["size"]) if m else None})
    unique = {(e["kind"], e["key"]): e for e in entries}  # a video and its own audio track share one file
    return sorted(unique.values(), key=lambda e: (e["kind"], e["key"]))


# -- what to erase --------------------------------------------------------------------------

def _source_uri(source: str) -> str:
    """``--source``: a URI as lineage rows hold it, or a local path (resolved, as a run resolves it)."""
    raw = str(source).strip()
    if not raw:
        raise ConfigError("--source is empty; give the source URI as `modalign lineage trace` shows it")
    return raw if "://" in raw else Path(raw).expanduser().resolve().as_uri()


def erased_sources(store: Any, *, subject: str | None = None, source: str | None = None,
                   scope: str = "source", registry: str | PathLike | None = None,
                   key_store: str | PathLike | None = None, mentions: bool = True) -> set[tuple[str, str]]:
    """(session, source) pairs an erasure of ``subject`` (with ``scope``) or of ``source`` removes;
    with a subject registry (``lineage.subject_mentions``) and ``mentions``, also every document
    source of any session whose text carries one of the subject's keyed pseudonyms, whole."""
    from modalign.pipeline.lineage import subject_mentions, subject_sources

    if (subject is None) == (source is None):
        raise ConfigError("give exactly one of --subject S or --source URI")
    if scope not in SCOPES:
        raise ConfigError(f"--scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    if subject is not None:
        pairs = subject_sources(store, subject)
        if scope == "session" and pairs:
            sessions = sorted({s for s, _ in pairs})
            pairs = {(r["session_id"], r["source_id"]) for r in store.rows(
                "lineage_sources", "session_id IN (SELECT unnest(?))", [sessions], sessions,
                columns="session_id, source_id")}
        if mentions:
            pairs |= {(m["session_id"], m["source_id"]) for m in subject_mentions(store, subject, registry, key_store) or []}
        return pairs
    uri = _source_uri(str(source))
    rows = store.query(f"SELECT session_id, source_id FROM {store.view('lineage_sources')} WHERE source_uri = ?", [uri])
    if not rows:
        raise ConfigError(f"no committed source of {store.root} has the URI {uri} (commit {store.snapshot.version}); "
                          "give it as `modalign lineage trace` shows it")
    return {(r["session_id"], r["source_id"]) for r in rows}


def _table_of(rel: str) -> str | None:
    if rel.startswith(CTAL_JSONL + "/"):
        return "ctal_jsonl"
    return next((name for name, row in TABLES.items() if rel.startswith(row.PATH + "/")), None)


def _column(path: Path, name: str) -> list:
    """One column of a Parquet file as Python values (``ParquetFile``: no dataset layer)."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).read(columns=[name]).column(name).to_pylist()


def _doomed(table: str, path: Path, erased: set[str], uris: set[str]) -> list[bool]:
    """Per row of one committed file: whether it derives from an erased source of its session."""
    if table == "ctal_jsonl":
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        return [bool(erased & {m.split(":", 1)[-1] for m in r["modalities"]}) for r in rows]
    if table == "ctal":
        return [bool(erased & {m.split(":", 1)[-1] for m in ms}) for ms in _column(path, "modalities")]
    if table == "drift_alarms":
        return [bool(erased & set(s)) for s in _column(path, "sources")]
    if table == "quarantine":  # a row of the source, or of its file before it had a source id
        return [s in erased if s is not None else u in uris
                for s, u in zip(_column(path, "source_id"), _column(path, "source_uri"))]
    return [s in erased for s in _column(path, "source_id")]


def renamed(rel: str, attempt: str) -> str:
    """The rewritten file's name: ``rel`` with its writer's attempt token replaced by ``attempt``."""
    folder, _, name = rel.rpartition("/")
    m = _ATTEMPT_IN_NAME.fullmatch(name)
    if m is None:
        raise ConfigError(f"{rel}: not an output file name with an attempt token; was it written by modalign?")
    return f"{folder}/{m['head']}{attempt}{m['tail']}"


def _rewrite(root: Path, rel: str, table: str, keep: list[bool], new: str) -> int:
    """Write ``new`` with the kept rows of ``rel`` (same schema, same row order); returns rows written."""
    import pyarrow.parquet as pq

    if table == "ctal_jsonl":  # the kept lines byte for byte
        lines = [line for line in (root / rel).read_text(encoding="utf-8").splitlines() if line.strip()]
        kept = [line for line, k in zip(lines, keep) if k]
        atomic_write(root / new, lambda tmp: Path(tmp).write_text("".join(x + "\n" for x in kept), encoding="utf-8"))
        return len(kept)
    t = pq.ParquetFile(root / rel).read().filter(bool_mask(keep))
    write_table(root / new, t)
    return t.num_rows


@dataclass
class _Plan:
    """One erasure, computed from the committed state (``dry_run`` stops here)."""

    pairs: set[tuple[str, str]]
    access: dict  # lineage.report_of for the pairs
    files: list[dict]  # per committed file touched: path, table, session, rows, rows_removed, action, replaced_by
    keep: dict[str, list[bool]]  # rewritten path -> row mask
    indexes: list[dict]  # per FAISS index holding erased ids
    cache_keys: list[str]  # cache entries erased rows name, and those pooled from them
    dropped_sessions: list[str]

    def counts(self) -> dict[str, int]:
        c: Counter = Counter()
        for f in self.files:
            c[f["table"]] += f["rows_removed"]
        c["faiss_ids"] = sum(len(ix["feature_ids"]) for ix in self.indexes)
        c["cache_entries"] = len(self.cache_keys)
        return dict(sorted(c.items()))


def _plan(store: Any, pairs: set[tuple[str, str]], attempt: str) -> _Plan:
    from modalign.pipeline.lineage import report_of

    snap, root = store.snapshot, store.root
    access = report_of(store, pairs)
    by_session: dict[str, set[str]] = defaultdict(set)
    for s, src in pairs:
        by_session[s].add(src)
    uris = {o["source_uri"] for o in access["sources"]}
    files, keep, dropped = [], {}, []
    for sid in sorted(by_session):
        left = 0
        for rel in sorted(snap.sessions.get(sid, {}).get("files", ())):
            table = _table_of(rel)
            if table is None:
                left += 1
                continue
            mask = _doomed(table, root / rel, by_session[sid], uris)
            n = sum(mask)
            if n == 0:
                left += 1
                continue
            entry = {"path": rel, "table": table, "session_id": sid, "rows": len(mask), "rows_removed": n,
                     "action": "dropped" if n == len(mask) else "rewritten", "replaced_by": None}
            if entry["action"] == "rewritten":
                entry["replaced_by"] = renamed(rel, attempt)
                keep[rel] = [not d for d in mask]
                left += 1
            files.append(entry)
        if left == 0:
            dropped.append(sid)
    erased_ids: dict[str, set[int]] = defaultdict(set)
    for f in access["features"]:
        if f["index_file"]:
            erased_ids[f["index_file"]].add(int(f["feature_id"]))
    indexes = [{"path": ix, "feature_ids": sorted(ids)} for ix, ids in sorted(erased_ids.items())]
    return _Plan(pairs, access, files, keep, indexes, _cache_plan(store, access), dropped)


def _cache_plan(store: Any, access: dict) -> list[str]:
    """Cache keys to remove: every entry an erased row names and the patch grid it was pooled from
    (``access`` lists both), and every entry pooled from one of those grids. The cache only
    saves work (each feature row holds its vector), so an entry a remaining row shares with an
    erased one (content-addressed: the same bytes) goes too, and costs that row a miss on a
    re-run; finding such rows would mean reading every feature file of OUT."""
    from modalign.operators.cache.store import SEGMENT_GLOB
    from modalign.pipeline.lineage import sql_list

    doomed = {c["cache_key"] for c in access["cache"] if c.get("segment")}
    segments = sorted(store.output.layout.cache_dir.glob(SEGMENT_GLOB))
    if doomed and segments:
        store.con.execute("SET enable_progress_bar = false")
        doomed |= {r["cache_key"] for r in store.query(
            f"SELECT DISTINCT cache_key FROM read_parquet({sql_list(str(p) for p in segments)}, union_by_name = "
            "true) WHERE parent_key IN (SELECT unnest(?))", [sorted(doomed)])}
    return sorted(doomed)


# -- erase ----------------------------------------------------------------------------------

def _hashes(root: Path, files: list[str], known: dict[str, str] | None = None) -> dict[str, str]:
    """``sha256:<hex>`` per file: from ``known`` (the digests a commit record keeps of its files,
    taken when they were committed) where it has one, else read now."""
    known = known or {}
    return {f: known.get(f) or "sha256:" + sha256_file(root / f) for f in sorted(files)}


def _remaining_hashes(root: Path, remaining: list[str], known: dict[str, str]) -> dict[str, str]:
    """Digests of ``remaining``: ``known`` ones (taken meanwhile) and the new files'."""
    return dict(sorted({**{f: known[f] for f in remaining if f in known},
                        **_hashes(root, [f for f in remaining if f not in known])}.items()))


def erase(out: str | PathLike, *, subject: str | None = None, source: str | None = None, scope: str = "source",
          dry_run: bool = False, key_store: str | PathLike | None = None, lease_ttl_s: float | None = None,
          progress: Callable[[str], None] | None = None, registry: str | PathLike | None = None,
          mentions: bool = True) -> dict:
    """Erase a data subject or a source from ``out`` (module docstring); returns the report (``dry_run``:
    what would be removed, nothing written, no lease taken). ``registry`` (or ``subjects.yaml`` in
    the key store) and ``mentions``: documents of other sessions that carry the subject's keyed
    pseudonyms are erased too (``erased_sources``)."""
    from modalign.pipeline.lease import DEFAULT_TTL_S, Lease
    from modalign.pipeline.lineage import LineageStore, validate_subject
    from modalign.pipeline.openlineage import emit_erasure
    from modalign.pipeline.outputs import Output
    from modalign.pipeline.store import LocalStore

    from modalign.pipeline.outputs import refuse_s3

    refuse_s3(out, "modalign lineage erase", "its rewrite of tables and indexes and its denylist and report are "
              "written for a folder (copy OUT to one, erase there, copy it back)")
    say = progress or (lambda _m: None)
    subject = validate_subject(subject) if subject is not None else None
    root = Path(out).absolute()
    keys = ErasureKeys(key_store, root)
    erasure_id = uuid.uuid4().hex
    attempt = attempt_of(erasure_id)
    if dry_run:
        with LineageStore(root) as store:
            plan = _plan(store, erased_sources(store, subject=subject, source=source, scope=scope,
                                                registry=registry, key_store=key_store, mentions=mentions), attempt)
            return _dry_report(store, plan, subject, source, scope)
    Output(root)  # ConfigError before the lease: no such folder, or not an output folder
    started = time.time()
    _warm_openlineage()
    with Lease(LocalStore(root), erasure_id, ttl_s=lease_ttl_s or DEFAULT_TTL_S, writer="erasure") as lease:
        commits = CommitLog(lease.store)
        base = commits.latest()
        if base is None:
            raise ConfigError(f"{root} has no commit: nothing to erase")
        _recover(root, base, say, walk=not lease.swept)
        lease.swept = False  # from here the erasure writes into OUT
        with LineageStore(root) as store:
            plan = _plan(store, erased_sources(store, subject=subject, source=source, scope=scope,
                                                registry=registry, key_store=key_store, mentions=mentions), attempt)
        denylist_key = keys.get(DENYLIST_KEY, create=True)
        signing_key = keys.get(SIGNING_KEY, create=True)
        assert denylist_key is not None and signing_key is not None
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="modalign-erasure") as pool:
            # beside the rewriting, which waits on the disk: the erasure's own OpenLineage run
            # (START, done before the commit) and the digests of the files it leaves as they are
            start = pool.submit(emit_erasure, root, erasure_id, [], event_type="START")
            kept = pool.submit(_hashes, root, sorted(_untouched(base, plan)), base.digests)
            try:
                report, snap = _apply(root, base, plan, lease, commits, erasure_id, attempt, subject, source, scope,
                                      denylist_key, signing_key, started, say, kept, start.result)
            except BaseException as exc:
                start.result()
                emit_erasure(root, erasure_id, [], event_type="FAIL", error=exc)
                raise
        emit_erasure(root, erasure_id, [f["replaced_by"] for f in report["removed_files"] if f["replaced_by"]]
                     + report["monitor"]["written"])
        layout = OutputLayout(root)
        write_json(layout.run_json, snap.summary)
        removed = _remove_replaced(root, [f["path"] for f in report["removed_files"]]
                                   + [ix["path"] for ix in report["indexes"]]
                                   + [f["path"] for f in report["monitor"]["replaced"]])
        lease.swept = True  # it started from exactly the base commit's files and removed what it replaced
    say(f"erasure {erasure_id[:12]}: commit {snap.version}, {removed} old file(s) removed")
    return {**report, "report_path": str(root / _report_rel(erasure_id))}


def _warm_openlineage() -> None:
    """Import the OpenLineage client on a thread while the erasure plans: it takes 0.3 s, and the
    planning waits on DuckDB and the disk (the erasure's START event needs it next)."""
    import importlib
    import threading

    threading.Thread(target=importlib.import_module, args=("openlineage.client.event_v2",),
                     name="modalign-import", daemon=True).start()


def _report_rel(erasure_id: str) -> str:
    return f"{ERASURE}/{erasure_id}.json"


def _recover(root: Path, base: Snapshot, say: Callable[[str], None], walk: bool = True) -> None:
    """What a crashed writer left (files no commit lists) goes; run.json is the commit's again.
    ``walk`` False: the lease says the data folders hold exactly ``base``'s files (``Lease.swept``),
    so only the report and denylist folders are looked at (a run's sweep does not reach them)."""
    layout = OutputLayout(root)
    keep = base.files()
    n = sweep(root, keep, layout.data_folders()) if walk else 0
    for folder in (ERASURE, DENYLIST):  # an erasure that died before its commit: its report and denylist entry
        d = root / folder
        for p in sorted(d.iterdir()) if d.is_dir() else []:
            if p.is_file() and p.relative_to(root).as_posix() not in keep:
                p.unlink()
                n += 1
    if n:
        say(f"removed {n} file(s) of an unfinished earlier run or erasure (not committed)")
    write_json(layout.run_json, base.summary)


def _remove_replaced(root: Path, files: list[str]) -> int:
    """Delete the files the erasure's commit no longer lists, and the folders they leave empty.
    Not a ``sweep``: the erasure knows them, and walking 14,000 files costs 0.2 s."""
    import os

    removed = 0
    for rel in files:
        try:
            os.unlink(root / rel)
            removed += 1
        except FileNotFoundError:
            continue
        try:
            os.removedirs((root / rel).parent)  # up to the first folder that still holds something
        except OSError:
            pass
    return removed


def _untouched(base: Snapshot, plan: _Plan) -> set[str]:
    """Committed files the erasure neither drops nor rewrites (they stay in the next commit)."""
    return base.files() - {f["path"] for f in plan.files} - {ix["path"] for ix in plan.indexes}


def _apply(root: Path, base: Snapshot, plan: _Plan, lease: Any, commits: CommitLog, erasure_id: str, attempt: str,
           subject: str | None, source: str | None, scope: str, denylist_key: bytes, signing_key: bytes,
           started: float, say: Callable[[str], None], kept: Future, before_commit: Callable[[], object],
           ) -> tuple[dict, Snapshot]:
    """Write the new state beside the committed one, make it durable, sign the report, commit.
    ``kept``: the digests of ``_untouched`` files; ``before_commit`` is called before the commit."""
    import numpy as np

    from modalign.operators.cache.index import FeatureIndex
    from modalign.operators.cache.store import FeatureCache

    layout = OutputLayout(root)
    erased_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    removed_hashes = _hashes(root, [f["path"] for f in plan.files] + [ix["path"] for ix in plan.indexes], base.digests)
    written: list[str] = []
    replaced = {f["path"]: f["replaced_by"] for f in plan.files if f["action"] == "rewritten"}
    dropped = {f["path"] for f in plan.files if f["action"] == "dropped"}
    rewrites = [f for f in plan.files if f["action"] == "rewritten"]
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="modalign-rewrite") as pool:
        # 3. rewrite what still holds other rows, under this attempt's names, beside the cache's
        # own rewrite of its segments (Parquet reads and writes release the GIL)
        cache_job = pool.submit(lambda: FeatureCache(layout.cache_dir).remove(plan.cache_keys) if plan.cache_keys else 0)
        for f, rows in zip(rewrites, pool.map(lambda f: _rewrite(root, f["path"], f["table"], plan.keep[f["path"]],
                                                                 f["replaced_by"]), rewrites)):
            f["rows_kept"] = rows
            written.append(f["replaced_by"])
        cache_removed = cache_job.result()
    say(f"erasure {erasure_id[:12]}: {len(written)} file(s) rewritten, {len(dropped)} dropped")
    summary = json.loads(json.dumps(base.summary, default=str))
    index_rows = {ix["path"]: ix for ix in summary.get("indexes", [])}
    new_indexes, index_report = [], []
    for ix in plan.indexes:  # 4. FAISS: the ids removed, the index saved under a new name
        index = FeatureIndex.load(root / ix["path"])
        n = index.remove(np.asarray(ix["feature_ids"], dtype=np.int64))
        model, _, rest = Path(ix["path"]).name.partition("__")
        gran = rest.rsplit("-", 1)[0]
        entry = {"path": ix["path"], "vectors_removed": n, "vectors_left": index.ntotal, "replaced_by": None}
        meta = index_rows.pop(ix["path"], {"model_id": model, "granularity": gran, "dim": index.dim})
        if index.ntotal:
            new = layout.relative(index.save(layout.index(model, gran, attempt)))
            entry["replaced_by"] = new
            written.append(new)
            new_indexes.append({**meta, "vectors": index.ntotal, "path": new})
        index_report.append(entry)
    summary["indexes"] = sorted([*index_rows.values(), *new_indexes], key=lambda r: (r["model_id"], r["granularity"]))
    monitor = _monitor_again(layout, base, plan, replaced, dropped, attempt, summary)  # 4b. windows of what is left
    written += monitor["files"]

    # 5. the denylist entry, the new state's file lists, the signed report
    sources = [{k: o[k] for k in ("session_id", "source_id", "source_uri", "source_version", "source_sha256",
                                  "modality")} for o in plan.access["sources"]]
    known = {(e["kind"], e["key"]) for e in _committed_entries(layout, base)}
    entries = [e for e in _denylist_entries(denylist_key, erasure_id, erased_at, subject, sources)
               if (e["kind"], e["key"]) not in known]  # an erasure asked twice adds nothing twice
    deny_rel = f"{DENYLIST}/{attempt}.json" if entries else None
    if deny_rel:
        write_json(root / deny_rel, {"format": FORMAT, "erasure_id": erasure_id, "erased_at": erased_at,
                                     "entries": entries})
    sessions: dict[str, dict] = {}
    for sid in sorted({f["session_id"] for f in plan.files}):
        if sid in plan.dropped_sessions:
            continue
        files = [replaced.get(f, f) for f in base.sessions[sid]["files"] if f not in dropped]
        sessions[sid] = {**base.sessions[sid], "files": sorted(files)}
    parent = replace(base, sessions={s: v for s, v in base.sessions.items() if s not in plan.dropped_sessions})
    kept_shared = [f for f in base.shared if f not in {ix["path"] for ix in plan.indexes} | set(monitor["replaced"])]
    shared = sorted({*kept_shared, *(ix["path"] for ix in new_indexes), *monitor["files"],
                     *([deny_rel] if deny_rel else []), _report_rel(erasure_id)})
    erased_pairs = {(s["session_id"], s["source_id"]) for s in sources}
    summary["alignment"] = {sid: [r for r in rows if (sid, r.get("source_id")) not in erased_pairs]
                            for sid, rows in summary.get("alignment", {}).items() if sid not in plan.dropped_sessions}
    summary["erasure"] = {"erasure_id": erasure_id, "erased_at": erased_at, "report": _report_rel(erasure_id),
                          "counts": plan.counts()}
    new_state = {**parent.sessions, **sessions}
    remaining = sorted({f for s in new_state.values() for f in s["files"]} | set(shared) - {_report_rel(erasure_id)})
    for folder in sorted({(root / f).parent for f in [*written, *([deny_rel] if deny_rel else [])]}):
        fsync_dir(folder)
    report = {
        "format": FORMAT, "kind": "modalign-erasure-report", "erasure_id": erasure_id, "out": str(root),
        "requested": {"by": "subject" if subject else "source", "scope": scope if subject else "source",
                      "subject_key": keyed(denylist_key, "subject", subject) if subject else None,
                      "source_key": keyed(denylist_key, "source-uri", _source_uri(source)) if source else None,
                      "key_id": key_id(denylist_key)},
        "erased_at": erased_at, "elapsed_s": None,
        "base_commit": {"version": base.version, "committed_at": base.committed_at, "run_id": base.run_id},
        "commit": {"version": base.version + 1},
        "sources": [{"session_id": s["session_id"], "source_id": s["source_id"], "modality": s["modality"],
                     "source_version": s["source_version"],
                     "source_key": keyed(denylist_key, "source", f"{s['source_uri']}\x1f{s['source_version']}")}
                    for s in sources],
        "counts": plan.counts(), "access_counts": plan.access["counts"],
        "sessions_dropped": plan.dropped_sessions,
        "removed_files": [{**{k: f.get(k) for k in ("path", "table", "session_id", "rows", "rows_removed", "rows_kept",
                                                    "action", "replaced_by")}, "sha256": removed_hashes[f["path"]]}
                          for f in plan.files],
        "indexes": [{**e, "sha256": removed_hashes[e["path"]]} for e in index_report],
        "cache": {"entries_removed": cache_removed},
        "monitor": {"replaced": [{"path": f, "sha256": monitor["replaced_sha256"][f]} for f in monitor["replaced"]],
                    "written": monitor["files"]},
        "denylist": {"path": deny_rel, "entries": len(entries)},
        "remaining_files": _remaining_hashes(root, remaining, kept.result()),
        "key_material": {"pseudonym_keys": "per tenant, not per subject: none shredded (see runbooks/erasure.md)",
                         "signing_key_id": key_id(signing_key)},
    }
    report["elapsed_s"] = round(time.time() - started, 3)
    report = sign(report, signing_key)
    write_json(root / _report_rel(erasure_id), report)
    fsync_dir(root / ERASURE)
    before_commit()
    lease.check()  # the fence: an erasure that lost its lease must not commit
    snap = commits.commit(parent, run_id=erasure_id, sessions=sessions, shared=shared, summary=summary)
    return report, snap


def _monitor_again(layout: OutputLayout, base: Snapshot, plan: _Plan, replaced: dict[str, str], dropped: set[str],
                   attempt: str, summary: dict) -> dict:
    """The monitors' tables rebuilt over the features and events the erasure leaves (``pipeline.monitors``,
    ``pipeline.quality``), as a run's commit builds them, so that no window or quality row describes
    erased data; nothing for an OUT without them. ``summary`` (the new run.json) gets their figures."""
    from modalign.pipeline.monitors import monitor_embeddings, monitor_reference
    from modalign.pipeline.quality import monitor_quality, quality_reference
    from modalign.pipeline.quality import record as record_quality
    from modalign.schemas.config import MonitorConfig, QualityConfig

    old = sorted(f for f in base.shared if f.startswith(MONITOR + "/"))
    if not old:
        return {"files": [], "replaced": [], "replaced_sha256": {}}
    config = MonitorConfig.model_validate(summary.get("config", {}).get("monitor", {}))
    try:
        reference = monitor_reference(config.reference)
    except ConfigError:  # the reference output is gone: an erasure must still be possible
        reference = (None, [])
    features = sorted(replaced.get(f, f) for sid, sess in base.sessions.items() if sid not in plan.dropped_sessions
                      for f in sess["files"] if f.startswith("features/") and f not in dropped)
    result = monitor_embeddings(layout, features, attempt, config.embedding, *reference)
    summary["monitor"] = {k: result[k] for k in ("windows", "alarms", "streams")}
    summary.setdefault("counts", {})["monitor_alarms"] = dict(result["alarms"])
    # the quality-shift rows over the events left (pipeline.quality); the run's violation counts stay
    shift = QualityConfig.model_validate(summary.get("config", {}).get("quality", {})).shift
    try:
        quality_ref = quality_reference(config.reference)
    except ConfigError:
        quality_ref = (None, [], None)
    events = sorted(replaced.get(f, f) for sid, sess in base.sessions.items() if sid not in plan.dropped_sessions
                    for f in sess["files"] if f.startswith("events/") and f not in dropped)
    checked = monitor_quality(layout, events, attempt, shift, *quality_ref)
    record_quality(summary, checked)
    files = result["files"] + checked["files"]
    return {"files": files, "replaced": old, "replaced_sha256": _hashes(layout.root, old, base.digests)}


def _dry_report(store: Any, plan: _Plan, subject: str | None, source: str | None, scope: str) -> dict:
    return {"dry_run": True, "out": str(store.root), "base_commit": {"version": store.snapshot.version},
            "requested": {"by": "subject" if subject else "source", "scope": scope if subject else "source"},
            "sources": [{k: o[k] for k in ("session_id", "source_id", "modality", "source_version")}
                        for o in plan.access["sources"]],
            "counts": plan.counts(), "access_counts": plan.access["counts"], "sessions_dropped": plan.dropped_sessions,
            "removed_files": [{k: f[k] for k in ("path", "table", "session_id", "rows", "rows_removed", "action")}
                              for f in plan.files],
            "indexes": [{"path": ix["path"], "vectors_removed": len(ix["feature_ids"])} for ix in plan.indexes],
            "cache": {"entries_removed": len(plan.cache_keys)}}


# -- verify ---------------------------------------------------------------------------------

def verify(report_path: str | PathLike, *, out: str | PathLike | None = None,
           key_store: str | PathLike | None = None, subject: str | None = None) -> dict:
    """Check an erasure report: signature, files against the current commit, access empty. ``ok`` says all passed."""
    from modalign.pipeline.lineage import LineageStore, access, report_of, validate_subject
    from modalign.pipeline.outputs import Output, refuse_s3

    if out is not None:
        refuse_s3(out, "modalign lineage verify", "erasure itself is refused there")
    path = Path(report_path)
    checks: list[dict] = []

    def check(name: str, ok: bool, detail: str) -> bool:
        checks.append({"check": name, "ok": bool(ok), "detail": detail})
        return ok

    def result() -> dict:
        return {"report": str(path), "ok": all(c["ok"] for c in checks), "checks": checks}

    try:
        doc = json.loads(path.read_bytes())
        assert isinstance(doc, dict) and doc.get("kind") == "modalign-erasure-report"
    except (OSError, ValueError, AssertionError):
        check("report", False, f"{path} is not an erasure report (not readable, not JSON, or not of this kind)")
        return result()
    keys = ErasureKeys(key_store)
    skey = keys.get(SIGNING_KEY, create=False)
    if skey is None:
        check("signature", False, f"the key store {keys.root} holds no report-signing key: verify with the key store "
                                  "the erasure used (--key-store or $MODALIGN_KEY_STORE)")
        return result()
    sig = doc.get("signature") if isinstance(doc.get("signature"), dict) else {}
    if not check("signature", signature_ok(doc, skey),
                 f"{SIGNATURE_ALG} by key {key_id(skey)}: valid" if signature_ok(doc, skey) else
                 f"{SIGNATURE_ALG} does not match: the report was changed after it was signed, or signed with "
                 f"another key (report names key {sig.get('key_id')}, the key store holds {key_id(skey)})"):
        return result()
    root = Path(out) if out is not None else (path.parents[2] if path.parent.as_posix().endswith(ERASURE)
                                               else Path(doc["out"]))
    output = Output(root)
    snap = output.snapshot
    current = snap.files()
    rel = _report_rel(doc["erasure_id"])
    committed = rel in current and json.loads((root / rel).read_bytes()) == doc
    check("committed", committed, f"{rel} is listed by commit {snap.version} and equals this report" if committed
          else f"{rel} is not a committed file of {root} (commit {snap.version}) equal to this report: the erasure did "
               "not commit, or the report is from another output folder")
    remaining: dict[str, str] = doc["remaining_files"]
    changed = [f for f, h in remaining.items() if f in current and "sha256:" + sha256_file(root / f) != h]
    replaced = sorted(f for f in remaining if f not in current)
    added = sorted(current - set(remaining) - {rel})
    at_commit = snap.version == doc["commit"]["version"]
    if at_commit:
        check("files", not changed and not replaced and not added,
              f"commit {snap.version} is the erasure's: its {len(remaining)} other files match their sha256"
              if not (changed or replaced or added) else
              f"commit {snap.version} is the erasure's but {len(changed)} file(s) differ from their sha256, "
              f"{len(replaced)} are missing and {len(added)} are extra: {', '.join((changed + replaced + added)[:5])}")
    else:
        check("files", not changed, f"commit {snap.version} (the erasure made {doc['commit']['version']}): "
              f"{len(remaining) - len(replaced)} remaining file(s) unchanged, {len(replaced)} replaced and "
              f"{len(added)} added by later commits" + (f"; {len(changed)} CHANGED IN PLACE: {', '.join(changed[:5])}"
                                                        if changed else ""))
    gone = doc["removed_files"] + doc["indexes"] + doc.get("monitor", {}).get("replaced", [])
    back = [f["path"] for f in gone if f["path"] in current or (root / f["path"]).exists()]
    check("removed", not back, f"none of the {len(gone)} removed file(s) is "
          "committed or on disk" if not back else f"{len(back)} removed file(s) are back: {', '.join(back[:5])}")
    dkey = keys.get(DENYLIST_KEY, create=False)
    with LineageStore(root) as store:
        rows = store.query(f"SELECT session_id, source_id, source_uri, source_version, subjects FROM "
                           f"{store.view('lineage_sources')}")
        pairs = {(s["session_id"], s["source_id"]) for s in doc["sources"]}
        live = {(r["session_id"], r["source_id"]) for r in rows}
        again = [r for r in rows if dkey is not None and any(
            keyed(dkey, "source", f"{r['source_uri']}\x1f{r['source_version']}") == s["source_key"]
            for s in doc["sources"])]
        left = report_of(store, pairs - live)  # erased sources without a (new, not erased) version: nothing at all
        found = {k: v for k, v in left["counts"].items() if v and k != "sessions"}
        check("access sources", not again and not found,
              f"access query for the {len(pairs)} erased source(s): empty" if not (again or found) else
              f"access query for the erased sources is not empty: {len(again)} erased version(s) ingested again, "
              f"rows {found}")
        req = doc["requested"]
        if req["by"] == "subject":
            subjects = {s for r in rows for s in r["subjects"] or []}
            hit = sorted(s for s in subjects if dkey is not None and keyed(dkey, "subject", s) == req["subject_key"])
            if subject is not None:
                subject = validate_subject(subject)
                mine = dkey is not None and keyed(dkey, "subject", subject) == req["subject_key"]
                rep = access(root, subject) if mine else None
                n = {k: v for k, v in rep["counts"].items() if v} if rep else {}
                check("access subject", mine and not n,
                      "this report is not about the given subject" if not mine else
                      "access --subject: empty" if not n else f"access --subject is not empty: {n}")
            else:
                check("access subject", dkey is not None and not hit,
                      "no committed lineage row lists the erased subject (matched by its keyed hash)"
                      if dkey is not None and not hit else "the denylist key is missing from the key store"
                      if dkey is None else f"{len(hit)} committed source(s) list the erased subject again")
    return {**result(), "out": str(root), "commit": snap.version, "erasure_commit": doc["commit"]["version"],
            "changed_since": {"replaced": replaced, "added": added, "changed": changed}}


def render_erasure(report: dict) -> str:
    """A terminal summary of an erasure (or of a dry run)."""
    verb = "would remove" if report.get("dry_run") else "removed"
    c = report["counts"]
    srcs = ", ".join(f"{s['session_id']}/{s['source_id']}" for s in report["sources"]) or "none"
    lines = [f"erasure of {len(report['sources'])} source(s) ({srcs}) from {report['out']}"
             f" (commit {report['base_commit']['version']}" + ("" if report.get("dry_run") else
                                                               f" -> {report['commit']['version']}") + "):",
             f"  {verb} rows: " + (", ".join(f"{k} {v}" for k, v in c.items() if v) or "none")]
    acts = Counter(f["action"] for f in report["removed_files"])
    lines.append(f"  files: {acts.get('dropped', 0)} dropped, {acts.get('rewritten', 0)} rewritten; "
                 f"sessions left without rows: {', '.join(report['sessions_dropped']) or 'none'}")
    if report.get("dry_run"):
        lines.append("  dry run: nothing was changed")
    else:
        d = report["denylist"]
        lines.append(f"  denylist: {d['entries']} new entries in {d['path']}" if d["path"] else
                     "  denylist: nothing new (already denied)")
        lines.append(f"erasure report: {report['report_path']}")
    return "\n".join(lines)


def render_verify(result: dict) -> str:
    lines = [f"{'ok  ' if c['ok'] else 'FAIL'}  {c['check']}: {c['detail']}" for c in result["checks"]]
    lines.append(f"report {result['report']}: " + ("verified" if result["ok"] else "NOT verified"))
    return "\n".join(lines)
