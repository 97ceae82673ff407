"""OpenLineage run events of ``modalign run`` (and of any other writer of OUT, e.g. erasure).

Sits beside the commit, at the end of the data flow: the runner calls ``RunLineage`` at run
start, when each session is done and when the run ends, and it sends OpenLineage 2-0-2
RunEvents through openlineage-python's client:

- the run: START, then COMPLETE after the commit (FAIL when the run fails, ABORT when it is
  interrupted); runId = modalign's run id as a UUID, job ``openlineage.namespace`` /
  ``openlineage.job_name`` (config);
- each session: a child run (runId = uuid5 of the run's runId and the session id, job
  ``JOB_NAME.session.SESSION_ID``) whose ``parent`` facet names the run: START with the run's
  START, COMPLETE when its tables are written (FAIL / ABORT with the run if it is not done).

Inputs are the sources (namespace ``file`` or ``scheme://authority``, name the path), with a
``version`` facet: ``datasetVersion`` is the source version every output row carries, plus
the sha256 the worker hashed (known once the source was read). Outputs are the tables of OUT
(one dataset per table folder) with a ``schema`` facet from ``schemas.tables``, a
``columnLineage`` facet for derived columns (``COLUMN_LINEAGE``), and the custom
``modalign_deidentification`` facet: policy tag and digest, methods, detectors with
versions, counts per modality / method / detector, summed from the sources' lineage rows.
It holds ids, versions and counts only, never personal data (its JSON schema,
``schemas/openlineage/ModalignDeidentificationDatasetFacet.json``, allows nothing else).

Transports: by default each event is one JSON file in ``OUT/lineage/openlineage/``, written
atomically, named so that names sort by time (``<UTC time>-<run>-<seq>-<TYPE>.json``); it is
an append-only log beside the commit, not part of it (no commit lists it, no sweep touches it).
On an s3:// OUT each event is one object there (one PUT, whole or absent).
``openlineage.http`` also POSTs each event. Emitting never fails a run: a file or HTTP error is
logged as a warning (an HTTP endpoint that failed once is not tried again in that run).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from modalign.pipeline.layout import OutputLayout
from modalign.schemas.config import LineageEventsConfig
from modalign.schemas.errors import ModalignError
from modalign.schemas.files import atomic_write
from modalign.schemas.tables import ALL_TABLES, SourceLineageRow, _Row

log = logging.getLogger("modalign")

EVENTS_DIR = "lineage/openlineage"  # relative to OUT
PROJECT_URL = "https://modalign.dev"
DEID_FACET = "modalign_deidentification"
DEID_FACET_FILE = "ModalignDeidentificationDatasetFacet.json"
DEID_FACET_SCHEMA_URL = (f"{PROJECT_URL}/openlineage/facets/1-0-0/{DEID_FACET_FILE}"
                         "#/$defs/ModalignDeidentificationDatasetFacet")
TABLES: dict[str, type[_Row]] = {row.TABLE: row for row in ALL_TABLES}
EVENT_TABLES = {"events_video": "video", "events_audio": "audio", "events_pdf": "pdf"}  # table -> modality
SOURCE_FIELD = {"video": "frames", "audio": "waveform", "pdf": "pages"}  # what a source's rows derive from

# Derived columns: output table -> column -> what it is computed from, as (input, column,
# subtype, description); input "source:MODALITY" is the sources of that modality (their
# SOURCE_FIELD), any other input is a table. Only inputs the event has are listed.
COLUMN_LINEAGE: dict[str, dict[str, tuple[tuple[str, str, str, str], ...]]] = {
    "events_video": {
        "frame_jpeg": (("source:video", "frames", "TRANSFORMATION", "decoded, faces and on-screen text blurred "
                                                                    "and permuted, JPEG"),),
        "face_boxes": (("source:video", "frames", "TRANSFORMATION", "face detection"),),
        "text_boxes": (("source:video", "frames", "TRANSFORMATION", "OCR + personal-data detection"),),
        "t_ns": (("source:video", "frames", "TRANSFORMATION", "PTS on the session clock"),),
        "quality": (("source:video", "frames", "AGGREGATION", "luma mean, std and Laplacian variance of the "
                                                              "decoded frame, before de-identification"),),
    },
    "events_audio": {
        "mfcc": (("source:audio", "waveform", "TRANSFORMATION", "voice policy, then 40 MFCCs per 10 ms"),),
        "voiced": (("source:audio", "waveform", "TRANSFORMATION", "voice-activity detection"),),
        "quality": (("source:audio", "waveform", "AGGREGATION", "level, clipping and level over the noise floor "
                                                                "of each frame's window, before anonymisation"),),
    },
    "events_pdf": {
        "text": (("source:pdf", "pages", "TRANSFORMATION", "text layer or OCR, personal data pseudonymised"),),
        "words": (("source:pdf", "pages", "TRANSFORMATION", "OCR word boxes, personal data pseudonymised"),),
        "pii_counts": (("source:pdf", "pages", "AGGREGATION", "personal-data items found per kind"),),
        "quality": (("source:pdf", "pages", "AGGREGATION", "mean OCR confidence of the block's words"),),
    },
    "records": {
        "event_id": tuple((t, "event_id", "IDENTITY", "matched event") for t in EVENT_TABLES),
        "event_t_ns": tuple((t, "t_ns", "IDENTITY", "matched event's time") for t in EVENT_TABLES),
        "residual_ns": tuple((t, "t_ns", "TRANSFORMATION", "event time - tick time") for t in EVENT_TABLES),
    },
    "features": {
        "vector": (("events_video", "frame_jpeg", "TRANSFORMATION", "image encoder (frame, roi)"),
                   ("events_audio", "mfcc", "TRANSFORMATION", "MFCC statistics"),
                   ("events_pdf", "text", "TRANSFORMATION", "text encoder")),
        "box": (("events_video", "face_boxes", "IDENTITY", "face region pooled"),
                ("events_pdf", "box", "IDENTITY", "text block region")),
        "event_id": tuple((t, "event_id", "IDENTITY", "embedded event") for t in EVENT_TABLES),
    },
    "ctal": {"observed_offsets_ns": (("records", "residual_ns", "IDENTITY", "residual of each modality"),)},
    "ctal_summary": {c: (("records", "residual_ns", "AGGREGATION", f"{c} of the residuals"),)
                     for c in ("residual_p50_ms", "residual_p95_ms", "residual_max_ms")},
    "drift_alarms": {"max_residual_ms": (("records", "residual_ns", "AGGREGATION", "max pairwise residual"),)},
    "monitor_windows": {
        "divergence": (("features", "vector", "AGGREGATION", "KL of a window's histograms against the reference's"),),
        "mean_norm": (("features", "vector", "AGGREGATION", "mean L2 norm of a window's vectors"),),
    },
    "monitor_alarms": {"value": (("features", "vector", "AGGREGATION", "divergence or mean norm of the window"),
                                 *((t, "quality", "AGGREGATION", "PSI of a quality property against the reference")
                                   for t in EVENT_TABLES))},
    "monitor_quality": {c: tuple((t, "quality", "AGGREGATION", f"{c} of a quality property") for t in EVENT_TABLES)
                        for c in ("current_mean", "current_std", "psi", "shift_sigmas")},
}


@functools.lru_cache(maxsize=1)
def producer() -> str:
    """The ``producer`` / ``_producer`` URI of our events: the project and modalign's version
    (looked up once: reading the installed metadata costs ~10 ms, and every facet names it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("modalign")
    except PackageNotFoundError:
        v = "unknown"
    return f"{PROJECT_URL}/modalign/{v}"


def deid_facet_schema() -> dict:
    """The JSON schema of the de-identification facet, as shipped in the package."""
    from importlib.resources import files

    return json.loads((files("modalign.schemas") / "openlineage" / DEID_FACET_FILE).read_text("utf-8"))


# -- ids and names ---------------------------------------------------------------------------

def run_uuid(run_id: str) -> str:
    """The OpenLineage runId of a modalign run id (32 hex digits: the same UUID; anything else:
    a name-based UUID of it, stable too)."""
    try:
        return str(uuid.UUID(hex=run_id))
    except ValueError:
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"{PROJECT_URL}/run/{run_id}"))


