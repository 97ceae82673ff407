"""The lineage store and the compliance queries over it: ``modalign lineage trace | access``.

Sits after the run, beside ``modalign.open`` (``pipeline.outputs``): a ``LineageStore`` opens
an output folder read-only at its latest commit and puts one in-memory DuckDB connection
over the committed Parquet files, nothing else (the files the commit record lists, never a
folder listing; no copy of the data). The queries read a session's files only wherever the
session is known (an event id names it, a subject's sources do; a feature id is looked up in
the committed FAISS indexes first), so a query touches the few files it needs even in an OUT
of thousands of sessions. ``LineageStore.view(table)`` is the view of all of a table's files.

Trace IDs (``parse_id``):

    8022945079494116854               a feature id (the FAISS id of a feature row): digits only
    sample-meeting:42                 a timeline row: SESSION:TICK (tick index, 40 ms each by default)
    sample-meeting/slides/block/3     an event id: SESSION/SOURCE/KIND/INDEX
    records/sample-meeting/ab12.parquet   an output file, relative to OUT or absolute inside it

``trace`` answers where one output came from: per source it derives from (an *origin*) the
source URI, version and sha256, session, run and commit, the operator chain with versions,
the de-identification policy (tag, and its content from the commit record of a run that
used it), the de-identification headers (method, detector name@version, count), what was
removed by kind (face boxes, text regions, personal-data items per kind, MFCC frames per
voice method), the clock mapping and how it was obtained (manifest, estimated or verified
against another source, with the CTAL summary's confidence and residuals), and the
embedding model ids of its features; plus the traced row itself (boxes, pseudonyms, ticks).

``access`` answers a GDPR Art. 15 request for one data subject: the sources whose lineage
row lists the subject (``Manifest.subjects`` of the session, or ``SourceSpec.subjects`` of
the source), and everything derived from them: events, timeline rows, CTAL rows, drift
alarms, features, feature-cache entries, FAISS ids per index file, the pseudonyms their
documents hold, quarantine rows, and per table the committed files that hold those rows
(what an erasure has to rewrite). Nothing here prints or returns payload (pixels, MFCCs,
text): only ids, times, boxes, counts and keyed pseudonyms, which are already in OUT.

The feature cache (``OUT/cache``) is not part of the commit: its segments are found the
way ``FeatureCache`` finds them, and only the keys the subject's feature rows name (and the
patch grids those were pooled from) are reported.
"""

from __future__ import annotations

import html
import json
import posixpath
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any

from modalign.operators.deid.tokens import tokens_in
from modalign.pipeline.commits import CommitLog
from modalign.pipeline.layout import CTAL_JSONL, INDEX, TABLES
from modalign.pipeline.outputs import Output
from modalign.schemas.errors import ConfigError

ID_SYNTAX = ("a feature id (digits), SESSION:TICK (a timeline row), SESSION/SOURCE/KIND/INDEX (an event id) "
             "or an output file (relative to OUT or absolute inside it)")
_NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]*"
_TICK_RE = re.compile(rf"^(?P<session>{_NAME}):(?P<tick>\d+)$")
_EVENT_RE = re.compile(rf"^(?P<session>{_NAME})/(?P<source>{_NAME})/(?P<kind>[a-z_]+)/(?P<index>\d+)$")
_MAX_FEATURE_ID = 2**63 - 1
EVENT_TABLES = ("events_video", "events_audio", "events_pdf")
# payload never leaves the store: decoded pixels, voice features, text
PAYLOAD = {"events_video": ("frame_jpeg",), "events_audio": ("mfcc",), "events_pdf": ("text", "words"),
           "features": ("vector",)}
UNION_FILES = 256  # up to this many files a relation reconciles schema versions by column name
LINEAGE_COLUMNS = ("session_id", "source_id", "source_uri", "source_version", "operators", "policy", "model_id")


# -- IDs ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TraceId:
    """A parsed ``trace`` argument: ``kind`` is ``feature | tick | event | file``."""

    kind: str
    text: str
    session_id: str | None = None
    source_id: str | None = None
    tick: int | None = None
    feature_id: int | None = None
    path: str | None = None  # file: relative to OUT, '/'-separated


def parse_id(text: str, out: str | PathLike) -> TraceId:
    """Parse a trace ID (syntax: module docstring); a path must stay inside ``out``."""
    raw = str(text).strip()
    if not raw:
        raise ConfigError(f"empty ID; give {ID_SYNTAX}")
    if raw.isdigit():
        fid = int(raw)
        if not 0 < fid <= _MAX_FEATURE_ID:
            raise ConfigError(f"feature id {raw} is out of range (feature ids are 1..2^63-1)")
        return TraceId("feature", raw, feature_id=fid)
    if m := _TICK_RE.fullmatch(raw):
        return TraceId("tick", raw, session_id=m["session"], tick=int(m["tick"]))
    if m := _EVENT_RE.fullmatch(raw):
        return TraceId("event", raw, session_id=m["session"], source_id=m["source"])
    uri = str(out).rstrip("/") + "/"
    if uri.startswith("s3://"):  # an object of an s3:// OUT, by its URI or relative to OUT
        raw = raw[len(uri):] if raw.startswith(uri) else raw
        rel = posixpath.normpath(raw)
        if rel == ".." or rel.startswith(("../", "/", "s3:")) or rel == ".":
            raise ConfigError(f"{raw!r} is not inside the output prefix {out}; give {ID_SYNTAX}")
        return TraceId("file", raw, path=rel)
    root = Path(out).absolute()
    p = Path(raw)
    if p.is_absolute():
        try:
            rel = p.resolve().relative_to(root.resolve()).as_posix()
        except ValueError:
            raise ConfigError(f"{raw!r} is not inside the output folder {out}; give {ID_SYNTAX}") from None
    else:
        rel = posixpath.normpath(p.as_posix())
        if rel == ".." or rel.startswith("../") or rel == ".":
            raise ConfigError(f"{raw!r} is not inside the output folder {out}; give {ID_SYNTAX}")
    return TraceId("file", raw, path=rel)


# -- the store ------------------------------------------------------------------------------

