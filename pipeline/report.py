"""``modalign report OUT``: one self-contained HTML page that shows a reviewer an output folder's
latest commit.

Sits after the run, beside ``inspect`` (a text summary) and the access report (one subject):
``collect`` reads the committed state through ``Output`` (``modalign.open``: the files the commit
lists, never a folder listing), with DuckDB over the committed tables registered as pyarrow
datasets, so an s3:// OUT reads the same way (no httpfs), and only the columns a section needs
are scanned. ``render`` draws the plots with matplotlib's Agg renderer (imported inside the
functions: the CLI's ``--help`` stays light) as PNG inlined in ``data:`` URLs, with the access
report's style and escaping (``pipeline.lineage``): no script, no external resource, readable
offline. ``build_report`` is both.

What it shows, each section from its committed table (a missing or empty one: "none recorded"):

| section | from |
| --- | --- |
| alignment residuals per source (box plot, table) | ``records`` (residual_ns), ``ctal/summary`` |
| clock offsets and drift over session time (a plot per session, alarms shaded) | ``records``, ``ctal/alarms``, ``ctal/summary``, ``lineage/sources`` clock columns |
| CTAL decisions over session time (stacked counts) | ``ctal/log``, ``records`` (ticks) |
| de-identified items per kind and source | ``lineage/sources`` de-identification headers, run.json counters |
| quarantine | ``quarantine`` |
| per-stage time and throughput | run.json ``timing`` and ``counts`` |
| feature-cache hit rates | run.json ``counts.cache`` (what ``modalign cache stats`` reports as the last run's) |
| monitors: divergence and threshold per window, alarms | ``monitor/embedding``, ``monitor/alarms``, ``monitor/quality`` (when committed) |

Statistics only: no frame, MFCC, text block, word, vector or pseudonym key is read (the event
tables and the key store are not opened), so the page holds no personal data. Like the access
report, the file is written outside OUT (``lineage.write_report``): OUT holds what its commits
list, nothing else.
"""

from __future__ import annotations

import base64
import io
import math
from os import PathLike
from typing import Any

from modalign.pipeline.lineage import PAGE_CSS, _clock, html_escape, html_section, html_table, report_target, \
    write_report
from modalign.pipeline.outputs import Output

QUALITY_PATH = "monitor/quality"  # the modality-quality monitor's table, when a commit holds one
MAX_SOURCES_PLOTTED = 24  # sources in one bar or box plot (the table lists them all)
MAX_SESSIONS_PLOTTED = 12  # sessions with a drift plot of their own
MAX_POINTS = 1000  # points per source in a drift plot: longer sessions are binned (the largest residual kept)
MAX_CTAL_BINS = 60  # bars of the CTAL decisions plot
REPORT_WHY = "OUT holds only what its commits list; a report is a view of one commit, kept beside it"
NONE = "none recorded"
FIG_WIDTH_IN, DPI = 10.0, 100  # 1,000 px: fits the 1,280 px window with the page's margins


# -- reading the commit ------------------------------------------------------------------------

def collect(out: str | PathLike, storage: Any = None) -> dict:
    """Every number and series the page shows, read from OUT's latest commit (a folder or s3://)."""
    import duckdb

    output = Output(out, storage)  # ConfigError: not an output folder, or nothing committed
    con = duckdb.connect()
    have = {name: _register(con, output, name) for name in (
        "records", "ctal", "ctal_summary", "drift_alarms", "lineage_sources", "quarantine", "monitor_windows",
        "monitor_alarms")}
    q = lambda sql, params=None: _rows(con, sql, params)  # noqa: E731
    run = output.run or {}
    info: dict[str, Any] = {"out": output.uri, "commit": output.version, "committed_at": output.snapshot.committed_at,
                            "run": run, "sessions": sorted(output.snapshot.sessions)}
    tick_hz = float(((run.get("config") or {}).get("align") or {}).get("tick_hz") or 25.0)
    info["drift_threshold_ms"] = ((run.get("config") or {}).get("align") or {}).get("drift_threshold_ms")

    # alignment residuals, per source, from the timeline itself
    info["residuals"] = q(
        "SELECT session_id, source_id, any_value(modality) AS modality, count(*) AS ticks, "
        "count(*) FILTER (WHERE decision = 'matched') AS matched, count(*) FILTER (WHERE decision = 'gap') AS gaps, "
        "avg(r) AS mean_ms, avg(abs(r)) AS mean_abs_ms, quantile_cont(abs(r), 0.5) AS p50_abs_ms, "
        "quantile_cont(abs(r), 0.95) AS p95_abs_ms, max(abs(r)) AS max_abs_ms, min(r) AS min_ms, max(r) AS max_ms, "
        "quantile_cont(r, 0.05) AS q05, quantile_cont(r, 0.25) AS q25, quantile_cont(r, 0.5) AS q50, "
        "quantile_cont(r, 0.75) AS q75, quantile_cont(r, 0.95) AS q95 "
        "FROM (SELECT *, residual_ns::DOUBLE / 1e6 AS r FROM records) GROUP BY 1, 2 ORDER BY 1, 2"
    ) if have["records"] else []
    info["ctal_summary"] = q("SELECT * FROM ctal_summary ORDER BY session_id, source_id") \
        if have["ctal_summary"] else []
    info["alarms"] = q("SELECT * FROM drift_alarms ORDER BY session_id, start_tick") if have["drift_alarms"] else []
    lineage = q("SELECT session_id, source_id, modality, status, events, deid, clock_offset_ns, clock_skew_ppm, "
                "clock_method, clock_reference, track_of FROM lineage_sources ORDER BY session_id, source_id") \
        if have["lineage_sources"] else []
    summary = {(s["session_id"], s["source_id"]): s for s in info["ctal_summary"]}
    info["clocks"] = [dict(r, obtained=_clock(r, summary.get((r["session_id"], r["source_id"])))["obtained"],
                           summary=summary.get((r["session_id"], r["source_id"]))) for r in lineage]
    info["deid"] = [{"session_id": r["session_id"], "source_id": r["source_id"], "modality": r["modality"],
                     "events": r["events"], **{k: h[k] for k in ("method", "detector", "count")}}
                    for r in lineage for h in (r["deid"] or [])]

    # drift over session time, for the sessions a reviewer looks at first
    info["drift"] = _drift_series(con, output, info, int(round(1e9 / tick_hz))) if have["records"] else []

    # CTAL decisions over session time (records give the ticks; ctal the non-clean decisions)
    info["ctal"] = _ctal(con, have, tick_hz)

    info["quarantine"] = q("SELECT session_id, source_id, source_uri, stage, reason_code, message, start_t_ns, "
                           "end_t_ns FROM quarantine ORDER BY session_id, source_uri, stage, start_t_ns") \
        if have["quarantine"] else []
    info["monitor_windows"] = q("SELECT * FROM monitor_windows ORDER BY model_id, granularity, window_index") \
        if have["monitor_windows"] else []
    info["monitor_alarms"] = q("SELECT * FROM monitor_alarms ORDER BY model_id, granularity, window_index, kind") \
        if have["monitor_alarms"] else []
    info["quality"] = _quality(output)
    con.close()
    return info