def session_uuid(run_id: str, session_id: str) -> str:
    """The runId of a session's child run: the same for the same run and session."""
    return str(uuid.uuid5(uuid.UUID(run_uuid(run_id)), f"session:{session_id}"))


def dataset_name(uri_or_path: str | Path) -> tuple[str, str]:
    """(namespace, name) of a file or object by OpenLineage's naming: ``file`` and the absolute
    path for a local file, ``scheme://authority`` and the key for an object."""
    text = str(uri_or_path)
    parsed = urlparse(text)
    if parsed.scheme in ("", "file") or len(parsed.scheme) == 1:  # a path (a Windows drive letter too)
        path = unquote(parsed.path) if parsed.scheme == "file" else text
        return "file", str(Path(path).absolute())
    return f"{parsed.scheme}://{parsed.netloc}", unquote(parsed.path).lstrip("/")


def table_of(path: str) -> str | None:
    """The table a file of OUT (relative to it) belongs to (None: not a table's file)."""
    best = None
    for name, row in TABLES.items():
        if path.startswith(row.PATH + "/") and (best is None or len(row.PATH) > len(TABLES[best].PATH)):
            best = name
    return best if path.endswith(".parquet") else None


# -- facets ----------------------------------------------------------------------------------

def _facets():
    from openlineage.client.facet_v2 import (column_lineage_dataset, dataset_version_dataset, error_message_run,
                                             job_type_job, output_statistics_output_dataset, parent_run,
                                             processing_engine_run, schema_dataset)

    return (column_lineage_dataset, dataset_version_dataset, error_message_run, job_type_job,
            output_statistics_output_dataset, parent_run, processing_engine_run, schema_dataset)