def sql_list(items: Any) -> str:
    """A DuckDB list literal of ``items`` as strings, single quotes doubled (file paths, ids)."""
    return "[" + ", ".join("'" + str(i).replace("'", "''") + "'" for i in items) + "]"


class LineageStore:
    """DuckDB views over the committed tables of one output folder, read-only.

    One in-memory connection per store (one store per query session); it reads the commit
    that was latest when the store was opened, so a run committing meanwhile changes
    nothing it sees (a file that run deletes raises ``FileNotFoundError``: re-open)."""

    def __init__(self, out: str | PathLike) -> None:
        import duckdb

        self.output = Output(out)  # ConfigError: not an output folder, or nothing committed
        self.snapshot = self.output.snapshot
        self.root = self.output.root
        self.layout = self.output.layout  # a folder, or an s3:// prefix read through pyarrow (no httpfs)
        self._arrow: dict[str, Any] = {}  # name -> Arrow table registered with DuckDB (s3:// OUT only)
        self.session_of: dict[str, str] = {f: sid for sid, s in self.snapshot.sessions.items() for f in s["files"]}
        self.con = duckdb.connect(":memory:")
        self._views: set[str] = set()

    def view(self, table: str) -> str:
        """The name of the DuckDB view over every committed file of ``table`` (created on first use:
        binding a view reads its files' schemas, which costs time at thousands of files)."""
        if table not in self._views:
            self.con.execute(f"CREATE VIEW {table} AS {self.source(table)}")
            self._views.add(table)
        return table

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> "LineageStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # files and relations
    def files(self, table: str, sessions: Any = None) -> list[str]:
        """Committed files (relative to OUT) of ``table``, of ``sessions`` only when given."""
        prefix = TABLES[table].PATH + "/"
        if sessions is None:
            pool = self.snapshot.files()
        else:
            pool = {f for sid in sessions for f in self.snapshot.sessions.get(sid, {}).get("files", ())}
        return sorted(f for f in pool if f.startswith(prefix) and f.endswith(".parquet"))

    def source(self, table: str, sessions: Any = None, files: list[str] | None = None) -> str:
        """A SQL relation over the committed files of ``table`` (of ``sessions``, or ``files``), with
        a ``filename`` column relative to OUT; an empty relation of the table's schema when none.

        A few sessions' files (up to ``UNION_FILES``) are read by column name across schema
        versions (``union_by_name``: an older file lacking an optional column reads it as NULL);
        more are bound to the first file's schema, which is what makes thousands of files cheap
        to scan, so queries over all files select the core columns only."""
        files = self.files(table, sessions) if files is None else files
        if not files:
            cols = ", ".join(f"NULL::{_duck_type(f.type)} AS \"{f.name}\"" for f in TABLES[table].schema())
            return f"SELECT {cols}, NULL::VARCHAR AS filename LIMIT 0"
        base = str(self.root).rstrip("/") + "/"
        union = sessions is not None and len(files) <= UNION_FILES
        return (f"SELECT * REPLACE (substr(filename, {len(base) + 1}) AS filename) FROM "
                f"{self.parquet(files, table, union=union, filename=True)}")

    def parquet(self, files: list[str], table: str | None = None, *, union: bool = False,
                filename: bool = False) -> str:
        """A SQL relation over Parquet ``files`` (relative to OUT), with their path in ``filename``
        when asked. DuckDB reads a folder's files itself; on an s3:// OUT they are read through
        pyarrow's S3 filesystem (with ``table``'s declared schema, so older files lacking an
        optional column read it as NULL) and registered with DuckDB as an Arrow table."""
        if not self.layout.is_s3:
            opts = (", union_by_name = true" if union else "") + (", filename = true" if filename else "")
            return f"read_parquet({sql_list(str(self.root / f) for f in files)}{opts})"
        import pyarrow.dataset as ds

        d = ds.dataset([str(self.layout.path(f)) for f in files], format="parquet", filesystem=self.layout.fs,
                       schema=TABLES[table].schema() if table else None)
        names = d.schema.names
        t = d.to_table(columns=names + (["__filename"] if filename else []))
        if filename:
            t = t.rename_columns(names + ["filename"])
        name = f"s3_files_{len(self._arrow)}"
        self._arrow[name] = t
        self.con.register(name, t)
        return name

    def query(self, sql: str, params: list | None = None) -> list[dict]:
        rel = self.con.execute(sql, params or [])
        names = [d[0] for d in rel.description]
        return [dict(zip(names, row)) for row in rel.fetchall()]

    def rows(self, table: str, where: str, params: list | None = None, sessions: Any = None,
             columns: str | None = None) -> list[dict]:
        """Rows of ``table`` matching ``where`` (payload columns left out)."""
        drop = ", ".join(f'"{c}"' for c in PAYLOAD.get(table, ()))
        cols = columns or (f"* EXCLUDE ({drop})" if drop else "*")
        return self.query(f"SELECT {cols} FROM ({self.source(table, sessions)}) WHERE {where}", params)

    # lineage pieces
    def origins(self, pairs: set[tuple[str, str]], detail: bool = True) -> list[dict]:
        """One origin per (session, source) of ``pairs``: see the module docstring."""
        if not pairs:
            return []
        sessions = sorted({s for s, _ in pairs})
        keys = [f"{s}\x1f{src}" for s, src in sorted(pairs)]
        cond = "session_id || chr(31) || source_id IN (SELECT unnest(?))"
        lineage = self.rows("lineage_sources", cond, [keys], sessions)
        summary = {(r["session_id"], r["source_id"]): r for r in self.rows("ctal_summary", cond, [keys], sessions)}
        models: dict[tuple[str, str], list[str]] = defaultdict(list)
        for r in self.query(f"SELECT DISTINCT session_id, source_id, model_id FROM ({self.source('features', sessions)})"
                            f" WHERE {cond} ORDER BY model_id", [keys]):
            models[(r["session_id"], r["source_id"])].append(r["model_id"])
        removed = self._removed_by_kind(pairs, sessions) if detail else {}
        out = []
        for r in sorted(lineage, key=lambda r: (r["session_id"], r["source_id"])):
            key = (r["session_id"], r["source_id"])
            s = summary.get(key)
            out.append({
                "session_id": r["session_id"], "source_id": r["source_id"], "source_uri": r["source_uri"],
                "source_version": r["source_version"], "source_sha256": r["source_sha256"],
                "modality": r["modality"], "status": r["status"], "events": r["events"], "track_of": r["track_of"],
                "run_id": r["run_id"], "commit": self.snapshot.version,
                "subjects": list(r["subjects"] or []),
                "operators": _operators(r["operators"]),
                "policy": self.policy(r["policy"]),
                "deid": [dict(h) for h in r["deid"] or []],
                "detectors": sorted({h["detector"] for h in r["deid"] or [] if h["detector"] != "none"}),
                "removed": removed.get(key, {}),
                "clock": _clock(r, s),
                "model_ids": models.get(key, []),
                "lineage_file": r["filename"],
            })
        return out

    def _removed_by_kind(self, pairs: set[tuple[str, str]], sessions: list[str]) -> dict:
        """(session, source) -> counts of what de-identification removed, by kind."""
        keys = [f"{s}\x1f{src}" for s, src in sorted(pairs)]
        cond = "session_id || chr(31) || source_id IN (SELECT unnest(?))"
        out: dict[tuple[str, str], dict[str, Any]] = defaultdict(dict)
        for r in self.query(f"SELECT session_id, source_id, sum(len(face_boxes))::BIGINT AS faces, "
                            f"sum(coalesce(len(text_boxes), 0))::BIGINT AS text_regions "
                            f"FROM ({self.source('events_video', sessions)}) WHERE {cond} GROUP BY ALL", [keys]):
            out[(r["session_id"], r["source_id"])].update(face_boxes=r["faces"], frame_text_regions=r["text_regions"])
        for r in self.query(f"SELECT session_id, source_id, p.kind AS kind, sum(p.count)::BIGINT AS n FROM "
                            f"(SELECT session_id, source_id, unnest(pii_counts) AS p FROM "
                            f"({self.source('events_pdf', sessions)}) WHERE {cond}) GROUP BY ALL ORDER BY kind",
                            [keys]):
            out[(r["session_id"], r["source_id"])].setdefault("personal_data", {})[r["kind"]] = r["n"]
        for r in self.query(f"SELECT session_id, source_id, deid.method AS method, count(*) AS n FROM "
                            f"({self.source('events_audio', sessions)}) WHERE {cond} GROUP BY ALL ORDER BY method",
                            [keys]):
            out[(r["session_id"], r["source_id"])].setdefault("voice_frames", {})[r["method"]] = r["n"]
        return out

    _policies: dict[str, dict] | None = None

    def policy(self, tag: str) -> dict:
        """A policy tag and its content, from the newest commit record whose run used it
        (the content is checked against the tag's digest; None when no record has it)."""
        if self._policies is None:
            self._policies = {}
            self._add_policy(self.snapshot.summary, self.snapshot.version)
        if tag not in self._policies and not getattr(self, "_scanned", False):
            self._scanned = True
            log = CommitLog(self.layout.store)
            for v in reversed(log.versions()):
                data = log.store.get(log.records.key(v))
                if data is not None:
                    from modalign.pipeline.commits import Snapshot

                    self._add_policy(Snapshot.from_json(data).summary, v)
        found = self._policies.get(tag)
        return {"tag": tag, "content": found["content"] if found else None,
                "content_from": f"commit {found['commit']}" if found else None}

    def _add_policy(self, summary: dict, version: int) -> None:
        from pydantic import ValidationError

        from modalign.schemas.policy import DeidPolicy

        content = summary.get("config", {}).get("policy")
        if content is None:
            return
        try:
            tag = DeidPolicy.model_validate(content).tag
        except ValidationError:
            return
        self._policies.setdefault(tag, {"content": content, "commit": version})  # type: ignore[union-attr]

    def feature_files_holding(self, feature_id: int) -> list[str]:
        """The committed feature files that can hold ``feature_id``: those of each (model,
        granularity) whose committed FAISS index holds the id (the index is memory-mapped, its
        vectors are not read), and of any group without an index. At 1,000 sessions this
        reads a fifth of the feature files instead of all."""
        from modalign.operators.dependencies import require

        faiss = require("faiss")
        keep: list[str] = []
        for (model, gran), files in self.output.layout.feature_groups(self.files("features")).items():
            prefix = f"{INDEX}/{model}__{gran}-"
            path = next((f for f in self.snapshot.shared if f.startswith(prefix)), None)
            if path is not None:
                if self.layout.is_s3:  # an object: read whole (no memory map)
                    import numpy as np

                    data = self.layout.read_bytes(self.layout.path(path)) or b""
                    index = faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
                else:
                    index = faiss.read_index(str(self.root / path), faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY)
                if not (faiss.vector_to_array(index.id_map) == feature_id).any():
                    continue
            keep += files
        return keep

    def index_file(self, model_id: str, granularity: str) -> str | None:
        p = self.output.index_file(model_id, granularity)
        return self.output.layout.relative(p) if p is not None else None