def _register(con: Any, output: Output, table: str) -> bool:
    """Register the committed files of ``table`` with DuckDB under its name; False when it has none."""
    if not output.files(table):
        return False
    con.register(table, output.table(table))
    return True


def _rows(con: Any, sql: str, params: list | None = None) -> list[dict]:
    rel = con.execute(sql, params or [])
    names = [d[0] for d in rel.description]
    return [dict(zip(names, row)) for row in rel.fetchall()]


def _drift_series(con: Any, output: Output, info: dict, tick_ns: int) -> list[dict]:
    """Per plotted session: each source's residual (ms) over session time (s), binned to at most
    ``MAX_POINTS`` points (bins of whole ticks; the residual of largest magnitude in a bin), and the
    max pairwise residual across sources per tick (what the drift alarm measures). Sessions with drift alarms come first,
    then those with the largest residuals. Each session's queries read its own records files only
    (the commit lists them per session), not every session's."""
    import pyarrow.dataset as ds

    from modalign.pipeline.layout import TABLES

    alarmed = {a["session_id"] for a in info["alarms"]}
    worst: dict[str, float] = {}
    for r in info["residuals"]:
        if r["max_abs_ms"] is not None:
            worst[r["session_id"]] = max(worst.get(r["session_id"], 0.0), r["max_abs_ms"])
    sessions = sorted({r["session_id"] for r in info["residuals"]},
                      key=lambda s: (s not in alarmed, -worst.get(s, 0.0), s))
    out = []
    prefix = TABLES["records"].PATH + "/"
    for sid in sessions[:MAX_SESSIONS_PLOTTED]:
        files = [str(output.root / f) for f in sorted(output.snapshot.sessions.get(sid, {}).get("files", ()))
                 if f.startswith(prefix) and f.endswith(".parquet")]
        con.register("session_records", ds.dataset(files, schema=TABLES["records"].schema(), format="parquet",
                                                   filesystem=output.filesystem))
        lo, hi = _rows(con, "SELECT min(t_ns) AS lo, max(t_ns) AS hi FROM session_records WHERE session_id = ?",
                       [sid])[0].values()
        bin_ns = tick_ns * max(1, math.ceil(((hi or 0) - (lo or 0) + 1) / MAX_POINTS / tick_ns))
        points = _rows(con, "SELECT source_id, (t_ns // ?) * ? AS t, arg_max(residual_ns, abs(residual_ns)) AS r "
                            "FROM session_records WHERE session_id = ? AND residual_ns IS NOT NULL GROUP BY ALL "
                            "ORDER BY 1, 2", [bin_ns, bin_ns, sid])
        pairwise = _rows(con, "SELECT (t // ?) * ? AS t, max(p) AS p FROM (SELECT tick_index, any_value(t_ns) AS t, "
                              "max(residual_ns) - min(residual_ns) AS p FROM session_records WHERE session_id = ? AND "
                              "residual_ns IS NOT NULL GROUP BY tick_index HAVING count(*) > 1) GROUP BY ALL ORDER BY 1",
                         [bin_ns, bin_ns, sid])
        series: dict[str, dict] = {}
        for p in points:
            s = series.setdefault(p["source_id"], {"t_s": [], "residual_ms": []})
            s["t_s"].append(p["t"] / 1e9)
            s["residual_ms"].append(p["r"] / 1e6)
        out.append({"session_id": sid, "sources": series, "binned_ms": bin_ns / 1e6 if bin_ns > tick_ns else None,
                    "pairwise": {"t_s": [p["t"] / 1e9 for p in pairwise], "ms": [p["p"] / 1e6 for p in pairwise]},
                    "alarms": [a for a in info["alarms"] if a["session_id"] == sid],
                    "shown_of": len(sessions)})
    return out


def _nice_width_s(span_s: float, tick_s: float, bins: int = MAX_CTAL_BINS) -> float:
    """A round bin width (a multiple of the tick) that cuts ``span_s`` into at most ``bins`` bins."""
    for w in (0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 43200, 86400):
        if w >= tick_s and span_s / w <= bins:
            return float(w)
    return float(math.ceil(span_s / bins / 86400) * 86400)