def _arrow_fields(fields: Iterable[Any], descriptions: dict[str, str | None]) -> list[Any]:
    import pyarrow as pa

    schema_dataset = _facets()[7]
    out = []
    for f in fields:
        t = f.type
        inner = t.value_type if pa.types.is_list(t) or pa.types.is_large_list(t) else t
        children = _arrow_fields(list(inner), {}) if pa.types.is_struct(inner) else []
        out.append(schema_dataset.SchemaDatasetFacetFields(
            name=f.name, type=str(t), description=descriptions.get(f.name), fields=children))
    return out


def schema_facet(row: type[_Row]) -> Any:
    """The ``schema`` facet of a table: its Arrow schema, with the row model's descriptions."""
    descriptions = {name: info.description for name, info in row.model_fields.items()}
    return _facets()[7].SchemaDatasetFacet(fields=_arrow_fields(row.schema(), descriptions), producer=producer())


def _split_detector(detector: str) -> list[dict[str, str]]:
    """``a@1+b@2/x+y`` -> [{a, 1}, {b, 2/x+y}]: the detectors a de-identification header names."""
    parts: list[str] = []
    for piece in detector.split("+"):
        if "@" in piece or not parts:
            parts.append(piece)
        else:
            parts[-1] += "+" + piece
    out = []
    for p in parts:
        name, _, version = p.partition("@")
        if name and name != "none":
            out.append({"name": name, "version": version or "unknown"})
    return out


def _policy(tag: str) -> dict[str, str]:
    """The parts of a policy tag ``id@version+digest``."""
    pid, _, rest = tag.partition("@")
    version, _, digest = rest.rpartition("+")
    return {"tag": tag, "id": pid, "version": version, "digest": digest}


@dataclass(frozen=True)
class _DeidFacetFields:
    policy: dict
    methods: list
    detectors: list
    removed: list
    sources: int