def _duck_type(t: Any) -> str:
    """DuckDB type of an Arrow type (for the empty relation of a table with no files)."""
    import pyarrow as pa

    if pa.types.is_struct(t):
        return "STRUCT(" + ", ".join(f'"{f.name}" {_duck_type(f.type)}' for f in t) + ")"
    if pa.types.is_list(t):
        return _duck_type(t.value_type) + "[]"
    return {pa.int64(): "BIGINT", pa.int32(): "INTEGER", pa.float32(): "FLOAT", pa.float64(): "DOUBLE",
            pa.bool_(): "BOOLEAN", pa.binary(): "BLOB"}.get(t, "VARCHAR")


def _operators(chain: str) -> list[dict]:
    ops = []
    for part in filter(None, (chain or "").split(";")):
        kind, _, version = part.partition("@")
        ops.append({"kind": kind, "version": version or None})
    return ops


def _clock(lineage: dict, summary: dict | None) -> dict:
    method, ref = lineage["clock_method"], lineage["clock_reference"]
    if method == "estimated":
        how = f"estimated by cross-correlation against the audio of {ref}"
    elif ref:
        how = f"from the manifest, verified against {ref} (drift measured, mapping kept)"
    else:
        how = "from the manifest"
    clock = {"offset_ns": lineage["clock_offset_ns"], "skew_ppm": lineage["clock_skew_ppm"], "method": method,
             "reference": ref, "obtained": how}
    if summary is not None:
        clock["ctal_summary"] = {k: summary[k] for k in (
            "offset_ns", "skew_ppm", "offset_method", "offset_confidence", "ticks", "matched", "gaps", "late",
            "residual_p50_ms", "residual_p95_ms", "residual_max_ms")}
        if summary["offset_confidence"] is not None:
            clock["obtained"] += f" (confidence {summary['offset_confidence']:.2f})"
    return clock


