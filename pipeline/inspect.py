"""``modalign inspect OUT``: a human summary of an output folder's latest commit, read with DuckDB.

DuckDB scans the committed files as the pyarrow datasets ``modalign.open`` gives (registered
as views), so an s3:// OUT reads the same way through pyarrow's S3 filesystem (DuckDB's own
httpfs extension is not needed)."""

from __future__ import annotations

from os import PathLike
from typing import Any

from modalign.pipeline.outputs import Output


def _files(output: Output, table: str, con: Any) -> str | None:
    """The name of a DuckDB view over the committed files of ``table``, or None when it has none."""
    if not output.files(table):
        return None
    con.register(table, output.table(table))
    return table


def collect(out: str | PathLike, storage: Any = None) -> dict:
    """Counts, residual stats per source, alarms and quarantine of an output folder (or s3:// prefix)."""
    import duckdb

    output = Output(out, storage)  # ConfigError: not an output folder, or nothing committed
    con = duckdb.connect()
    info: dict = {"run": output.run, "version": output.version, "residuals": [], "alarms": [], "quarantine": [],
                  "tables": {}}
    summary = _files(output, "ctal_summary", con)
    if summary:
        info["residuals"] = con.sql(
            f"SELECT session_id, source_id, modality, ticks, matched, gaps, residual_p50_ms, residual_p95_ms, "
            f"residual_max_ms, offset_ns, offset_method FROM {summary} ORDER BY 1, 2"
        ).to_arrow_table().to_pylist()
    alarms = _files(output, "drift_alarms", con)
    if alarms:
        info["alarms"] = con.sql(f"SELECT * FROM {alarms} ORDER BY session_id, start_tick") \
            .to_arrow_table().to_pylist()
    info["monitor"] = output.run.get("monitor") or {}
    m = _files(output, "monitor_alarms", con)
    alarms_all = (con.sql(f"SELECT * FROM {m} ORDER BY model_id, granularity, window_index, kind, modality, "
                          "property, session_id").to_arrow_table().to_pylist() if m else [])
    info["monitor_alarms"] = [a for a in alarms_all if a["kind"] != "quality_shift"]
    info["quality_alarms"] = [a for a in alarms_all if a["kind"] == "quality_shift"]
    qs = _files(output, "monitor_quality", con)  # the quality-shift rows over every committed session
    info["quality"] = (con.sql(f"SELECT * FROM {qs} WHERE session_id IS NULL OR (SELECT count(DISTINCT session_id) "
                               f"FROM {qs}) = 1 ORDER BY modality, property").to_arrow_table().to_pylist()
                       if qs else [])
    q = _files(output, "quarantine", con)
    if q:
        info["quarantine"] = con.sql(
            f"SELECT session_id, source_uri, stage, reason_code, message FROM {q} ORDER BY 1, 2"
        ).to_arrow_table().to_pylist()
    for name in ("records", "events_video", "events_audio", "events_pdf", "ctal", "features"):
        g = _files(output, name, con)
        info["tables"][name] = con.sql(f"SELECT count(*) FROM {g}").fetchall()[0][0] if g else 0
    return info


def timing_text(run: dict) -> str:
    """`` (Ray 1.2 s, actors ready 3.4 s, processing 20.1 s, commit 0.4 s)`` of a run summary's
    ``timing``; empty for a summary written before it was recorded."""
    t = run.get("timing") or {}
    parts = [f"{label} {t[k]:.1f} s" for k, label in (("ray_start_s", "Ray"), ("actors_ready_s", "actors ready"),
                                                      ("processing_s", "processing"), ("commit_s", "commit"))
             if t.get(k) is not None]
    return f" ({', '.join(parts)})" if parts else ""


