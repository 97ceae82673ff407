"""The run report (``modalign report``, ``pipeline/report.py``) without Ray: over output folders
written with the project's own writers (row models' Arrow schemas, ``OutputLayout`` paths) and
committed by ``CommitLog``, so ``Output`` reads them as it reads a run's. A folder that holds a
few tables only (every other section says "none recorded"), one with nothing but a commit, a
hostile quarantine row (markup in its message and URI is escaped, never run), the
modality-quality table when a commit holds one, where the file may be written, and a CLI whose
``--help`` and whose import of the report module load neither matplotlib nor DuckDB."""

from __future__ import annotations

import html.parser
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from modalign.pipeline.cli import main
from modalign.pipeline.commits import CommitLog
from modalign.pipeline.layout import OutputLayout
from modalign.pipeline.lineage import report_target
from modalign.pipeline.report import (MAX_POINTS, NONE, QUALITY_PATH, _nice_width_s, build_report, collect,
                                      plots_in)
from modalign.schemas.arrow import rows_to_table
from modalign.schemas.errors import ConfigError
from modalign.schemas.tables import CtalSummaryRow, QuarantineRow, RecordRow, SourceLineageRow

pytestmark = pytest.mark.unit

MS = 1_000_000
TICK = 40 * MS
HOSTILE = "<script>alert('x')</script><img src=x onerror=alert(1)> & \"quoted\""
HOSTILE_URI = "file:///rec/\"><iframe src=https://evil.example/>.mp4"
# the lapel's residuals (ms) on ticks 0..9: a gap, then a clock that drifts ahead
LAPEL_MS = [None, 0.0, 1.5, -2.0, 3.0, 4.5, 6.0, 7.5, 9.0, 10.5]


def _lin(sid: str, src: str, uri: str) -> dict:
    return {"session_id": sid, "source_id": src, "source_uri": uri, "source_version": "local:1:1",
            "operators": "x@1", "policy": "p@1", "model_id": None}