def _clean(row: dict, drop: tuple[str, ...] = LINEAGE_COLUMNS) -> dict:
    return {k: v for k, v in row.items() if k not in drop}


# -- trace ----------------------------------------------------------------------------------

def trace(out: str | PathLike, text: str) -> dict:
    """Where one output (event, feature, timeline row or file) came from; ``ConfigError`` names an unknown ID."""
    tid = parse_id(text, out)
    with LineageStore(out) as store:
        fn = {"event": _trace_event, "feature": _trace_feature, "tick": _trace_tick, "file": _trace_file}[tid.kind]
        target, pairs = fn(store, tid)
        detail = len({s for s, _ in pairs}) <= 1
        return {"id": tid.text, "kind": tid.kind, "out": store.layout.uri, "commit": store.snapshot.version,
                "target": target, "origins": store.origins(pairs, detail=detail)}


def _unknown(tid: TraceId, store: LineageStore, what: str) -> ConfigError:
    return ConfigError(f"unknown ID {tid.text!r}: no {what} in {store.root} (commit {store.snapshot.version}); "
                       f"give {ID_SYNTAX}")


def _event(store: LineageStore, event_id: str, session_id: str) -> dict | None:
    """The event row (no payload) of ``event_id``, with the pseudonyms of a text block."""
    for table in EVENT_TABLES:
        extra = ", list_filter(words, lambda w: w.entity IS NOT NULL) AS _entities" if table == "events_pdf" else ""
        drop = ", ".join(f'"{c}"' for c in PAYLOAD[table])
        rows = store.rows(table, "event_id = ?", [event_id], [session_id], columns=f"* EXCLUDE ({drop}){extra}")
        if rows:
            row = _clean(rows[0])
            row["table"] = table
            if table == "events_pdf":
                row["pseudonyms"] = [{"kind": w["entity"], "pseudonym": token,
                                      "box": {k: w[k] for k in ("x0", "y0", "x1", "y1")}}
                                     for w in row.pop("_entities") or [] for token in tokens_in(w["text"])]
            return row
    return None


def _features_of(store: LineageStore, where: str, params: list, sessions: list[str] | None = None,
                 files: list[str] | None = None) -> list[dict]:
    cols = ("feature_id, event_id, session_id, source_id, granularity, modality, model_id, t_ns, box, cache_key, dim, "
            "filename")
    rows = store.query(f"SELECT {cols} FROM ({store.source('features', sessions, files)}) WHERE {where}", params)
    for r in rows:
        r["index_file"] = store.index_file(r["model_id"], r["granularity"])
    return sorted(rows, key=lambda r: (r["granularity"], r["feature_id"]))


def _ticks_of(store: LineageStore, event_id: str, session_id: str) -> list[dict]:
    return store.rows("records", "event_id = ?", [event_id], [session_id],
                      columns="session_id, tick_index, t_ns, source_id, decision, residual_ns, filename")


def _trace_event(store: LineageStore, tid: TraceId) -> tuple[dict, set]:
    assert tid.session_id is not None
    ev = _event(store, tid.text, tid.session_id)
    if ev is None:
        raise _unknown(tid, store, "event with this id")
    target = {"event": ev, "features": _features_of(store, "event_id = ?", [tid.text], [tid.session_id]),
              "timeline": _ticks_of(store, tid.text, tid.session_id)}
    return target, {(tid.session_id, tid.source_id)}


def _trace_feature(store: LineageStore, tid: TraceId) -> tuple[dict, set]:
    found = _features_of(store, "feature_id = ?", [tid.feature_id], files=store.feature_files_holding(tid.feature_id))
    if not found:
        raise _unknown(tid, store, "feature row with this feature_id")
    f = found[0]
    ev = _event(store, f["event_id"], f["session_id"])
    return ({"feature": f, "event": ev, "timeline": _ticks_of(store, f["event_id"], f["session_id"])},
            {(f["session_id"], f["source_id"])})


def _trace_tick(store: LineageStore, tid: TraceId) -> tuple[dict, set]:
    sid = tid.session_id
    rows = store.rows("records", "session_id = ? AND tick_index = ?", [sid, tid.tick], [sid],
                      columns="session_id, tick_index, t_ns, source_id, modality, event_id, event_t_ns, residual_ns, "
                              "decision, filename")
    if not rows:
        raise _unknown(tid, store, f"timeline row at tick {tid.tick} of session {sid!r}")
    rows.sort(key=lambda r: r["source_id"])
    for r in rows:
        r["event"] = _event(store, r["event_id"], sid) if r["event_id"] else None
    ctal = store.rows("ctal", "session_id = ? AND tick_index = ?", [sid, tid.tick], [sid])
    return {"timeline": rows, "ctal": ctal}, {(sid, r["source_id"]) for r in rows}