def deid_facet(rows: Iterable[SourceLineageRow | dict]) -> Any:
    """The ``modalign_deidentification`` facet of a dataset whose rows derive from ``rows``
    (the sources' lineage rows): their de-identification headers summed per modality, method
    and detector. Raises ValueError when the rows carry more than one policy tag."""
    import attr
    from openlineage.client.generated.base import DatasetFacet

    rows = [r.model_dump() if isinstance(r, SourceLineageRow) else r for r in rows]
    tags = {r["policy"] for r in rows}
    if len(tags) > 1:
        raise ValueError(f"one dataset's rows carry several policies: {sorted(tags)}")
    counts: dict[tuple[str, str, str], int] = defaultdict(int)
    detectors: dict[tuple[str, str], None] = {}
    for r in rows:
        for h in r["deid"] or []:
            counts[(r["modality"], h["method"], h["detector"])] += int(h["count"])
            for d in _split_detector(h["detector"]):
                detectors[(d["name"], d["version"])] = None
    fields = _DeidFacetFields(
        policy=_policy(tags.pop()) if tags else {"tag": "none", "id": "none", "version": "none", "digest": "00000000"},
        methods=sorted({m for _, m, _ in counts}),
        detectors=[{"name": n, "version": v} for n, v in sorted(detectors)],
        removed=[{"modality": mod, "method": m, "detector": d, "count": n} for (mod, m, d), n in sorted(counts.items())],
        sources=len(rows))
    facet_cls = _deid_facet_class(DatasetFacet, attr)
    return facet_cls(producer=producer(),
                     **{k: getattr(fields, k) for k in ("policy", "methods", "detectors", "removed", "sources")})


_DEID_CLASS: Any = None


def _deid_facet_class(base: Any, attr: Any) -> Any:
    global _DEID_CLASS
    if _DEID_CLASS is None:
        @attr.define
        class ModalignDeidentificationDatasetFacet(base):  # type: ignore[misc, valid-type]
            policy: dict = attr.field(factory=dict)
            methods: list = attr.field(factory=list)
            detectors: list = attr.field(factory=list)
            removed: list = attr.field(factory=list)
            sources: int = 0

            @staticmethod
            def _get_schema() -> str:
                return DEID_FACET_SCHEMA_URL

        _DEID_CLASS = ModalignDeidentificationDatasetFacet
    return _DEID_CLASS


def _sources_by_modality(rows: Iterable[dict]) -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for r in rows:
        ds = dataset_name(r["source_uri"])
        if ds not in out[r["modality"]]:
            out[r["modality"]].append(ds)
    return out


KEEPS = frozenset({"keep", "waveform_dropped"})  # header methods that leave the personal data in (MFCCs of a voice)


def masking_of(rows: Iterable[dict]) -> dict[str, bool]:
    """Per modality: whether de-identification masked its personal data (a method other than keep)."""
    out: dict[str, bool] = defaultdict(bool)
    for r in rows:
        out[r["modality"]] |= any(h["method"] not in KEEPS for h in r["deid"] or [])
    return dict(out)


def column_lineage_facet(table: str, tables: dict[str, tuple[str, str]],
                         sources: dict[str, list[tuple[str, str]]], masking: dict[str, bool] | None = None) -> Any | None:
    """The ``columnLineage`` facet of ``table`` given the datasets the event has: ``tables``
    (table -> (namespace, name)), ``sources`` (modality -> [(namespace, name)]) and ``masking``
    (modality -> whether its de-identification masks: ``masking_of``)."""
    cl = _facets()[0]
    fields = {}
    for column, derivations in COLUMN_LINEAGE.get(table, {}).items():
        inputs = []
        for src, src_col, subtype, description in derivations:
            if src.startswith("source:"):
                modality = src.split(":", 1)[1]
                targets = sources.get(modality, [])
                is_masking = bool((masking or {}).get(modality)) and subtype == "TRANSFORMATION"
            else:
                targets = [tables[src]] if src in tables else []
                is_masking = False
            for ns, name in targets:
                inputs.append(cl.InputField(namespace=ns, name=name, field=src_col, transformations=[
                    cl.Transformation(type="DIRECT", subtype=subtype, description=description, masking=is_masking)]))
        if inputs:
            fields[column] = cl.Fields(inputFields=inputs)
    return cl.ColumnLineageDatasetFacet(fields=fields, producer=producer()) if fields else None