def _ctal(con: Any, have: dict, tick_hz: float) -> dict:
    """CTAL decisions: counts per session and decision, the reasons, and per session-time bin the
    count of each decision and of clean ticks (ticks of the timeline without a CTAL row)."""
    res: dict[str, Any] = {"per_session": [], "reasons": [], "bins": [], "width_s": None, "decisions": []}
    if not have["ctal"] and not have["records"]:
        return res
    ticks = {r["session_id"]: r for r in _rows(
        con, "SELECT session_id, count(DISTINCT tick_index) AS ticks, max(t_ns) AS hi FROM records GROUP BY 1")} \
        if have["records"] else {}
    per = _rows(con, "SELECT session_id, decision, count(*) AS n, count(DISTINCT tick_index) AS ticks FROM ctal "
                     "GROUP BY ALL ORDER BY 1, 2") if have["ctal"] else []
    res["decisions"] = sorted({r["decision"] for r in per})
    by_session: dict[str, dict] = {}
    for sid, t in ticks.items():
        by_session[sid] = {"session_id": sid, "ticks": t["ticks"]}
    for r in per:
        by_session.setdefault(r["session_id"], {"session_id": r["session_id"], "ticks": None})[r["decision"]] = r["n"]
    if have["ctal"]:
        non_clean = {r["session_id"]: r["n"] for r in _rows(
            con, "SELECT session_id, count(DISTINCT tick_index) AS n FROM ctal GROUP BY 1")}
        res["reasons"] = _rows(con, "SELECT decision, reason, count(*) AS rows, count(DISTINCT session_id) AS sessions "
                                    "FROM ctal GROUP BY ALL ORDER BY rows DESC, decision, reason")
    else:
        non_clean = {}
    for sid, s in by_session.items():
        s["clean"] = None if s["ticks"] is None else s["ticks"] - non_clean.get(sid, 0)
    res["per_session"] = [by_session[s] for s in sorted(by_session)]
    span_ns = max([t["hi"] or 0 for t in ticks.values()] + ([_rows(con, "SELECT max(aligned_t_ns) AS m FROM ctal")[0]["m"]
                                                             or 0] if have["ctal"] else []))
    width_s = _nice_width_s((span_ns + 1) / 1e9, 1.0 / tick_hz)
    w = int(round(width_s * 1e9))
    bins: dict[int, dict[str, int]] = {}
    if have["records"]:
        for r in _rows(con, "SELECT b, count(*) AS n FROM (SELECT DISTINCT session_id, tick_index, t_ns // ? AS b "
                            "FROM records) GROUP BY 1", [w]):
            bins.setdefault(r["b"], {})["clean"] = r["n"]
    if have["ctal"]:
        for r in _rows(con, "SELECT aligned_t_ns // ? AS b, decision, count(*) AS n FROM ctal GROUP BY ALL", [w]):
            bins.setdefault(r["b"], {})[r["decision"]] = r["n"]
        if have["records"]:
            for r in _rows(con, "SELECT b, count(*) AS n FROM (SELECT DISTINCT session_id, tick_index, "
                                "aligned_t_ns // ? AS b FROM ctal) GROUP BY 1", [w]):
                bins[r["b"]]["clean"] = bins[r["b"]].get("clean", 0) - r["n"]
    res["width_s"] = width_s
    res["bins"] = [{"start_s": b * width_s, **bins[b]} for b in sorted(bins)]
    return res


def _quality(output: Output) -> dict | None:
    """The committed ``monitor/quality`` table as rows, with the columns its file has (None: this
    commit has none). A monitor's table is one file per commit, rebuilt by every commit, so the
    page shows whatever columns the writer of this commit declared."""
    import pyarrow.dataset as ds

    files = [str(output.root / f) for f in output.snapshot.under(QUALITY_PATH) if f.endswith(".parquet")]
    if not files:
        return None
    t = ds.dataset(files, format="parquet", filesystem=output.filesystem).to_table()
    return {"columns": t.column_names, "rows": t.to_pylist()}


# -- the page ----------------------------------------------------------------------------------

def build_report(out: str | PathLike, storage: Any = None) -> str:
    """The HTML page of OUT's latest commit (a folder or s3://bucket/prefix)."""
    return render(collect(out, storage))


def write_run_report(out: str | PathLike, path: str | PathLike, storage: Any = None) -> tuple[Any, str]:
    """Build OUT's report and write it to ``path`` (refused inside OUT, before any reading);
    returns (the file, the page)."""
    report_target(path, out, REPORT_WHY)
    text = build_report(out, storage)
    return write_report(path, text, out, REPORT_WHY), text


def plots_in(page: str) -> int:
    """The number of plots a page holds."""
    return page.count('<img class="plot"')


_EXTRA_CSS = ("figure{margin:.5em 0 1.2em}img.plot{max-width:100%;height:auto;border:1px solid #ddd}"
              "figcaption{font-size:13px;color:#555}nav a{margin-right:1em}p.note{color:#555;font-size:14px}"
              "h3{margin-top:1.2em}.wide th{white-space:normal}")

SECTIONS = (("residuals", "Alignment residuals"), ("clocks", "Clock offsets and drift"),
            ("ctal", "CTAL decisions"), ("deid", "De-identification"), ("quarantine", "Quarantine"),
            ("throughput", "Throughput per stage"), ("cache", "Feature cache"), ("monitors", "Monitors"))