def _trace_file(store: LineageStore, tid: TraceId) -> tuple[dict, set]:
    rel = tid.path
    assert rel is not None
    if rel not in store.snapshot.files():
        raise ConfigError(f"unknown ID {tid.text!r}: not a file of the committed state of {store.root} "
                          f"(commit {store.snapshot.version} lists {len(store.snapshot.files())} files); "
                          f"give {ID_SYNTAX}")
    if rel.startswith(INDEX + "/"):  # a FAISS index: every feature row of its model and granularity
        model_dir, _, rest = Path(rel).name.partition("__")
        gran = rest.rsplit("-", 1)[0]
        prefix = f"features/{model_dir}/{gran}/"
        files = [f for f in store.files("features") if f.startswith(prefix)]
        pairs_rows = store.query(
            f"SELECT session_id, source_id, count(*) AS n FROM {store.parquet(files, 'features')} "
            "GROUP BY ALL") if files else []
        target = {"file": {"path": rel, "table": "index", "model": model_dir, "granularity": gran,
                           "vectors": sum(r["n"] for r in pairs_rows), "sessions": len({r["session_id"] for r in pairs_rows})}}
        return target, {(r["session_id"], r["source_id"]) for r in pairs_rows}
    sid = store.session_of[rel]
    if rel.startswith(CTAL_JSONL + "/"):
        lines = (store.layout.read_bytes(store.layout.path(rel)) or b"").count(b"\n")
        srcs = store.query(f"SELECT DISTINCT source_id FROM ({store.source('lineage_sources', [sid])})")
        return ({"file": {"path": rel, "table": "ctal_jsonl", "session_id": sid, "rows": lines}},
                {(sid, r["source_id"]) for r in srcs})
    table = next(name for name, row in TABLES.items() if rel.startswith(row.PATH + "/"))
    cols = {f.name for f in TABLES[table].schema()}
    path_sql = store.parquet([rel], table)
    if "source_id" in cols:
        srcs = store.query(f"SELECT source_id, count(*) AS n FROM {path_sql} GROUP BY ALL")
        pairs = {(sid, r["source_id"]) for r in srcs if r["source_id"] is not None}
        n = sum(r["n"] for r in srcs)
    else:  # session-wide tables (CTAL log, drift alarms): every source of the session
        n = store.query(f"SELECT count(*) AS n FROM {path_sql}")[0]["n"]
        pairs = {(sid, r["source_id"]) for r in store.query(
            f"SELECT DISTINCT source_id FROM ({store.source('lineage_sources', [sid])})")}
    return {"file": {"path": rel, "table": table, "session_id": sid, "rows": n}}, pairs


# -- access (GDPR Art. 15) ------------------------------------------------------------------

def validate_subject(subject: str) -> str:
    """The opaque data-subject id ``subject`` (``ConfigError`` for a name or an e-mail, not repeated)."""
    from pydantic import TypeAdapter, ValidationError

    from modalign.schemas.manifest import SubjectId

    try:
        return TypeAdapter(SubjectId).validate_python(str(subject).strip())
    except ValidationError:  # the value is not repeated: it may be the very name that must not be printed
        raise ConfigError("the subject is not a data-subject id: give the opaque id the manifest lists (letters, "
                          "digits, '_', '.', ':', '-'; e.g. subject-0001), never a name or an e-mail") from None


def access(out: str | PathLike, subject: str, registry: str | PathLike | None = None,
           key_store: str | PathLike | None = None) -> dict:
    """Everything OUT holds that derives from data subject ``subject`` (see the module docstring).

    With a subject registry (``registry``, or ``subjects.yaml`` in the key store when it
    exists; ``modalign.pipeline.subjects``) the report also lists ``mentions``: document
    events of any session that carry one of the subject's keyed pseudonyms."""
    subject = validate_subject(subject)
    with LineageStore(out) as store:
        report = {"subject": subject, **report_of(store, subject_sources(store, subject))}
        found = subject_mentions(store, subject, registry, key_store)
        if found is not None:
            report["mentions"] = found
            report["counts"]["mentions"] = len(found)
        return report


def subject_mentions(store: LineageStore, subject: str, registry: str | PathLike | None = None,
                     key_store: str | PathLike | None = None) -> list[dict] | None:
    """The document events of any session carrying ``subject``'s keyed pseudonyms (computed from
    the registry's identifiers with the tenant key); None without a registry (none given and
    none in the key store). A subject the registry does not list has none."""
    from modalign.pipeline.subjects import load_registry, mentions, registry_path, subject_pseudonyms

    path = registry_path(registry, key_store)
    if registry is None and not path.is_file():
        return None
    entry = load_registry(path, out=None if store.layout.is_s3 else store.root).entry(subject)
    return mentions(store, subject_pseudonyms(entry, key_store)) if entry is not None else []


def subject_sources(store: LineageStore, subject: str) -> set[tuple[str, str]]:
    """(session, source) of every committed source whose lineage row lists ``subject``."""
    hits = store.query(f"SELECT session_id, source_id FROM {store.view('lineage_sources')} "
                       "WHERE list_contains(subjects, ?) ORDER BY 1, 2", [subject])
    return {(r["session_id"], r["source_id"]) for r in hits}


def report_of(store: LineageStore, pairs: set[tuple[str, str]]) -> dict:
    """Everything the committed state holds that derives from the (session, source) ``pairs``:
    the body of an access report, and what an erasure removes (``pipeline.erasure``)."""
    sessions = sorted({s for s, _ in pairs})
    keys = [f"{s}\x1f{src}" for s, src in sorted(pairs)]
    cond = "session_id || chr(31) || source_id IN (SELECT unnest(?))"
    report: dict[str, Any] = {"out": store.layout.uri, "commit": store.snapshot.version,
                              "committed_at": store.snapshot.committed_at,
                              "sessions": sessions, "sources": store.origins(pairs) if pairs else []}
    events = []
    for table in EVENT_TABLES:
        extra = {"events_video": ", len(face_boxes) AS face_boxes, coalesce(len(text_boxes), 0) AS "
                                 "frame_text_regions, text_deid.method AS frame_text_method",
                 "events_pdf": ", pii_counts", "events_audio": ""}[table]
        for r in store.rows(table, cond, [keys], sessions,
                            columns=f"event_id, session_id, source_id, t_ns, deid{extra}, filename"):
            r["table"] = table
            events.append(r)
    report["events"] = sorted(events, key=lambda r: (r["session_id"], r["source_id"], r["t_ns"], r["event_id"]))
    report["timeline"] = store.rows(
        "records", cond, [keys], sessions,
        columns="session_id, tick_index, t_ns, source_id, modality, event_id, decision, filename")
    report["timeline"].sort(key=lambda r: (r["session_id"], r["tick_index"], r["source_id"]))
    by_session: dict[str, set[str]] = defaultdict(set)
    for s, src in pairs:
        by_session[s].add(src)
    ctal = store.rows("ctal", "session_id IN (SELECT unnest(?))", [sessions], sessions,
                      columns="event_id, session_id, tick_index, aligned_t_ns, modalities, decision, reason, filename")
    report["ctal"] = sorted((r for r in ctal if by_session[r["session_id"]] & {
        m.split(":", 1)[-1] for m in r["modalities"]}), key=lambda r: (r["session_id"], r["tick_index"]))
    alarms = store.rows("drift_alarms", "session_id IN (SELECT unnest(?))", [sessions], sessions)
    report["drift_alarms"] = [r for r in alarms if by_session[r["session_id"]] & set(r["sources"])]
    report["quarantine"] = store.rows("quarantine", cond, [keys], sessions,
                                      columns="session_id, source_id, source_uri, stage, reason_code, "
                                              "start_t_ns, end_t_ns, filename")
    report["features"] = _features_of(store, cond, [keys], sessions)
    report["faiss"] = _faiss_ids(report["features"])
    report["cache"] = _cache_entries(store, report["features"])
    report["pseudonyms"] = _pseudonyms(store, cond, keys, sessions)
    report["files"] = _files(report, store)
    report["counts"] = {k: len(report[k]) for k in ("sessions", "sources", "events", "timeline", "ctal",
                                                    "drift_alarms", "quarantine", "features", "cache",
                                                    "pseudonyms")}
    report["counts"]["faiss_ids"] = sum(len(ix["feature_ids"]) for ix in report["faiss"])
    return report