def input_datasets(rows: Iterable[dict]) -> list[Any]:
    """One input dataset per source file or object (a video's own audio shares its video's)."""
    from openlineage.client.event_v2 import InputDataset

    version = _facets()[1]
    seen: dict[tuple[str, str], Any] = {}
    for r in rows:
        key = dataset_name(r["source_uri"])
        if key in seen or r.get("source_version") is None:
            continue
        facet = version.DatasetVersionDatasetFacet(datasetVersion=r["source_version"], producer=producer())
        if r.get("source_sha256"):
            facet = facet.with_additional_properties(sha256=r["source_sha256"])
        seen[key] = InputDataset(namespace=key[0], name=key[1], facets={"version": facet})
    return list(seen.values())


def _layout(out: str | Path | OutputLayout) -> OutputLayout:
    return out if isinstance(out, OutputLayout) else OutputLayout.of(out)


def output_datasets(out: Path | OutputLayout, files: Iterable[str], rows: list[dict],
                    version: str | None = None) -> list[Any]:
    """One output dataset per table that ``files`` (relative to OUT) belong to, with schema,
    column-lineage, de-identification, statistics and (given a commit ``version``) version facets."""
    from openlineage.client.event_v2 import OutputDataset

    layout = _layout(out)
    version_facet, stats = _facets()[1], _facets()[4]
    by_table: dict[str, list[str]] = defaultdict(list)
    for f in files:
        t = table_of(f)
        if t is not None:
            by_table[t].append(f)
    tables = {t: dataset_name(layout.uri_of(layout.table_dir(t))) for t in sorted(by_table)}
    sources = _sources_by_modality(rows)
    datasets = []
    for t, (ns, name) in tables.items():
        modality = EVENT_TABLES.get(t)
        feeding = [r for r in rows if modality is None or r["modality"] == modality]
        facets: dict[str, Any] = {"schema": schema_facet(TABLES[t])}
        if feeding:  # a writer that knows no sources (an erasure) has nothing to say about them
            facets[DEID_FACET] = deid_facet(feeding)
        lineage = column_lineage_facet(t, tables, sources, masking_of(rows))
        if lineage is not None:
            facets["columnLineage"] = lineage
        if version is not None:
            facets["version"] = version_facet.DatasetVersionDatasetFacet(datasetVersion=version, producer=producer())
        size = sum(_size(layout, f) for f in by_table[t])
        datasets.append(OutputDataset(namespace=ns, name=name, facets=facets, outputFacets={
            "outputStatistics": stats.OutputStatisticsOutputDatasetFacet(fileCount=len(by_table[t]), size=size,
                                                                         producer=producer())}))
    return datasets


def _size(layout: OutputLayout, rel: str) -> int:
    try:
        return layout.size(layout.path(rel)) or 0
    except (OSError, ModalignError):  # statistics must not fail an event
        return 0


def run_event(event_type: str, *, run_id: str, namespace: str, job_name: str, inputs: list | None = None,
              outputs: list | None = None, parent: tuple[str, str, str] | None = None,
              error: BaseException | None = None, job_type: str = "JOB") -> Any:
    """One RunEvent. ``run_id`` is the OpenLineage runId (a UUID); ``parent`` is
    (runId, namespace, job name) of the parent run; ``error`` adds an ``errorMessage`` facet
    (a modalign error's code and message, only the type of any other exception)."""
    from openlineage.client.event_v2 import Job, Run, RunEvent, RunState

    (_, _, error_message, job_type_job, _, parent_run, engine, _) = _facets()
    from importlib.metadata import version as dist_version

    run_facets: dict[str, Any] = {"processing_engine": engine.ProcessingEngineRunFacet(
        version=producer().rsplit("/", 1)[1], name="modalign", openlineageAdapterVersion=dist_version(
            "openlineage-python"), producer=producer())}
    if parent is not None:
        pid, pns, pname = parent
        run_facets["parent"] = parent_run.ParentRunFacet(
            run=parent_run.Run(runId=pid), job=parent_run.Job(namespace=pns, name=pname),
            root=parent_run.Root(run=parent_run.RootRun(runId=pid), job=parent_run.RootJob(namespace=pns, name=pname)),
            producer=producer())
    if error is not None:
        run_facets["errorMessage"] = error_message.ErrorMessageRunFacet(
            message=_error_text(error), programmingLanguage="PYTHON", producer=producer())
    job = Job(namespace=namespace, name=job_name, facets={"jobType": job_type_job.JobTypeJobFacet(
        processingType="BATCH", integration="MODALIGN", jobType=job_type, producer=producer())})
    return RunEvent(eventType=RunState[event_type], eventTime=_now(), run=Run(runId=run_id, facets=run_facets),
                    job=job, inputs=inputs or [], outputs=outputs or [], producer=producer())