def _out(root: Path, *, tables: bool = True, quality: pa.Table | None = None) -> Path:
    """A committed OUT of one session ``s1`` (a camera, a lapel recorder): records, CTAL summary,
    lineage and a quarantine row with markup; no CTAL log, drift alarm, monitor or cache."""
    out = root / "out"
    out.mkdir(parents=True)
    layout = OutputLayout(out)
    files: list[str] = []
    shared: list[str] = []
    if tables:
        cam, lapel = _lin("s1", "cam", "file:///rec/cam.mp4"), _lin("s1", "lapel", "file:///rec/lapel.wav")
        records = []
        for k, r in enumerate(LAPEL_MS):
            records.append({**cam, "tick_index": k, "t_ns": k * TICK, "modality": "video",
                            "event_id": f"s1/cam/frame/{k}", "event_t_ns": k * TICK, "residual_ns": 0,
                            "decision": "matched"})
            rn = None if r is None else int(round(r * MS))
            records.append({**lapel, "tick_index": k, "t_ns": k * TICK, "modality": "audio",
                            "event_id": None if rn is None else f"s1/lapel/mfcc/{k}",
                            "event_t_ns": None if rn is None else k * TICK + rn, "residual_ns": rn,
                            "decision": "gap" if rn is None else "matched"})
        header = {"policy": "p@1", "method": "blur_permute", "detector": "mediapipe-face-detection@0.10.21",
                  "count": 7, "threshold": 0.5}
        voice = {"policy": "p@1", "method": "voiceanon@3/seg=4s", "detector": "none", "count": 0, "threshold": 0.0}
        lineage = [
            {"run_id": "r1", "session_id": "s1", "source_id": "cam", "source_uri": cam["source_uri"],
             "source_version": "local:1:1", "modality": "video", "status": "ingested", "events": 10, "operators": "x@1",
             "policy": "p@1", "deid": [header], "subjects": ["subject-0042"], "clock_offset_ns": 0},
            {"run_id": "r1", "session_id": "s1", "source_id": "lapel", "source_uri": lapel["source_uri"],
             "source_version": "local:1:1", "modality": "audio", "status": "ingested", "events": 900,
             "operators": "x@1", "policy": "p@1", "deid": [voice], "subjects": ["subject-0042"],
             "clock_offset_ns": 730 * MS, "clock_skew_ppm": 12.5, "clock_method": "estimated",
             "clock_reference": "cam"},
        ]
        summary = [{"session_id": "s1", "source_id": src, "modality": mod, "ticks": 10, "matched": m, "gaps": 10 - m,
                    "residual_p50_ms": p50, "residual_p95_ms": 9.9, "residual_max_ms": 10.5, "offset_ns": off,
                    "skew_ppm": 0.0, "offset_method": meth, "offset_confidence": conf}
                   for src, mod, m, p50, off, meth, conf in (("cam", "video", 10, 0.0, 0, "manifest", None),
                                                             ("lapel", "audio", 9, 4.5, 730 * MS, "estimated", 0.93))]
        quarantine = [{"session_id": "s1", "source_id": "door", "source_uri": HOSTILE_URI, "source_version": None,
                       "stage": "ingest", "reason_code": "decode_failed", "message": HOSTILE,
                       "start_t_ns": 2_000 * MS, "end_t_ns": 3_500 * MS},
                      {"session_id": "s1", "source_id": None, "source_uri": "file:///rec/empty.wav",
                       "source_version": None, "stage": "discovery", "reason_code": "file_empty",
                       "message": "zero bytes"}]
        for path, row, rows in ((layout.records("s1", "a1"), RecordRow, records),
                                (layout.ctal_summary("s1", "a1"), CtalSummaryRow, summary),
                                (layout.lineage_sources("s1", "a1"), SourceLineageRow, lineage),
                                (layout.quarantine("s1", "a1"), QuarantineRow, quarantine)):
            layout.write_table(path, rows_to_table(row, [row(**r).model_dump(mode="json") for r in rows]))
            files.append(layout.relative(path))
    if quality is not None:
        path = out / QUALITY_PATH / "a1.parquet"
        path.parent.mkdir(parents=True)
        pq.write_table(quality, path)
        shared.append(f"{QUALITY_PATH}/a1.parquet")
    run = {"run_id": "r1" * 16, "finished_at": "2026-01-01T00:00:00Z", "elapsed_s": 3.5,
           "counts": {"sessions": 1, "ticks": 10, "events": {"video": 10, "audio": 900, "pdf": 0}, "quarantined": 2,
                      "faces_blurred": 7, "voice_frames": {"voiceanon@3/seg=4s": 900}},
           "versions": {"policy": "p@1", "modalign": "0.1.0"}}  # no timing, cache or monitor: an older run
    CommitLog.of(out).commit(None, run_id="r1", sessions={"s1": {"run_id": "r1", "files": files}}, shared=shared,
                             summary=run)
    return out