def _faiss_ids(features: list[dict]) -> list[dict]:
    groups: dict[tuple, list[int]] = defaultdict(list)
    for f in features:
        groups[(f["model_id"], f["granularity"], f["index_file"])].append(f["feature_id"])
    return [{"model_id": m, "granularity": g, "index_file": ix, "feature_ids": sorted(ids)}
            for (m, g, ix), ids in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1]))]


def _cache_entries(store: LineageStore, features: list[dict]) -> list[dict]:
    """The cache entries the features name, and the patch grids they were pooled from."""
    from modalign.operators.cache.store import SEGMENT_GLOB

    named: dict[str, dict] = {}
    for f in features:
        named.setdefault(f["cache_key"], {"cache_key": f["cache_key"], "granularity": f["granularity"],
                                          "model_id": f["model_id"], "parent_key": None, "segment": None})
    cache_dir = store.output.layout.cache_dir
    segments = sorted(cache_dir.glob(SEGMENT_GLOB)) if cache_dir is not None and cache_dir.is_dir() and named else []
    if segments:
        src = f"read_parquet({sql_list(str(p) for p in segments)}, union_by_name = true, filename = true)"
        cols = "cache_key, granularity, model_id, parent_key, filename"
        found = store.query(f"SELECT {cols} FROM {src} WHERE cache_key IN (SELECT unnest(?))", [list(named)])
        parents = {r["parent_key"] for r in found if r["parent_key"]} - set(named)
        if parents:
            found += store.query(f"SELECT {cols} FROM {src} WHERE cache_key IN (SELECT unnest(?))", [sorted(parents)])
        for r in found:
            e = named.setdefault(r["cache_key"], {"cache_key": r["cache_key"], "granularity": r["granularity"],
                                                  "model_id": r["model_id"], "parent_key": None, "segment": None})
            e["parent_key"] = r["parent_key"]
            e["segment"] = store.output.layout.relative(Path(r["filename"]))
    return sorted(named.values(), key=lambda e: (e["granularity"], e["cache_key"]))


def _pseudonyms(store: LineageStore, cond: str, keys: list[str], sessions: list[str]) -> list[dict]:
    rows = store.query(
        f"SELECT w.entity AS kind, w.text AS pseudonym, event_id FROM (SELECT event_id, unnest(words) AS w FROM "
        f"({store.source('events_pdf', sessions)}) WHERE {cond}) WHERE w.entity IS NOT NULL", [keys])
    found: dict[tuple[str, str], list[str]] = defaultdict(list)
    for r in rows:  # a kept or masked value holds no token (and is never shown)
        for token in tokens_in(r["pseudonym"]):
            found[(r["kind"], token)].append(r["event_id"])
    return [{"kind": k, "pseudonym": p, "occurrences": len(ev), "event_ids": sorted(set(ev))}
            for (k, p), ev in sorted(found.items())]


def _files(report: dict, store: LineageStore) -> dict[str, list[dict]]:
    """Per table, the committed files holding the subject's rows, with row counts."""
    per: dict[str, Counter] = defaultdict(Counter)
    for key, table in (("timeline", "records"), ("ctal", "ctal"), ("quarantine", "quarantine"),
                       ("features", "features")):
        for r in report[key]:
            per[table][r["filename"]] += 1
    for r in report["events"]:
        per[r["table"]][r["filename"]] += 1
    for s in report["sources"]:
        per["lineage_sources"][s["lineage_file"]] += 1
    return {t: [{"path": p, "rows": n} for p, n in sorted(c.items())] for t, c in sorted(per.items())}


# -- rendering ------------------------------------------------------------------------------

def _fmt_box(b: dict | None) -> str:
    return f"{b['x0']},{b['y0']},{b['x1']},{b['y1']}" if b else "-"


def _origin_lines(o: dict) -> list[str]:
    c = o["clock"]
    lines = [
        f"source {o['session_id']}/{o['source_id']} ({o['modality']}, {o['status']}, {o['events']} events)",
        f"  uri       {o['source_uri']}",
        f"  version   {o['source_version']}  {o['source_sha256'] or ''}".rstrip(),
        f"  run       {o['run_id']}  (commit {o['commit']})",
        "  operators " + " -> ".join(f"{op['kind']}@{op['version']}" for op in o["operators"]),
        f"  policy    {o['policy']['tag']}" + (f"  (content from {o['policy']['content_from']})"
                                               if o["policy"]["content"] else "  (content: no commit record holds it)"),
    ]
    for h in o["deid"]:
        lines.append(f"  deid      {h['method']} by {h['detector']}: {h['count']} removed (threshold {h['threshold']})")
    if o["removed"]:
        lines.append("  removed   " + json.dumps(o["removed"], sort_keys=True))
    lines.append(f"  clock     offset {c['offset_ns']} ns, skew {c['skew_ppm']} ppm: {c['obtained']}")
    lines.append("  models    " + (", ".join(o["model_ids"]) or "none (no features)"))
    if o["subjects"]:
        lines.append("  subjects  " + ", ".join(o["subjects"]))
    return lines