def render(info: dict) -> str:
    """The page of ``collect``'s result: inline style, plots as inline PNG, no script, every value escaped."""
    e = html_escape
    run = info["run"]
    c = run.get("counts") or {}
    versions = run.get("versions") or {}
    head = [
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">",
        f"<title>Run report: {e(info['out'])}</title><style>{PAGE_CSS}{_EXTRA_CSS}</style></head><body>",
        f"<h1>Run report: <code>{e(info['out'])}</code></h1>",
        f"<p>Commit {e(info['commit'])} ({e(info['committed_at'])}) of run <code>{e(run.get('run_id'))}</code>, "
        f"finished {e(run.get('finished_at'))} in {e(run.get('elapsed_s'))} s; {len(info['sessions'])} session(s); "
        f"policy <code>{e(versions.get('policy'))}</code>; modalign {e(versions.get('modalign'))}.</p>",
        "<p class=\"note\">Statistics of the committed tables only: no frame, audio feature, document text, "
        "vector or pseudonym key is in this page. A long table is folded: click it to open it.</p>",
        "<nav>" + "".join(f"<a href=\"#{k}\">{e(t)}</a>" for k, t in SECTIONS) + "</nav>",
        html_table(_overview(c), ["what", "count"]),
    ]
    body = [_residuals(info), _clocks(info), _ctal_section(info), _deid(info), _quarantine(info),
            _throughput(run), _cache(run), _monitors(info)]
    return "".join(head + body + ["</body></html>\n"])


def _overview(c: dict) -> list[dict]:
    ev = c.get("events") or {}
    rows = [("sessions", c.get("sessions")), ("ticks", c.get("ticks")),
            *((f"events {m}", n) for m, n in ev.items()), ("gaps", c.get("gaps")), ("CTAL rows", c.get("ctal_rows")),
            ("drift alarms", c.get("drift_alarms")), ("quarantined", c.get("quarantined")),
            *((f"features {g}", n) for g, n in (c.get("features") or {}).items()),
            *((f"monitor alarms {k}", n) for k, n in (c.get("monitor_alarms") or {}).items())]
    return [{"what": k, "count": v} for k, v in rows if v is not None]


def _h2(key: str) -> str:
    return f"<h2 id=\"{key}\">{html_escape(dict(SECTIONS)[key])}</h2>"


def _note(text: str) -> str:
    return f"<p class=\"note\">{html_escape(text)}</p>"


def _ms(v: Any) -> str:
    """A duration in ms as the page shows it (3 decimals: microseconds)."""
    return "" if v is None else f"{v:.3f}"


def _num(v: Any) -> str:
    return "" if v is None else f"{v:.4f}"


def _s(ns: Any) -> str:
    return "" if ns is None else f"{ns / 1e9:.2f}"


def _label(r: dict) -> str:
    return f"{r['session_id']}/{r['source_id']}"


# -- sections ----------------------------------------------------------------------------------

def _residuals(info: dict) -> str:
    parts = [_h2("residuals"), _note("Residual = matched event time - tick time, from the timeline (records), "
                                     "per source; |r| statistics over the matched ticks, in ms.")]
    res = info["residuals"]
    with_values = [r for r in res if r["matched"]]
    if with_values:
        shown = sorted(sorted(with_values, key=lambda r: (-(r["p95_abs_ms"] or 0), _label(r)))[:MAX_SOURCES_PLOTTED],
                       key=_label)
        parts.append(_figure(_residual_plot(shown), "residual distribution per source",
                             f"Residual (ms) per source: box from p25 to p75, line at the median, whiskers p5 to p95, "
                             f"dots at min and max" + (f"; the {len(shown)} of {len(with_values)} sources with the "
                                                       f"largest p95 |r|" if len(shown) < len(with_values) else "")))
    rows = [{"session": r["session_id"], "source": r["source_id"], "modality": r["modality"], "ticks": r["ticks"],
             "matched": r["matched"], "gaps": r["gaps"], "mean ms": _ms(r["mean_ms"]), "mean |r| ms": _ms(r["mean_abs_ms"]),
             "p50 |r| ms": _ms(r["p50_abs_ms"]), "p95 |r| ms": _ms(r["p95_abs_ms"]), "max |r| ms": _ms(r["max_abs_ms"])}
            for r in res]
    parts.append(html_section("Residuals per source (records)", rows, list(rows[0]) if rows else [], NONE, 3))
    srows = [{"session": s["session_id"], "source": s["source_id"], "modality": s["modality"], "ticks": s["ticks"],
              "matched": s["matched"], "gaps": s["gaps"], "late": s["late"], "p50 ms": _ms(s["residual_p50_ms"]),
              "p95 ms": _ms(s["residual_p95_ms"]), "max ms": _ms(s["residual_max_ms"])} for s in info["ctal_summary"]]
    parts.append(html_section("Residual summary per source (ctal/summary)", srows, list(srows[0]) if srows else [],
                              NONE, 3))
    return "".join(parts)