class _Tags(html.parser.HTMLParser):
    """Every start tag with its attributes, and the text inside <td> cells."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.tags.append((tag, dict(attrs)))


def _tags(page: str) -> list[tuple[str, dict]]:
    p = _Tags()
    p.feed(page)
    return p.tags


def _after(page: str, heading: str) -> str:
    """The HTML from a section heading (``<h3>heading (N)</h3>``) to the next heading, the cells'
    wrapping class left out."""
    i = page.index(f">{heading} (")
    j = page.find("<h", i + 1)
    return page[i: j if j > 0 else None].replace('<td class="w">', "<td>")


def test_sections_of_missing_tables_say_none_recorded_and_the_present_ones_show_their_numbers(tmp_path):
    out = _out(tmp_path)
    page = build_report(out)
    for heading in ("Drift alarms (ctal/alarms)", "Reasons (ctal/log)", "Monitor alarms (monitor/alarms)",
                    "Monitor windows (monitor/embedding)", "Streams (run.json)", "Modality quality (monitor/quality)",
                    "Lookups per granularity"):
        assert f">{heading} (0)</h3><p>{NONE}</p>" in page, heading
    # the lapel's residuals, computed here from the values planted
    r = np.array([v for v in LAPEL_MS if v is not None])
    row = (f"<td>s1</td><td>lapel</td><td>audio</td><td>10</td><td>9</td><td>1</td><td>{r.mean():.3f}</td>"
           f"<td>{np.abs(r).mean():.3f}</td><td>{np.percentile(np.abs(r), 50):.3f}</td>"
           f"<td>{np.percentile(np.abs(r), 95):.3f}</td><td>{np.abs(r).max():.3f}</td>")
    assert row in _after(page, "Residuals per source (records)")
    clocks = _after(page, "Clock mapping per source (lineage/sources, ctal/summary)")
    assert "<td>+730.000</td><td>+12.500</td><td>estimated</td><td>cam</td>" in clocks
    assert "estimated by cross-correlation against the audio of cam (confidence 0.93)" in clocks
    ctal = _after(page, "Decisions per session")
    assert "<td>s1</td><td>10</td><td>10</td>" in ctal  # 10 ticks, all clean: this OUT has no CTAL log
    deid = _after(page, "Per source (lineage/sources)")
    assert "<td>blur_permute</td><td>mediapipe-face-detection@0.10.21</td><td>7</td>" in deid
    assert "<td>faces_blurred</td><td></td><td>7</td>" in _after(page, "Run counters (run.json)")
    assert "<td>whole run (elapsed)</td><td>3.500</td>" in _after(page, "Time per stage (run.json)")
    # plots: residual boxes, the session's drift, the decisions over time, the removed items; no
    # throughput, cache or monitor plot without their data
    assert plots_in(page) == 4
    assert "subject-0042" not in page  # the report lists no subject


def test_the_drift_series_keeps_each_residual_and_the_pairwise_one_at_tick_resolution(tmp_path):
    info = collect(_out(tmp_path))
    (d,) = info["drift"]
    assert d["binned_ms"] is None  # 10 ticks: nothing binned
    lapel = d["sources"]["lapel"]
    assert lapel["t_s"] == pytest.approx([k * 0.04 for k in range(1, 10)])
    assert lapel["residual_ms"] == pytest.approx([v for v in LAPEL_MS if v is not None])
    # the camera is at 0, so the largest pairwise residual is |lapel| on every tick both matched
    assert d["pairwise"]["ms"] == pytest.approx([abs(v) for v in LAPEL_MS if v is not None])
    assert info["ctal"]["width_s"] == 0.2 and sum(b["clean"] for b in info["ctal"]["bins"]) == 10
    assert _nice_width_s(3600, 0.04) == 60 and _nice_width_s(1.0, 0.04) == 0.2 and MAX_POINTS >= 500


def test_a_hostile_quarantine_row_is_shown_escaped_and_the_page_has_no_script_or_remote_resource(tmp_path):
    page = build_report(_out(tmp_path))
    q = _after(page, "Quarantined inputs")
    assert "Quarantined inputs (2)" in q
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt; &amp; " \
           "&quot;quoted&quot;" in q
    assert "file:///rec/&quot;&gt;&lt;iframe src=https://evil.example/&gt;.mp4" in q
    assert "<td>decode_failed</td>" in q and "<td>2.00-3.50</td>" in q and "<td>whole source</td>" in q
    assert "<script" not in page.lower() and "<iframe" not in page.lower()
    tags = _tags(page)
    assert {t for t, _ in tags} <= {"html", "head", "meta", "title", "style", "body", "h1", "h2", "h3", "p", "code",
                                    "nav", "a", "table", "tr", "th", "td", "details", "summary", "figure", "img",
                                    "figcaption"}
    assert not [a for _, attrs in tags for a in attrs if a.startswith("on")]  # no event handler attribute
    imgs = [attrs for t, attrs in tags if t == "img"]
    assert imgs and all(a["src"].startswith("data:image/png;base64,") and a["class"] == "plot" for a in imgs)
    assert all(a["href"].startswith("#") for t, a in tags if t == "a")  # links stay inside the page


def test_a_commit_with_no_table_gives_a_page_of_notes_and_no_plot(tmp_path):
    page = build_report(_out(tmp_path, tables=False))
    assert plots_in(page) == 0
    empty = re.findall(rf"<h3>([^<]+) \(0\)</h3><p>{NONE}</p>", page)
    assert empty == ["Residuals per source (records)", "Residual summary per source (ctal/summary)",
                     "Clock mapping per source (lineage/sources, ctal/summary)", "Drift alarms (ctal/alarms)",
                     "Decisions per session", "Reasons (ctal/log)", "Per source (lineage/sources)", "Quarantined inputs",
                     "Lookups per granularity", "Streams (run.json)", "Monitor alarms (monitor/alarms)",
                     "Monitor windows (monitor/embedding)", "Modality quality (monitor/quality)"]
    assert page.count(f"<p class=\"note\">{NONE}</p>") == 1  # residual over session time: no plot
    assert page.count(" (0)</h3>") == len(empty)  # every empty section says so


def test_the_quality_monitors_table_is_shown_as_committed(tmp_path):
    quality = pa.table({"modality": ["video", "audio"], "property": ["brightness", "rms_dbfs"],
                        "reference_mean": [121.5, -23.25], "current_mean": [64.125, -23.5], "shift": [0.91, 0.02],
                        "alarm": [True, False], "reference_hist": [[0.1, 0.2, 0.7], [0.3, 0.3, 0.4]]})
    page = build_report(_out(tmp_path, quality=quality))
    q = _after(page, "Modality quality (monitor/quality)")
    assert "Modality quality (monitor/quality) (2)" in q
    assert ("<th>modality</th><th>property</th><th>reference mean</th><th>current mean</th><th>shift</th>"
            "<th>alarm</th><th>reference hist</th>") in q
    assert ("<td>video</td><td>brightness</td><td>121.5</td><td>64.12</td><td>0.91</td><td>True</td>"
            "<td>[0.1, 0.2, 0.7]</td>") in q
    assert "1 of 2 rows with an alarm flag set (alarm)." in page


def test_the_report_file_is_refused_inside_out_and_written_outside(tmp_path, monkeypatch, capsys):
    out = _out(tmp_path)
    for inside in (out / "report.html", out / "records" / "r.html"):
        with pytest.raises(ConfigError, match="inside the output folder"):
            report_target(inside, out)
    (tmp_path / "link").symlink_to(out)
    assert main(["report", str(out), "--out", str(tmp_path / "link" / "r.html")]) == 1  # a symlink into OUT
    assert "inside the output folder" in capsys.readouterr().err
    assert not (out / "r.html").exists()
    with pytest.raises(ConfigError, match="local file"):
        report_target("s3://bucket/report.html", out)
    assert report_target(tmp_path / "x.html", "s3://bucket/out") == tmp_path / "x.html"  # no local path is in S3
    monkeypatch.chdir(out)
    assert main(["report", str(out)]) == 1 and not (out / "report.html").exists()  # the default, from inside OUT
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(out), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["report"] == str(tmp_path / "report.html") and res["plots"] == 4
    assert (tmp_path / "report.html").read_text(encoding="utf-8") == build_report(out)
    assert main(["report", str(tmp_path / "nothing")]) == 1  # not an output folder: exit 1 with the reason
    assert "does not exist" in capsys.readouterr().err


def test_the_cli_and_the_report_module_import_no_plotting_or_query_engine():
    code = ("import sys\nfrom modalign.pipeline import report\nfrom modalign.pipeline.cli import build_parser\n"
            "build_parser().format_help()\n"
            "print(sorted(m for m in ('matplotlib', 'duckdb') if m in sys.modules))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip().splitlines()[-1] == "[]"