TIMELINE_SHOWN = 8  # timeline rows a human trace shows (a slide block is held for many ticks)


def render_trace(result: dict) -> str:
    """A human-readable trace (``modalign lineage trace``)."""
    t = result["target"]
    lines = [f"{result['kind']} {result['id']}  (commit {result['commit']} of {result['out']})"]
    ev = t.get("event")
    if "feature" in t:
        f = t["feature"]
        lines.append(f"  feature {f['feature_id']}: {f['granularity']} of {f['event_id']}, model {f['model_id']}, "
                     f"box {_fmt_box(f['box'])}, cache key {f['cache_key'][:16]}..., index {f['index_file']}")
    if ev:
        lines += _event_lines(ev)
    for f in t.get("features", []):
        lines.append(f"  feature {f['feature_id']} ({f['granularity']}, {f['model_id']}, box {_fmt_box(f['box'])})")
    timeline = t.get("timeline", [])
    for r in timeline[:TIMELINE_SHOWN]:
        lines.append(f"  tick {r['tick_index']} ({r['t_ns']} ns) {r['source_id']}: {r['decision']}"
                     + (f", {r['event_id']} residual {r['residual_ns']} ns" if r.get("event_id") else ""))
        if r.get("event"):
            lines += ["  " + x for x in _event_lines(r["event"])]
    if len(timeline) > TIMELINE_SHOWN:
        lines.append(f"  ... and {len(timeline) - TIMELINE_SHOWN} more ticks (--json lists them all)")
    for r in t.get("ctal", []):
        lines.append(f"  ctal {r['event_id']}: {r['decision']} ({r['reason']})")
    if "file" in t:
        lines.append("  file " + ", ".join(f"{k} {v}" for k, v in t["file"].items()))
    lines.append("")
    shown = result["origins"][:20]
    for o in shown:
        lines += _origin_lines(o)
    if len(result["origins"]) > len(shown):
        lines.append(f"... and {len(result['origins']) - len(shown)} more sources (--json lists them all)")
    return "\n".join(lines)


def _event_lines(ev: dict) -> list[str]:
    h = ev["deid"]
    lines = [f"  event {ev['event_id']} at {ev['t_ns']} ns ({ev['table']}): {h['method']} by {h['detector']}, "
             f"{h['count']} removed"]
    if ev.get("face_boxes"):
        lines.append("    face boxes " + "; ".join(_fmt_box(b) for b in ev["face_boxes"]))
    if ev.get("text_boxes"):
        lines.append("    frame-text boxes " + "; ".join(_fmt_box(b) for b in ev["text_boxes"]))
    if ev.get("pii_counts"):
        lines.append("    personal data " + ", ".join(f"{p['kind']} {p['count']}" for p in ev["pii_counts"]))
    for p in ev.get("pseudonyms", []):
        lines.append(f"    {p['kind']} -> {p['pseudonym']} at {_fmt_box(p['box'])}")
    return lines


def render_access(report: dict) -> str:
    """A terminal summary of an access report (the JSON or HTML holds every row)."""
    c = report["counts"]
    if not report["sources"]:
        return f"subject {report['subject']}: nothing is held in {report['out']} (commit {report['commit']})"
    lines = [f"subject {report['subject']} in {report['out']} (commit {report['commit']}):",
             "  " + ", ".join(f"{k} {v}" for k, v in c.items()), ""]
    for o in report["sources"]:
        lines += _origin_lines(o)
    for p in report["pseudonyms"]:
        lines.append(f"pseudonym {p['pseudonym']} ({p['kind']}): {p['occurrences']} occurrence(s)")
    for m in report.get("mentions", []):
        lines.append(f"mentioned as {m['pseudonym']} ({m['kind']}) in {m['event_id']}: {m['occurrences']} time(s)")
    lines.append("files holding these rows: " + ", ".join(f"{t} {len(fs)}" for t, fs in report["files"].items()))
    return "\n".join(lines)


# -- HTML pages a person reads (the access report here, the run report in ``pipeline.report``) --
# A short value stays on one line; a long one (a path, a hash, a detector string: class "w") may wrap
# anywhere rather than widen the page past the window.
_WRAP_AFTER = 24  # characters
PAGE_CSS = ("body{font-family:sans-serif;margin:2em;color:#222;line-height:1.35}"
            "table{border-collapse:collapse;margin:.5em 0 1.5em;max-width:100%}"
            "td,th{border:1px solid #bbb;padding:2px 6px;font-size:13px;text-align:left;vertical-align:top;"
            "white-space:nowrap}td.w{white-space:normal;overflow-wrap:anywhere}th{background:#eee}"
            "tr:nth-child(odd) td{background:#fafafa}"
            "code{font-size:.9em;overflow-wrap:anywhere}pre{font-size:12px;white-space:pre-wrap;overflow-wrap:anywhere}"
            "details{margin:.3em 0}summary{cursor:pointer;color:#1a4f8b}h2{margin-top:1.6em}")
FOLD_AFTER = 20  # rows: a longer table is folded in a <details> (a click opens it)


def html_escape(v: Any) -> str:
    """``v`` as HTML text or attribute value (None: empty), every markup character escaped."""
    return html.escape("" if v is None else str(v), quote=True)