def _clocks(info: dict) -> str:
    parts = [_h2("clocks")]
    rows = []
    for r in info["clocks"]:
        s = r["summary"] or {}
        rows.append({"session": r["session_id"], "source": r["source_id"], "modality": r["modality"],
                     "offset ms": f"{r['clock_offset_ns'] / 1e6:+.3f}", "skew ppm": f"{r['clock_skew_ppm']:+.3f}",
                     "method": r["clock_method"], "reference": r["clock_reference"] or "",
                     "summary offset ms": "" if s.get("offset_ns") is None else f"{s['offset_ns'] / 1e6:+.3f}",
                     "summary skew ppm": "" if s.get("skew_ppm") is None else f"{s['skew_ppm']:+.3f}",
                     "confidence": "" if s.get("offset_confidence") is None else f"{s['offset_confidence']:.2f}",
                     "obtained": r["obtained"]})
    parts.append(html_section("Clock mapping per source (lineage/sources, ctal/summary)", rows,
                              list(rows[0]) if rows else [], NONE, 3))
    alarms = [{"session": a["session_id"], "ticks": f"{a['start_tick']}-{a['end_tick']}",
               "from s": _s(a["start_t_ns"]), "to s": _s(a["end_t_ns"]),
               "max residual ms": f"{a['max_residual_ms']:.1f}", "sources": ", ".join(a["sources"] or [])}
              for a in info["alarms"]]
    parts.append(html_section("Drift alarms (ctal/alarms)", alarms, list(alarms[0]) if alarms else [], NONE, 3))
    parts.append("<h3>Residual over session time</h3>")
    if not info["drift"]:
        parts.append(_note(NONE))
    clocks = {(r["session_id"], r["source_id"]): r for r in info["clocks"]}
    for d in info["drift"]:
        caption = (f"Session {d['session_id']}: each source's residual (ms) over session time"
                   + (f" (binned to {d['binned_ms']:.0f} ms, the largest residual of each bin)" if d["binned_ms"] else "")
                   + ("; black: the largest pairwise residual between sources, which the drift alarm measures"
                      + (f" (threshold {info['drift_threshold_ms']:.0f} ms)" if info["drift_threshold_ms"] else "")
                      if d["pairwise"]["t_s"] else "; one source: no pairwise residual")
                   + f"; shaded: {len(d['alarms'])} drift alarm(s)")
        parts.append(_figure(_drift_plot(d, clocks, info["drift_threshold_ms"]),
                             f"residual over session time, session {d['session_id']}", caption))
    if info["drift"] and info["drift"][0]["shown_of"] > len(info["drift"]):
        parts.append(_note(f"{len(info['drift'])} of {info['drift'][0]['shown_of']} sessions plotted: those with "
                           "drift alarms first, then the largest residuals."))
    return "".join(parts)


def _ctal_section(info: dict) -> str:
    ct = info["ctal"]
    parts = [_h2("ctal"), _note("The CTAL log holds one row per tick decision that is not a clean match; "
                                "clean = ticks of the timeline without a CTAL row.")]
    if ct["bins"]:
        parts.append(_figure(_ctal_plot(ct), "CTAL decisions over session time",
                             f"Tick decisions per {ct['width_s']:g} s of session time, all sessions stacked."))
    cols = ["session", "ticks", "clean", *ct["decisions"]]
    rows = [{"session": s["session_id"], **{k: s.get(k, 0) for k in ct["decisions"]}, "ticks": s["ticks"],
             "clean": s["clean"]} for s in ct["per_session"]]
    parts.append(html_section("Decisions per session", rows, cols, NONE, 3))
    parts.append(html_section("Reasons (ctal/log)", ct["reasons"], ["decision", "reason", "rows", "sessions"], NONE, 3))
    return "".join(parts)


def _deid_counters(c: dict) -> list[dict]:
    from modalign.operators.modalities import PLANS

    names = sorted({n for plan in PLANS.values() for n in plan.counters})
    rows = [{"counter": n, "method": "", "items": c[n]} for n in names if n in c]
    rows += [{"counter": "voice_frames", "method": m, "items": n} for m, n in sorted((c.get("voice_frames") or {}).items())]
    return rows


def _deid(info: dict) -> str:
    parts = [_h2("deid"), _note("What de-identification removed, from each source's lineage headers (method, "
                                "detector, items) and the run's counters; counts only. Voice: every MFCC frame "
                                "of an audio source is computed under its voice method (the run counter "
                                "voice_frames); its header removes no items.")]
    parts.append(html_section("Run counters (run.json)", _deid_counters(info["run"].get("counts") or {}),
                              ["counter", "method", "items"], NONE, 3))
    removed = [r for r in info["deid"] if r["count"]]
    if removed:
        totals: dict[str, int] = {}
        for r in removed:
            totals[_label(r)] = totals.get(_label(r), 0) + r["count"]
        top = sorted(sorted(totals, key=lambda k: (-totals[k], k))[:MAX_SOURCES_PLOTTED])
        parts.append(_figure(_deid_plot([r for r in removed if _label(r) in top], top),
                             "de-identified items per source and kind",
                             "Items removed per source, by method and detector"
                             + (f"; the {len(top)} of {len(totals)} sources with the most" if len(top) < len(totals)
                                else "")))
    rows = [{"session": r["session_id"], "source": r["source_id"], "modality": r["modality"], "events": r["events"],
             "method": r["method"], "detector": r["detector"], "items": r["count"]} for r in info["deid"]]
    parts.append(html_section("Per source (lineage/sources)", rows, list(rows[0]) if rows else [], NONE, 3))
    return "".join(parts)


def _quarantine(info: dict) -> str:
    rows = [{"session": q["session_id"], "source": q["source_id"] or "", "source_uri": q["source_uri"],
             "stage": q["stage"], "reason_code": q["reason_code"], "message": q["message"],
             "range s": "whole source" if q["start_t_ns"] is None and q["end_t_ns"] is None
             else f"{_s(q['start_t_ns'])}-{_s(q['end_t_ns'])}"} for q in info["quarantine"]]
    by_reason: dict[str, int] = {}
    for q in info["quarantine"]:
        by_reason[q["reason_code"]] = by_reason.get(q["reason_code"], 0) + 1
    parts = [_h2("quarantine"), _note("Rejected inputs and ranges with their reason codes (runbooks/quarantine.md); "
                                      "never their payload.")]
    if by_reason:
        parts.append(html_table([{"reason_code": k, "rows": v} for k, v in sorted(by_reason.items())],
                                ["reason_code", "rows"]))
    parts.append(html_section("Quarantined inputs", rows, list(rows[0]) if rows else [], NONE, 3))
    return "".join(parts)