def _error_text(error: BaseException) -> str:
    from modalign.schemas.errors import ModalignError

    if isinstance(error, ModalignError):  # our messages name what failed and what to do, never payload
        return f"[{error.code}] {error.message}"
    return f"{type(error).__name__} (see the run's log)"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{time.time_ns() // 1000 % 1_000_000:06d}+00:00"


# -- transports ------------------------------------------------------------------------------

class _Transports:
    """An openlineage-python Transport that writes each event to OUT's event folder and, if set,
    POSTs it: one failing never stops the other, and nothing raises."""

    kind = "modalign"

    def __init__(self, folder: Path | None, http: Any | None, run_id: str, layout: OutputLayout | None = None) -> None:
        self.folder = folder
        self.layout = layout  # the layout ``folder`` is in (writes on object storage go through it)
        self.http = http
        self.run_tag = run_id.replace("-", "")[:12]
        self.seq = 0
        self._last_ns = 0
        self.written: list[Path] = []

    def emit(self, event: Any) -> None:
        from openlineage.client.serde import Serde

        text = Serde.to_json(event)
        self.seq += 1
        if self.folder is not None:
            self._write(text, event.eventType.value)
        if self.http is not None:
            try:
                self.http.emit(event)
            except Exception as exc:  # noqa: BLE001 - the endpoint's fault must not fail the run
                log.warning("environment fault: the OpenLineage HTTP endpoint %s failed (%s: %s); the rest of this "
                            "run's events are written to %s only", self.http.url, type(exc).__name__,
                            str(exc)[:200], self.folder or "no file transport")
                self.http.close()
                self.http = None

    def _write(self, text: str, event_type: str) -> None:
        ns = max(time.time_ns(), self._last_ns + 1000)  # strictly increasing, microsecond names
        self._last_ns = ns
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(ns // 10**9)) + f".{ns // 1000 % 10**6:06d}Z"
        path = self.folder / f"{stamp}-{self.run_tag}-{self.seq:05d}-{event_type}.json"

        def write(tmp: Path) -> None:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text + "\n")

        try:
            if self.layout is not None and self.layout.is_s3:
                self.written.append(self.layout.write_bytes(path, (text + "\n").encode("utf-8")))
            else:
                self.written.append(atomic_write(path, write))
        except OSError as exc:
            log.warning("could not write OpenLineage event %s (%s); the run goes on", path, exc.strerror or exc)
        except ModalignError as exc:  # the object store's fault
            log.warning("could not write OpenLineage event %s (%s); the run goes on", path, exc.message)

    def close(self, timeout: float = -1) -> bool:
        if self.http is not None:
            self.http.close()
        return True


def _http_transport(cfg: Any) -> Any:
    from openlineage.client.transport.http import ApiKeyTokenProvider, HttpConfig, HttpTransport, TokenProvider

    key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
    if cfg.api_key_env and not key:
        log.warning("openlineage.http.api_key_env names %s, which is not set: events are sent without a key",
                    cfg.api_key_env)
    retry = {"total": cfg.retries, "read": cfg.retries, "connect": cfg.retries, "backoff_factor": 0.2,
             "status_forcelist": [500, 502, 503, 504], "allowed_methods": ["POST"]}
    return HttpTransport(HttpConfig(url=cfg.url, endpoint=cfg.endpoint, timeout=cfg.timeout_s, retry=retry,
                                    auth=ApiKeyTokenProvider({"api_key": key}) if key else TokenProvider({})))


class Emitter:
    """Sends RunEvents of one writer of OUT through openlineage-python's client."""

    def __init__(self, config: LineageEventsConfig, out: Path | OutputLayout, run_id: str) -> None:
        self.config = config
        self.layout = _layout(out)
        self.out = self.layout.root
        self.client = None
        if not config.enabled or not (config.file or config.http):
            return
        from openlineage.client import OpenLineageClient

        http = None
        if config.http is not None:
            try:
                http = _http_transport(config.http)
            except Exception as exc:  # noqa: BLE001 - a bad endpoint must not fail the run
                log.warning("environment fault: OpenLineage HTTP transport %s unusable (%s); file events only",
                            config.http.url, exc)
        self.transports = _Transports(self.layout.path(EVENTS_DIR) if config.file else None, http, run_id,  # type: ignore[arg-type]
                                      self.layout)
        # The client can add the current folder's git checkout as the job's source code (the user's
        # folder, not modalign's code, and a remote URL can hold a token): switched off.
        self.client = OpenLineageClient(transport=self.transports,  # type: ignore[arg-type]
                                        config={"facets": {"source_code_location": {"disabled": True}}})

    def emit(self, event: Any) -> None:
        if self.client is None:
            return
        try:
            self.client.emit(event)
        except Exception as exc:  # noqa: BLE001 - lineage must never fail or corrupt the run
            log.warning("could not emit an OpenLineage event (%s: %s); the run goes on", type(exc).__name__, exc)


# -- one run ---------------------------------------------------------------------------------

def _never_raises(fn: Callable[..., None]) -> Callable[..., None]:
    """A lineage hook: whatever goes wrong building an event is logged, never the run's failure."""
    @functools.wraps(fn)
    def hook(*args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            log.warning("OpenLineage %s event not emitted (%s: %s); the run goes on", fn.__name__,
                        type(exc).__name__, exc)
    return hook


class RunLineage:
    """The events of one ``modalign run``: ``start``, ``session_done`` per session, then
    ``complete`` after the commit or ``end(error)`` (FAIL / ABORT). No hook ever raises."""

    def __init__(self, config: LineageEventsConfig, out: Path | OutputLayout, run_id: str) -> None:
        self.config = config
        self.out = _layout(out)  # OUT's layout: a folder or s3://bucket/prefix
        self.run_id = run_uuid(run_id)
        self.emitter = Emitter(config, self.out, run_id)
        self.sessions: dict[str, list[dict]] = {}  # session id -> its sources' rows (as known at start)
        self.done: dict[str, list[dict]] = {}  # session id -> its lineage rows
        self.ended = False

    def _session_job(self, session_id: str) -> str:
        return f"{self.config.job_name}.session.{session_id}"

    def _event(self, event_type: str, **kw: Any) -> None:
        self.emitter.emit(run_event(event_type, namespace=self.config.namespace, **kw))

    def _session_event(self, event_type: str, sid: str, **kw: Any) -> None:
        self._event(event_type, run_id=session_uuid(self.run_id, sid), job_name=self._session_job(sid),
                    parent=(self.run_id, self.config.namespace, self.config.job_name), job_type="TASK", **kw)

    @_never_raises
    def start(self, sessions: Iterable[Any]) -> None:
        """START of the run and of each session: inputs are the sources found at discovery."""
        for s in sessions:
            self.sessions[s.manifest.session_id] = _discovered(s)
        self._event("START", run_id=self.run_id, job_name=self.config.job_name,
                    inputs=input_datasets(r for rows in self.sessions.values() for r in rows))
        for sid, rows in self.sessions.items():
            self._session_event("START", sid, inputs=input_datasets(rows))

    @_never_raises
    def session_done(self, session_id: str, rows: Iterable[SourceLineageRow], files: Iterable[str]) -> None:
        """COMPLETE of a session whose tables are written: its sources (with their sha256) and tables."""
        rows = [r.model_dump() for r in rows]
        self.done[session_id] = rows
        self._session_event("COMPLETE", session_id, inputs=input_datasets(rows),
                            outputs=output_datasets(self.out, sorted(files), rows))

    @_never_raises
    def complete(self, snapshot: Any) -> None:
        """COMPLETE of the run after its commit: the tables it wrote, as committed."""
        files = sorted(f for s in snapshot.sessions.values() if s.get("run_id") == snapshot.run_id for f in s["files"])
        files += [f for f in snapshot.shared if f.startswith("monitor/")]  # the monitors' tables: every commit's own
        rows = [r for rows in self.done.values() for r in rows]
        self._event("COMPLETE", run_id=self.run_id, job_name=self.config.job_name, inputs=input_datasets(rows),
                    outputs=output_datasets(self.out, files, rows, version=str(snapshot.version)))
        self.ended = True

    @_never_raises
    def end(self, error: BaseException) -> None:
        """FAIL (ABORT when interrupted) of the run and of each session not done."""
        if self.ended:
            return
        self.ended = True
        kind = "ABORT" if isinstance(error, (KeyboardInterrupt, SystemExit)) else "FAIL"
        for sid in self.sessions:
            if sid not in self.done:
                self._session_event(kind, sid, error=error)
        rows = [r for rows in self.sessions.values() for r in rows]
        self._event(kind, run_id=self.run_id, job_name=self.config.job_name, inputs=input_datasets(rows),
                    error=error)



def _discovered(session: Any) -> list[dict]:
    """The sources of a discovered session as far as known before reading them (uri, stat version)."""
    from modalign.schemas.errors import InputError
    from modalign.schemas.files import stat_version

    rows = []
    for spec in session.manifest.ingest_sources():
        try:
            path = session.resolve(spec)
            if session.on_object_store:  # the listing's ETag and size: no request
                entry = session.entry(path)
                version = entry.version if entry is not None else None
            else:
                version = stat_version(path) if path.is_file() else None
        except (InputError, OSError):
            continue  # quarantined at discovery: not an input
        rows.append({"source_uri": path.as_uri(), "source_version": version, "modality": spec.modality})
    return rows


# -- other writers of OUT --------------------------------------------------------------------

def emit(out: str | Path, event_type: str, *, job_name: str, run_id: str | None = None,
         inputs: Iterable[str] = (), outputs: Iterable[str] = (), error: BaseException | None = None,
         config: LineageEventsConfig | None = None) -> str:
    """Emit one RunEvent for any writer of OUT (an erasure, a re-index) through the configured
    transports; returns its runId. ``inputs`` / ``outputs`` are files or objects (URIs or
    paths) and files of OUT (relative to it) whose tables the writer rewrote; the job is
    ``config.namespace`` / ``job_name``. Call it with the same ``run_id`` for START and for
    COMPLETE / FAIL. Never raises on a transport failure (logged as a warning)."""
    config = config or LineageEventsConfig()
    rid = run_uuid(run_id or uuid.uuid4().hex)
    ins = [{"source_uri": str(u), "source_version": "unknown", "modality": "none"} for u in inputs]
    event = run_event(event_type, run_id=rid, namespace=config.namespace, job_name=job_name,
                      inputs=input_datasets(ins), outputs=output_datasets(Path(out), list(outputs), []),
                      error=error)
    Emitter(config, Path(out), rid).emit(event)
    return rid


def emit_erasure(out: str | Path, erasure_id: str, files: Iterable[str], *, event_type: str = "COMPLETE",
                 error: BaseException | None = None, config: LineageEventsConfig | None = None) -> str:
    """The run event of an erasure of OUT (``modalign lineage erase``): job ``JOB_NAME.erasure``,
    runId from ``erasure_id`` (pass the same id for START and COMPLETE / FAIL), outputs the
    tables whose ``files`` (relative to OUT, of the new commit) it rewrote. The subject or
    source erased is not named in the event (it is in the signed report, not in lineage)."""
    config = config or LineageEventsConfig()
    return emit(out, event_type, job_name=f"{config.job_name}.erasure", run_id=erasure_id, outputs=files,
                error=error, config=config)