def quality_lines(info: dict) -> list[str]:
    """The quality gates: this run's expectation violations, each property of the committed events
    against the reference (all sessions together), and the quality_shift alarms."""
    run = info["run"]
    c = (run.get("counts") or {}).get("quality") or {}
    q = (run.get("monitor") or {}).get("quality") or {}
    ref = q.get("reference")
    lines = [f"quality: {c.get('warn', 0)} warn, {c.get('drop', 0)} drop, {c.get('fail', 0)} fail violation(s); "
             f"{len(info.get('quality_alarms', []))} shift alarm(s) against " + (ref or "no reference")]
    def fmt(v: float | None, width: int, digits: int) -> str:
        return f"{'-':>{width}}" if v is None else f"{v:{width}.{digits}f}"

    if info.get("quality"):
        lines.append(f"  {'modality':<8} {'property':<16} {'n':>7} {'mean':>10} {'ref mean':>10} {'psi':>7} "
                     f"{'sigmas':>7}  alarm")
    for r in info.get("quality", []):
        lines.append(f"  {r['modality']:<8} {r['property']:<16} {r['current_n']:>7} {fmt(r['current_mean'], 10, 2)} "
                     f"{fmt(r['reference_mean'], 10, 2)} {fmt(r['psi'], 7, 3)} {fmt(r['shift_sigmas'], 7, 2)}  "
                     + ("ALARM" if r["alarm"] else ""))
    for a in info.get("quality_alarms", []):
        lines.append(f"  [quality_shift] {a['modality']} {a['property']} {a['session_id'] or 'all sessions'}: "
                     f"psi {a['value']:.3f} >= {a['threshold']:.3f}")
    return lines


def render(info: dict) -> str:
    run, c = info["run"], info["run"]["counts"]
    lines = [
        f"commit {info['version']}: run {run['run_id'][:8]}  finished {run['finished_at']}  in {run['elapsed_s']} s"
        f"{timing_text(run)}  policy {run['versions']['policy']}",
        f"sessions {c['sessions']}  ticks {c['ticks']}  events video {c['events']['video']} / audio "
        f"{c['events']['audio']} / pdf {c['events']['pdf']}",
        f"de-identified: {c['faces_blurred']} face boxes blurred, {c.get('frame_text_blurred', 0)} text regions "
        f"blurred in frames, {c['pii_replaced']} personal-data items replaced in documents",
        f"features: " + ", ".join(f"{g} {n}" for g, n in c["features"].items()) +
        "  cache: " + ", ".join(f"{g} {n} hit/{c['cache']['misses'].get(g, 0)} miss" for g, n in c["cache"]["hits"].items()),
        "",
        "alignment residuals (|event - tick|, ms):",
        f"  {'session':<20} {'source':<14} {'modality':<8} {'matched':>8} {'gaps':>6} {'p50':>7} {'p95':>7} {'max':>7}  offset",
    ]
    fmt = lambda v: f"{v:7.2f}" if v is not None else "      -"
    for r in info["residuals"]:
        lines.append(
            f"  {r['session_id']:<20} {r['source_id']:<14} {r['modality']:<8} {r['matched']:>8} {r['gaps']:>6} "
            f"{fmt(r['residual_p50_ms'])} {fmt(r['residual_p95_ms'])} {fmt(r['residual_max_ms'])}  "
            f"{r['offset_ns'] / 1e6:+.1f} ms ({r['offset_method']})"
        )
    lines.append("")
    lines.append(f"drift alarms: {len(info['alarms'])}")
    for a in info["alarms"]:
        lines.append(f"  {a['session_id']} ticks {a['start_tick']}-{a['end_tick']} "
                     f"({a['start_t_ns'] / 1e9:.2f}-{a['end_t_ns'] / 1e9:.2f} s) max {a['max_residual_ms']:.0f} ms")
    streams = info.get("monitor", {}).get("streams", [])
    lines.append(f"embedding monitor: {len(info.get('monitor_alarms', []))} alarm(s)"
                 + (" in " + "; ".join(f"{s['model_id']} {s['granularity']}: {s['windows']} windows, reference "
                                       f"{s['reference']}" for s in streams) if streams else " (no windows)"))
    for a in info.get("monitor_alarms", []):
        lines.append(f"  [{a['kind']}] {a['model_id']} {a['granularity']} {a['session_id']} window {a['window_index']} "
                     f"({a['start_t_ns'] / 1e9:.2f}-{a['end_t_ns'] / 1e9:.2f} s) "
                     + (f"divergence {a['value']:.3f} > {a['threshold']:.3f}" if a["kind"] == "embedding_drift" else
                        f"mean norm {a['value']:.3f}, reference {a['threshold']:.3f}"))
    lines += quality_lines(info)
    lines.append(f"quarantined: {len(info['quarantine'])}")
    for q in info["quarantine"]:
        lines.append(f"  [{q['reason_code']}] {q['source_uri']} ({q['stage']}): {q['message']}")
    lines.append("")
    lines.append("tables (rows): " + ", ".join(f"{k} {v}" for k, v in info["tables"].items()))
    return "\n".join(lines)