TIMING = (("ray_start_s", "Ray start"), ("actors_ready_s", "actors ready (models loaded)"),
          ("processing_s", "processing (ingest, align, embed)"), ("commit_s", "commit (indexes, monitors)"))


def _throughput(run: dict) -> str:
    parts = [_h2("throughput")]
    timing = run.get("timing") or {}
    known = dict(TIMING)
    stages = [(known.get(k, k), v) for k, v in [*((k, timing.get(k)) for k, _ in TIMING),
                                                  *((k, v) for k, v in timing.items() if k not in known)]
              if isinstance(v, (int, float))]
    if run.get("elapsed_s") is not None:
        stages.append(("whole run (elapsed)", run["elapsed_s"]))
    if any(isinstance(v, (int, float)) for v in timing.values()):  # not the elapsed time alone
        parts.append(_figure(_bar_plot([s for s, _ in stages], [v for _, v in stages], "seconds"),
                             "seconds per stage", "Wall seconds per stage of the run (run.json timing)."))
    parts.append(html_section("Time per stage (run.json)", [{"stage": s, "seconds": f"{v:.3f}"} for s, v in stages],
                              ["stage", "seconds"], NONE, 3))
    c = run.get("counts") or {}
    proc = timing.get("processing_s")
    rate = lambda n: "" if not proc else f"{n / proc:.1f}"  # noqa: E731
    rows = [{"what": f"events {m}", "count": n, "per processing second": rate(n)}
            for m, n in (c.get("events") or {}).items()]
    rows += [{"what": f"features {g}", "count": n, "per processing second": rate(n)}
             for g, n in (c.get("features") or {}).items()]
    if c.get("ticks") is not None:
        rows.append({"what": "ticks aligned", "count": c["ticks"], "per processing second": rate(c["ticks"])})
    parts.append(html_section("Throughput (run.json counts / processing seconds)", rows,
                              ["what", "count", "per processing second"], NONE, 3))
    return "".join(parts)


def _cache(run: dict) -> str:
    parts = [_h2("cache")]
    cache = (run.get("counts") or {}).get("cache") or {}
    hits, misses = cache.get("hits") or {}, cache.get("misses") or {}
    grans = [g for g in dict.fromkeys([*hits, *misses]) if hits.get(g, 0) + misses.get(g, 0)]
    rows = [{"granularity": g, "hits": hits.get(g, 0), "misses": misses.get(g, 0),
             "lookups": hits.get(g, 0) + misses.get(g, 0),
             "hit rate": f"{hits.get(g, 0) / (hits.get(g, 0) + misses.get(g, 0)):.1%}"} for g in grans]
    if rows:
        rate = cache.get("hit_rate")
        parts.append(_note(f"Feature-cache lookups of the run that made this commit (run.json counts.cache; "
                           f"`modalign cache stats` shows the same as the last run's): hit rate "
                           f"{'n/a' if rate is None else f'{rate:.1%}'} over all granularities."))
        parts.append(_figure(_cache_plot(rows), "feature-cache hits and misses per granularity",
                             "Feature-cache hits and misses per granularity."))
    parts.append(html_section("Lookups per granularity", rows, ["granularity", "hits", "misses", "lookups", "hit rate"],
                              NONE, 3))
    return "".join(parts)


def _monitors(info: dict) -> str:
    parts = [_h2("monitors"), _note("Embedding drift per model and granularity (monitor/embedding): each window's "
                                    "divergence against the reference and the threshold it was scored against "
                                    "(runbooks/embedding-drift.md).")]
    streams = (info["run"].get("monitor") or {}).get("streams") or []
    parts.append(html_section("Streams (run.json)", streams, ["model_id", "granularity", "windows", "reference"], NONE, 3))
    groups: dict[tuple[str, str], list[dict]] = {}
    for w in info["monitor_windows"]:
        groups.setdefault((w["model_id"], w["granularity"]), []).append(w)
    for (model, gran), ws in groups.items():
        drift = sum(w["drift_alarm"] for w in ws)
        norm = sum(w["norm_alarm"] for w in ws)
        parts.append(_figure(_monitor_plot(ws), f"embedding monitor {model} {gran}",
                             f"{model} {gran}: {len(ws)} windows ({sum(w['reference'] for w in ws)} reference, "
                             f"shaded), {drift} drift alarm(s) (red x), {norm} norm-jump alarm(s) (triangles); "
                             "dotted lines: session boundaries."))
    alarms = [{"kind": a["kind"],  # an embedding stream's (model, granularity), or a quality alarm's (modality, property)
               "stream": " ".join(str(x) for x in (a.get("model_id"), a.get("granularity")) if x is not None)
               or " ".join(str(x) for x in (a.get("modality"), a.get("property")) if x is not None),
               "session": a.get("session_id") or "all", "window": a.get("window_index"),
               "from s": _s(a.get("start_t_ns")), "to s": _s(a.get("end_t_ns")),
               "value": _num(a.get("value")), "threshold": _num(a.get("threshold"))} for a in info["monitor_alarms"]]
    parts.append(html_section("Monitor alarms (monitor/alarms)", alarms, list(alarms[0]) if alarms else [], NONE, 3))
    fmt = _num
    windows = [{"model": w["model_id"], "granularity": w["granularity"], "window": w["window_index"],
                "session": w["session_id"], "from s": _s(w["start_t_ns"]), "to s": _s(w["end_t_ns"]),
                "vectors": w["vectors"], "mean norm": fmt(w["mean_norm"]), "reference": "yes" if w["reference"] else "",
                "divergence": fmt(w["divergence"]), "threshold": fmt(w["threshold"]),
                "alpha": "" if w["alpha"] is None else f"{w['alpha']:.1f}",
                "alarm": ", ".join(k for k, f in (("drift", w["drift_alarm"]), ("norm", w["norm_alarm"])) if f)}
               for w in info["monitor_windows"]]
    parts.append(html_section("Monitor windows (monitor/embedding)", windows, list(windows[0]) if windows else [],
                              NONE, 3))
    parts.append(_quality_section(info["quality"]))
    return "".join(parts)


