"""The quality gates at a commit: a broken ``fail`` expectation stops it, and the shift check over the
committed events (``monitor/quality``).

Where it sits: called by the runner's commit (and by an erasure's, over what is left), on the driver,
next to the embedding monitor (``pipeline.monitors``). The ingest workers measured every record's
properties (the events' ``quality`` column, ``operators.quality``) and applied the expectations
(``pipeline.worker``); here:

- ``check_failures``: a ``quality_failed`` row of the run (a record broke a ``fail`` expectation)
  raises ``QualityGateError`` before anything is committed (exit 1), naming the source, the
  property, the value and the expectation.
- ``monitor_quality``: per (modality, property), the committed values of each session, and of all
  sessions together when there are several, against every committed value of the reference output
  (``--reference OUT0``, ``monitor.reference``): count, mean, std and percentiles on both sides, the
  PSI and the mean shift (``operators.quality.shift``). Rows: ``monitor/quality/ATTEMPT.parquet``
  (``QualityShiftRow``); alarms (kind ``quality_shift``) into ``monitor/alarms/`` beside the embedding
  monitor's. Without a reference the rows summarise the properties and nothing alarms. Rebuilt by
  every commit from the committed events, so the rows describe exactly the committed state, in
  the same order for any batching or number of actors. Statistics only.
- ``record``: run.json's ``monitor.quality``, ``counts.monitor_alarms.quality_shift``,
  ``counts.quality`` (expectation violations of this run per action) and ``quality`` (per expectation).

What an alarm means and what to do: ``runbooks/quality-shift.md``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from modalign.operators.quality.gate import QualityGate, property_values
from modalign.operators.quality.shift import compare, summarize
from modalign.pipeline.layout import OutputLayout
from modalign.schemas.arrow import rows_to_table
from modalign.schemas.config import QualityConfig, QualityShiftConfig
from modalign.schemas.errors import QualityGateError, QuarantineReason
from modalign.schemas.tables import (QUALITY_PROPERTIES, MfccRow, MonitorAlarmRow, QualityShiftRow, QuarantineRow,
                                     TextBlockRow, VideoFrameRow, _Row)

EVENT_ROWS: dict[str, type[_Row]] = {"video": VideoFrameRow, "audio": MfccRow, "pdf": TextBlockRow}
ACTIONS = ("warn", "drop", "fail")


def check_failures(rows: Iterable[QuarantineRow]) -> None:
    """Raise ``QualityGateError`` for the first (by session, source, time) ``quality_failed`` row."""
    failed = sorted((r for r in rows if r.reason_code == QuarantineReason.QUALITY_FAILED),
                    key=lambda r: (r.session_id, r.source_id or "", r.start_t_ns or 0))
    if not failed:
        return
    first = failed[0]
    more = f" ({len(failed) - 1} more source(s) broke a fail expectation too)" if len(failed) > 1 else ""
    raise QualityGateError(f"session {first.session_id}, source {first.source_id}: {first.message.split('; ')[0]}"
                           f"{more}; the run stopped before its commit, nothing of it was committed (OUT keeps its "
                           "last commit); fix the source, or change the expectation's action (quality.expectations)",
                           source_uri=first.source_uri, stage="quality")


def quality_reference(out0: str | None, storage: Any = None) -> tuple[OutputLayout | None, list[str], str | None]:
    """``(layout, committed event files, uri)`` of the reference output; ``(None, [], None)`` without one.
    ConfigError when it is no modalign output."""
    if out0 is None:
        return None, [], None
    from modalign.pipeline.outputs import Output

    ref = Output(out0, storage)
    files = sorted(f for f in ref.snapshot.files() if f.startswith("events/") and f.endswith(".parquet"))
    return ref.layout, files, ref.uri


def _by_modality(files: Iterable[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for modality, row in EVENT_ROWS.items():
        prefix = row.PATH + "/"
        out[modality] = sorted(f for f in files if f.startswith(prefix) and f.endswith(".parquet"))
    return out


def read_values(layout: OutputLayout, files: list[str], modality: str) -> dict[str, dict[str, Any]]:
    """Per property of ``modality``: ``{"sessions": {session_id: values}, "spans": {session_id: (t0, t1)}}``
    of the committed event ``files`` (relative to OUT; NaN-free, in file order). Files written before the
    quality column read it as null: no values."""
    import pyarrow.dataset as ds

    props = QUALITY_PROPERTIES[modality]
    if not files:
        return {}
    row = EVENT_ROWS[modality]
    columns = sorted({p.column[0] for p in props.values()})
    with layout.faults(layout.path(files[0]).parent, "read"):
        t = ds.dataset([str(layout.path(f)) for f in files], format="parquet", filesystem=layout.fs,
                       schema=row.schema()).to_table(columns=["session_id", "t_ns", *columns])
    sessions = t.column("session_id").to_numpy(zero_copy_only=False).astype(str)
    t_ns = t.column("t_ns").to_numpy()
    order = np.argsort(sessions, kind="stable")
    sessions, t_ns = sessions[order], t_ns[order]
    names, starts = np.unique(sessions, return_index=True)
    bounds = list(zip(names.tolist(), starts.tolist(), [*starts[1:].tolist(), len(sessions)]))
    out: dict[str, dict[str, Any]] = {}
    for name, prop in props.items():
        values = property_values(t, prop.column)[order]
        per, spans = {}, {}
        for sid, a, b in bounds:
            v = values[a:b]
            ok = ~np.isnan(v)
            per[sid] = v[ok]
            spans[sid] = (int(t_ns[a:b][ok].min()), int(t_ns[a:b][ok].max())) if ok.any() else (None, None)
        out[name] = {"sessions": per, "spans": spans}
    return out


def monitor_quality(layout: OutputLayout, event_files: list[str], attempt: str, config: QualityShiftConfig,
                    reference: OutputLayout | None = None, reference_files: list[str] = (),
                    reference_uri: str | None = None) -> dict[str, Any]:
    """The shift check over the committed ``event_files`` (relative to OUT); writes ``monitor/quality``
    and the ``quality_shift`` alarms (``monitor/alarms``, a file of their own). Returns ``{"files",
    "rows", "alarms", "by_modality": {modality: alarms}, "reference", "properties": [...]}``."""
    summary: dict[str, Any] = {"files": [], "rows": 0, "alarms": 0, "by_modality": {m: 0 for m in EVENT_ROWS},
                               "reference": reference_uri if reference is not None else None, "properties": []}
    if not config.enabled:
        return summary
    current = _by_modality(event_files)
    ref_files = _by_modality(reference_files) if reference is not None else {}
    rows: list[dict] = []
    alarms: list[dict] = []
    for modality in EVENT_ROWS:
        values = read_values(layout, current[modality], modality)
        if not values:
            continue
        ref_values = read_values(reference, ref_files.get(modality, []), modality) if reference is not None else {}
        for prop, got in values.items():
            ref = None
            if reference is not None:
                per = ref_values.get(prop, {}).get("sessions", {})
                ref = np.concatenate(list(per.values())) if per else np.zeros(0)
            sessions = got["sessions"]
            groups = [(sid, v, got["spans"][sid]) for sid, v in sessions.items()]
            if len(groups) > 1:  # and every session together (the one-session case is its own row)
                groups.append((None, np.concatenate([v for _sid, v, _span in groups]), (None, None)))
            for sid, v, span in groups:
                row = _row(modality, prop, sid, v, ref, reference_uri if reference is not None else None, config)
                rows.append(row)
                if sid is None or len(groups) == 1:
                    summary["properties"].append({k: row[k] for k in (
                        "modality", "property", "current_n", "current_mean", "reference_mean", "psi",
                        "shift_sigmas", "alarm")})
                if row["alarm"]:
                    alarms.append({"kind": "quality_shift", "model_id": None, "granularity": None, "session_id": sid,
                                   "window_index": None, "start_t_ns": span[0], "end_t_ns": span[1],
                                   "value": row["psi"], "threshold": config.psi_threshold,
                                   "modality": modality, "property": prop})
    for row_type, data, path in ((QualityShiftRow, rows, layout.monitor(QualityShiftRow, attempt)),
                                 (MonitorAlarmRow, alarms,
                                  layout.table_dir(MonitorAlarmRow) / f"{attempt}-quality.parquet")):
        with layout.faults(path):
            if layout.write_table(path, rows_to_table(row_type, data)) is not None:
                summary["files"].append(layout.relative(path))
    summary["rows"] = len(rows)
    summary["alarms"] = len(alarms)
    summary["by_modality"].update(Counter(a["modality"] for a in alarms))
    return summary


def _row(modality: str, prop: str, session_id: str | None, values: np.ndarray, ref: np.ndarray | None,
         reference_uri: str | None, config: QualityShiftConfig) -> dict:
    cur = summarize(values)
    row = {"modality": modality, "property": prop, "session_id": session_id, "current_n": cur.n,
           "current_mean": cur.mean, "current_std": cur.std, "current_p05": cur.p05, "current_p50": cur.p50,
           "current_p95": cur.p95, "reference": reference_uri, "reference_n": None, "reference_mean": None,
           "reference_std": None, "psi": None, "shift_sigmas": None, "alarm": False}
    if ref is None:
        return row
    rs = summarize(ref)
    shift = compare(ref, values, bins=config.bins, psi_threshold=config.psi_threshold,
                    shift_sigmas=config.shift_sigmas, min_events=config.min_events,
                    min_sigma=config.min_sigma.get(f"{modality}.{prop}", 0.0),
                    min_sigma_fraction=config.min_sigma_fraction)
    row.update(reference_n=rs.n, reference_mean=rs.mean, reference_std=rs.std, psi=shift.psi,
               shift_sigmas=shift.shift_sigmas, alarm=shift.alarm)
    return row


def violations(counts: Mapping[str, int], config: QualityConfig) -> tuple[dict[str, int], list[dict]]:
    """``({action: records}, [per expectation: its fields and "violations"])`` of a run's counters
    (``QualityGate.counter`` keys, summed over its sources)."""
    per_action = {a: 0 for a in ACTIONS}
    listed = []
    for i, e in enumerate(config.expectations):
        n = counts.get(QualityGate.counter(e.action, e.modality, i), 0)
        per_action[e.action] += n
        listed.append({"index": i, **e.model_dump(mode="json"), "violations": n})
    return per_action, listed


def record(summary: dict, result: dict, counts: Mapping[str, int] | None = None,
           config: QualityConfig | None = None) -> None:
    """Put a commit's quality figures into its run summary (``counts``/``config``: the run's expectation
    counters, when this commit ran sources; an erasure keeps its base's)."""
    summary.setdefault("monitor", {})["quality"] = {k: result[k] for k in ("reference", "rows", "alarms",
                                                                            "by_modality", "properties")}
    summary.setdefault("counts", {}).setdefault("monitor_alarms", {})["quality_shift"] = result["alarms"]
    if counts is not None and config is not None:
        per_action, listed = violations(counts, config)
        summary["counts"]["quality"] = per_action
        summary["quality"] = {"expectations": listed}