def html_table(rows: list[dict], cols: list[str]) -> str:
    """A ``<table>`` of ``rows`` (dicts) in the order of ``cols``, every cell escaped (a dict or a
    list as JSON); long values may wrap."""
    e = html_escape
    head = "".join(f"<th>{e(c)}</th>" for c in cols)

    def td(v: Any) -> str:
        text = _cell(v)
        return f"<td class=\"w\">{e(text)}</td>" if len(text) > _WRAP_AFTER else f"<td>{e(text)}</td>"

    body = "".join("<tr>" + "".join(td(r.get(c)) for c in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def html_section(title: str, rows: list[dict], cols: list[str], empty: str = "none", level: int = 2) -> str:
    """A heading ``title (N)`` and the table of ``rows``, folded past ``FOLD_AFTER`` rows; ``empty``
    (a short note) when there are none."""
    e = html_escape
    body = (f"<details><summary>show all {len(rows)}</summary>{html_table(rows, cols)}</details>"
            if len(rows) > FOLD_AFTER else html_table(rows, cols) if rows else f"<p>{e(empty)}</p>")
    return f"<h{level}>{e(title)} ({len(rows)})</h{level}>" + body


def render_access_html(report: dict) -> str:
    """A self-contained HTML page of an access report: inline style, no scripts, no external
    resources, every value escaped."""
    e, table, section = html_escape, html_table, html_section

    c = report["counts"]
    parts = [
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">",
        f"<title>Access report: subject {e(report['subject'])}</title><style>{PAGE_CSS}</style></head><body>",
        f"<h1>Access report (GDPR Art. 15): subject <code>{e(report['subject'])}</code></h1>",
        f"<p>Output folder <code>{e(report['out'])}</code>, commit {e(report['commit'])} "
        f"({e(report['committed_at'])}). Every row below derives from a source whose lineage lists this subject"
        + (", except the mentions: document events of any session that carry one of the subject's keyed "
           "pseudonyms (found through the subject registry, which stays outside the output folder)"
           if "mentions" in report else "") + ". A long list is folded: click it to open it.</p>",
        table([{"what": k, "count": v} for k, v in c.items()], ["what", "count"]),
    ]
    if not report["sources"]:
        parts.append("<p>Nothing is held about this subject.</p>")
    for o in report["sources"]:
        parts.append(f"<h2>Source {e(o['session_id'])}/{e(o['source_id'])}</h2>")
        rows = [{"field": k, "value": v} for k, v in (
            ("modality", o["modality"]), ("status", o["status"]), ("uri", o["source_uri"]),
            ("version", o["source_version"]), ("sha256", o["source_sha256"]), ("run", o["run_id"]),
            ("events", o["events"]),
            ("operators", " -> ".join(f"{op['kind']}@{op['version']}" for op in o["operators"])),
            ("policy", o["policy"]["tag"]), ("clock", f"offset {o['clock']['offset_ns']} ns, skew "
                                                      f"{o['clock']['skew_ppm']} ppm: {o['clock']['obtained']}"),
            ("models", ", ".join(o["model_ids"])), ("removed", json.dumps(o["removed"], sort_keys=True)))]
        parts.append(table(rows, ["field", "value"]))
        parts.append("<h3>How it was de-identified</h3>" + table(o["deid"], ["method", "detector", "count",
                                                                             "threshold", "policy"]))
        if o["policy"]["content"]:
            parts.append(f"<details><summary>policy {e(o['policy']['tag'])} (content)</summary><pre>"
                         f"{e(json.dumps(o['policy']['content'], indent=1, sort_keys=True))}</pre></details>")
    events = [dict(r, method=r["deid"]["method"], detector=r["deid"]["detector"], removed=r["deid"]["count"])
              for r in report["events"]]
    parts += [
        section("Events", events, ["event_id", "table", "t_ns", "method", "detector", "removed"]),
        section("Timeline rows", report["timeline"], ["session_id", "tick_index", "source_id", "event_id", "decision"]),
        section("CTAL rows", report["ctal"], ["event_id", "tick_index", "decision", "reason"]),
        section("Drift alarms", report["drift_alarms"], ["session_id", "start_tick", "end_tick", "max_residual_ms"]),
        section("Features", report["features"], ["feature_id", "event_id", "granularity", "model_id", "cache_key"]),
        section("FAISS ids", [dict(ix, feature_ids=" ".join(map(str, ix["feature_ids"]))) for ix in report["faiss"]],
                ["index_file", "model_id", "granularity", "feature_ids"]),
        section("Feature cache entries", report["cache"], ["cache_key", "granularity", "model_id", "segment"]),
        section("Pseudonyms", report["pseudonyms"], ["pseudonym", "kind", "occurrences"]),
        section("Mentions in documents (subject registry)", report.get("mentions", []),
                ["session_id", "source_id", "event_id", "pseudonym", "kind", "occurrences"]),
        section("Quarantined inputs", report["quarantine"], ["session_id", "source_id", "stage", "reason_code"]),
        section("Files holding these rows", [{"table": t, **f} for t, fs in report["files"].items() for f in fs],
                ["table", "path", "rows"]),
        "</body></html>\n",
    ]
    return "".join(parts)


def _cell(v: Any) -> str:
    if isinstance(v, (dict, list)):
        return json.dumps(v, sort_keys=True, default=str)
    return "" if v is None else str(v)


def to_json(result: dict) -> str:
    return json.dumps(result, indent=2, sort_keys=True, default=str)


# why an access report stays outside OUT
ACCESS_REPORT_WHY = "it lists the subject's ids and pseudonyms, which an erasure must be able to remove"


def report_target(path: str | PathLike, out: str | PathLike, why: str = ACCESS_REPORT_WHY) -> Path:
    """The absolute local path a report file is written to; ``ConfigError`` when it lies inside OUT
    (after symlinks) or names object storage (``why``: the reason, for the message). No local
    path is inside an s3:// OUT."""
    from modalign.pipeline.objstore import Location

    if str(path).startswith("s3://"):
        raise ConfigError(f"--out {path}: a report is written to a local file; give a local path")
    target = Path(path).absolute()
    where = Location.parse(out if isinstance(out, str) else Path(out))
    if not where.is_s3 and target.resolve().is_relative_to(where.path.resolve()):
        raise ConfigError(f"--out {path} is inside the output folder {out}; write the report elsewhere ({why})")
    return target


def write_report(path: str | PathLike, text: str, out: str | PathLike, why: str = ACCESS_REPORT_WHY) -> Path:
    """Write a report file outside OUT (``report_target``): an access report inside would outlive an
    erasure of the subject, and OUT holds only what its commits list."""
    from modalign.schemas.files import atomic_write

    target = report_target(path, out, why)
    target.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(target, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