def _quality_section(quality: dict | None) -> str:
    """The modality-quality monitor's table as committed (its own columns), or "none recorded"."""
    title = "Modality quality (monitor/quality)"
    if not quality or not quality["rows"]:
        return html_section(title, [], [], NONE, 3)
    cols = quality["columns"]
    flags = [c for c in cols if "alarm" in c.lower() and all(isinstance(r.get(c), (bool, type(None)))
                                                             for r in quality["rows"])]
    heads = {c: c.replace("_", " ") for c in cols}  # headings that wrap: a table of many columns fits the window
    rows = [{heads[c]: "all" if c == "session_id" and r.get(c) is None else _value(r.get(c)) for c in cols}
            for r in quality["rows"]]
    alarmed = sum(any(r.get(c) for c in flags) for r in quality["rows"])
    return (f"<div class=\"wide\">{html_section(title, rows, list(heads.values()), NONE, 3)}</div>"
            + (_note(f"{alarmed} of {len(rows)} rows with an alarm flag set ({', '.join(flags)}).") if flags else ""))


def _value(v: Any) -> Any:
    """A cell of a table whose columns the report does not know: floats to 4 significant digits,
    long lists shortened."""
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        items = [_value(x) for x in v[:8]]
        return "[" + ", ".join(str(x) for x in items) + (f", ... ({len(v)} items)" if len(v) > 8 else "") + "]"
    if isinstance(v, dict):
        return {k: _value(x) for k, x in v.items()}
    return v


# -- plots (matplotlib's Agg renderer, never pyplot: no global state, no display) ----------------

def _fig(height_in: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(FIG_WIDTH_IN, height_in), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _legend(fig: Any, ax: Any, ncols: int = 3) -> None:
    """The axes' legend below them, outside the plot (it never hides a bar or a line)."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=min(ncols, len(handles)), fontsize=8,
                   frameon=False)


def _figure(fig: Any, alt: str, caption: str) -> str:
    """A ``<figure>`` with the plot as an inline PNG and its caption."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    w, h = (int(round(x)) for x in fig.get_size_inches() * fig.dpi)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    e = html_escape
    return (f"<figure><img class=\"plot\" alt=\"{e(alt)}\" width=\"{w}\" height=\"{h}\" "
            f"src=\"data:image/png;base64,{data}\"><figcaption>{e(caption)}</figcaption></figure>")


def _residual_plot(rows: list[dict]) -> Any:
    fig = _fig(1.2 + 0.32 * len(rows))
    ax = fig.subplots()
    stats = [{"label": _label(r), "med": r["q50"], "q1": r["q25"], "q3": r["q75"], "whislo": r["q05"],
              "whishi": r["q95"], "fliers": sorted({r["min_ms"], r["max_ms"]})} for r in rows]
    ax.bxp(stats, orientation="horizontal", showfliers=True, patch_artist=True,
           boxprops={"facecolor": "#cfe0f3"}, medianprops={"color": "#1a4f8b"})
    ax.invert_yaxis()
    ax.axvline(0, color="#888", lw=0.8)
    ax.set_xlabel("residual (ms): event time - tick time")
    ax.grid(axis="x", alpha=0.3)
    return fig


def _drift_plot(d: dict, clocks: dict, threshold_ms: float | None) -> Any:
    fig = _fig(3.4 + 0.2 * math.ceil((len(d["sources"]) + 2) / 2))
    ax = fig.subplots()
    for src, s in sorted(d["sources"].items()):
        c = clocks.get((d["session_id"], src))
        label = src if c is None else (f"{src} (offset {c['clock_offset_ns'] / 1e6:+.1f} ms, "
                                       f"skew {c['clock_skew_ppm']:+.1f} ppm, {c['clock_method']})")
        ax.plot(s["t_s"], s["residual_ms"], lw=1.0, marker="." if len(s["t_s"]) < 60 else None, label=label)
    p = d["pairwise"]
    if p["t_s"]:
        ax.plot(p["t_s"], p["ms"], color="black", lw=0.8, alpha=0.7, label="max pairwise residual")
        if threshold_ms and max(p["ms"]) >= threshold_ms / 4:
            ax.axhline(threshold_ms, color="#c0392b", ls="--", lw=0.8, label=f"drift threshold {threshold_ms:.0f} ms")
    for i, a in enumerate(d["alarms"]):
        ax.axvspan(a["start_t_ns"] / 1e9, a["end_t_ns"] / 1e9, color="#e74c3c", alpha=0.2,
                   label="drift alarm" if i == 0 else None)
    ax.set_xlabel("session time (s)")
    ax.set_ylabel("residual (ms)")
    ax.set_title(f"session {d['session_id']}", fontsize=11)
    ax.grid(alpha=0.3)
    _legend(fig, ax, 2)
    return fig


_DECISION_COLOURS = {"clean": "#7fb77e", "gap": "#9e9e9e", "late": "#f39c12", "out_of_tolerance": "#c0392b",
                     "interpolated": "#2e86c1"}


def _ctal_plot(ct: dict) -> Any:
    fig = _fig(3.2)
    ax = fig.subplots()
    x = [b["start_s"] for b in ct["bins"]]
    bottom = [0] * len(x)
    for k, name in enumerate(["clean", *ct["decisions"]]):
        ys = [max(0, b.get(name, 0)) for b in ct["bins"]]
        if not any(ys):
            continue
        ax.bar(x, ys, width=ct["width_s"] * 0.9, bottom=bottom, align="edge", label=name,
               color=_DECISION_COLOURS.get(name, f"C{k}"))
        bottom = [a + b for a, b in zip(bottom, ys)]
    ax.set_xlabel("session time (s)")
    ax.set_ylabel("ticks")
    ax.grid(axis="y", alpha=0.3)
    _legend(fig, ax, 6)
    return fig


def _short(method: str, detector: str) -> str:
    """``blur_permute (mediapipe-face-detection)`` of a header's method and detector strings."""
    m = method.split("/", 1)[0]
    d = detector.split("@", 1)[0]
    return m if detector in ("", "none") else f"{m} ({d})"


def _deid_plot(rows: list[dict], labels: list[str]) -> Any:
    fig = _fig(1.7 + 0.32 * len(labels))
    ax = fig.subplots()
    kinds = sorted({_short(r["method"], r["detector"]) for r in rows})
    left = [0] * len(labels)
    for k, kind in enumerate(kinds):
        vals = [sum(r["count"] for r in rows if _label(r) == lab and _short(r["method"], r["detector"]) == kind)
                for lab in labels]
        ax.barh(labels, vals, left=left, label=kind, color=f"C{k}")
        left = [a + b for a, b in zip(left, vals)]
    ax.invert_yaxis()
    ax.set_xlabel("items removed")
    ax.grid(axis="x", alpha=0.3)
    _legend(fig, ax, 3)
    return fig


def _bar_plot(labels: list[str], values: list[float], xlabel: str) -> Any:
    fig = _fig(1.0 + 0.35 * len(labels))
    ax = fig.subplots()
    ax.barh(labels, values, color="#5b8cc0")
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.2f}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.margins(x=0.12)
    ax.grid(axis="x", alpha=0.3)
    return fig


def _cache_plot(rows: list[dict]) -> Any:
    fig = _fig(1.4 + 0.4 * len(rows))
    ax = fig.subplots()
    labels = [r["granularity"] for r in rows]
    ax.barh(labels, [r["hits"] for r in rows], color="#7fb77e", label="hits")
    ax.barh(labels, [r["misses"] for r in rows], left=[r["hits"] for r in rows], color="#e0a15e", label="misses")
    for y, r in enumerate(rows):
        ax.text(r["lookups"], y, f" {r['hit rate']} hit", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("lookups")
    ax.margins(x=0.15)
    _legend(fig, ax, 2)
    return fig


def _monitor_plot(ws: list[dict]) -> Any:
    from matplotlib.ticker import MaxNLocator

    scored = [w for w in ws if w["divergence"] is not None]
    fig = _fig(3.2 if scored else 2.0)
    ax = fig.subplots()
    idx = [w["window_index"] for w in ws]
    for i, w in enumerate(ws):
        if w["reference"]:
            ax.axvspan(w["window_index"] - 0.5, w["window_index"] + 0.5, color="#bbbbbb", alpha=0.35,
                       label="reference window" if i == next(j for j, x in enumerate(ws) if x["reference"]) else None)
    if scored:
        ax.plot([w["window_index"] for w in scored], [w["divergence"] for w in scored], marker="o", ms=3, lw=1,
                color="#1a4f8b", label="divergence")
    thr = [w for w in ws if w["threshold"] is not None]
    if thr:
        ax.step([w["window_index"] for w in thr], [w["threshold"] for w in thr], where="mid", ls="--", lw=1,
                color="#c0392b", label="threshold")
    drift = [w for w in scored if w["drift_alarm"]]
    if drift:
        ax.scatter([w["window_index"] for w in drift], [w["divergence"] for w in drift], marker="x", s=60,
                   color="#e74c3c", zorder=3, label="drift alarm")
    norm = [w for w in ws if w["norm_alarm"]]
    if norm:
        top = max([w["divergence"] for w in scored] + [w["threshold"] for w in thr] + [0.0])
        ax.scatter([w["window_index"] for w in norm], [top * 1.05 or 1.0] * len(norm), marker="v", s=50,
                   color="#8e44ad", zorder=3, label="norm-jump alarm")
    starts = [w for k, w in enumerate(ws) if k == 0 or w["session_id"] != ws[k - 1]["session_id"]]
    for w in starts[1:]:
        ax.axvline(w["window_index"] - 0.5, color="#555", ls=":", lw=0.8)
    if len(starts) <= 12:
        for w in starts:
            ax.annotate(w["session_id"], (w["window_index"] - 0.45, 1.0), xycoords=("data", "axes fraction"),
                        fontsize=7, va="top", color="#555")
    ax.set_xlim(min(idx) - 0.6, max(idx) + 0.6)
    ax.set_xlabel("window")
    ax.set_ylabel("divergence (mean KL)")
    ax.set_title(f"{ws[0]['model_id']}  {ws[0]['granularity']}", fontsize=11)
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    if not scored:
        ax.set_ylim(0, 1)
        ax.set_yticks([])
        ax.set_ylabel("")
        ax.text(0.5, 0.5, "reference windows only: nothing scored yet", transform=ax.transAxes, ha="center",
                color="#555")
    _legend(fig, ax, 5)
    return fig
