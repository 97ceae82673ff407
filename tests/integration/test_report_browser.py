"""The run report a reviewer reads (``modalign report OUT``), written by the CLI from the shared
real run (``lineage_run`` in ``conftest.py``: three sessions, every modality, the embedding
monitor on windows of 4) and loaded in headless chromium (``tests/browser.py``): the page must be
self-contained and quiet, every plot must decode, and what is on screen must be what the
committed tables say, computed here apart from the report (pyarrow and numpy over the committed
files). It must hold no personal data. ``MODALIGN_REPORT_SHOT=FILE`` also saves the screenshot
there, for a person to look at."""

from __future__ import annotations

import base64
import html
import io
import os
import re
import shutil
from collections import Counter

import numpy as np
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pytest
from PIL import Image

import modalign
from browser import WINDOW, Page, screenshot_pixels
from modalign.operators.deid.tokens import tokens_in
from modalign.pipeline.cli import main
from modalign.pipeline.report import FIG_WIDTH_IN, DPI, MAX_SESSIONS_PLOTTED, QUALITY_PATH
from modalign.pipeline.sample import PLANTED_PII

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def report(lineage_run, tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("run-report")
    assert main(["report", str(lineage_run.out), "--out", str(d / "report.html")]) == 0
    return {"html": d / "report.html", "bytes": (d / "report.html").read_bytes(), "dir": d}


@pytest.fixture(scope="module")
def page(chromium, report) -> Page:
    p = chromium.open(report["html"], report["dir"] / "report.png")
    if os.environ.get("MODALIGN_REPORT_SHOT"):
        shutil.copy(p.screenshot, os.environ["MODALIGN_REPORT_SHOT"])
    return p


@pytest.fixture(scope="module")
def out(lineage_run):
    return modalign.open(lineage_run.out)


def _lines(text: str) -> list[str]:
    """innerText as lines, each table row's cells joined by one tab, spaces squeezed."""
    return [re.sub(r"[ \t]*\t[ \t]*", "\t", line).strip() for line in text.splitlines()]


def _next(lines: list[str], line: str) -> str:
    """The first non-empty line after ``line``."""
    return next(x for x in lines[lines.index(line) + 1:] if x)


def _rows(out, table: str, columns: list[str] | None = None) -> list[dict]:
    return out.table(table).to_table(columns=columns).to_pylist() if out.files(table) else []


def _expected_plots(out) -> int:
    """The plots the page should hold, from the committed tables and run summary."""
    records = out.table("records").to_table(columns=["session_id", "decision"])
    sessions = set(records.column("session_id").to_pylist())
    matched = pc.sum(pc.equal(records.column("decision"), "matched")).as_py()
    removed = sum(h["count"] for r in _rows(out, "lineage_sources", ["deid"]) for h in r["deid"] or [])
    cache = out.run["counts"]["cache"]
    lookups = sum(cache["hits"].values()) + sum(cache["misses"].values())
    streams = {(w["model_id"], w["granularity"]) for w in _rows(out, "monitor_windows", ["model_id", "granularity"])}
    return ((matched > 0) + min(len(sessions), MAX_SESSIONS_PLOTTED) + (records.num_rows > 0) + (removed > 0)
            + bool(out.run.get("timing")) + (lookups > 0) + len(streams))


def test_the_page_is_self_contained_quiet_and_every_plot_decodes(page, report, out):
    assert page.title == f"Run report: {out.uri}"
    assert page.requests and page.requests[0] == page.url and page.url.startswith("file://")
    assert page.external_requests == [], page.external_requests
    assert all(u.startswith("data:image/png;base64,") for u in page.requests[1:])  # only the inline plots
    assert page.console_at("SEVERE", "WARNING") == [], page.console_at("SEVERE", "WARNING")
    assert b"<script" not in report["bytes"].lower()
    n = _expected_plots(out)
    assert n >= 12  # residuals, 3 sessions' drift, CTAL, de-identification, throughput, cache, 4 monitor streams
    assert len(page.images) == n == report["bytes"].count(b'<img class="plot"')
    for img in page.images:
        assert img.decoded and img.natural_width == FIG_WIDTH_IN * DPI and img.natural_height > 100, img.src[:40]
        assert img.src.startswith("data:image/png;base64,")


def test_the_screenshot_is_the_whole_page_and_not_blank(page):
    pixels = screenshot_pixels(page)
    assert page.viewport == WINDOW
    assert page.content_size[0] == WINDOW[0], "the page is wider than the window: something overflows"
    assert page.expanded_width == WINDOW[0], "with the long tables opened, something overflows the window"
    assert page.content_size[1] > 4 * WINDOW[1]
    assert pixels.std() > 20 and (pixels < 100).mean() > 0.005 and (pixels > 200).mean() > 0.5


def test_the_residuals_shown_are_those_of_the_committed_timeline(page, out):
    lines = _lines(page.text_expanded)
    t = out.table("records").to_table(columns=["session_id", "source_id", "modality", "decision", "residual_ns"])
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in t.to_pylist():
        groups.setdefault((r["session_id"], r["source_id"]), []).append(r)
    assert len(groups) == 7
    assert f"Residuals per source (records) ({len(groups)})" in lines
    for (sid, src), rs in sorted(groups.items()):
        res = np.array([r["residual_ns"] for r in rs if r["residual_ns"] is not None], dtype=np.float64) / 1e6
        a = np.abs(res)
        row = "\t".join(map(str, [sid, src, rs[0]["modality"], len(rs), sum(r["decision"] == "matched" for r in rs),
                                  sum(r["decision"] == "gap" for r in rs)])) + "\t" + "\t".join(
            f"{v:.3f}" for v in (res.mean(), a.mean(), np.percentile(a, 50), np.percentile(a, 95), a.max()))
        assert row in lines, row
    lapel = next(r for r in _rows(out, "ctal_summary") if (r["session_id"], r["source_id"]) == ("sample-meeting", "lapel"))
    assert any(line.startswith(f"sample-meeting\tlapel\taudio\t{lapel['ticks']}\t{lapel['matched']}\t{lapel['gaps']}"
                               f"\t{lapel['late']}\t{lapel['residual_p50_ms']:.3f}") for line in lines)
    # the estimated clock, from the lineage row and the summary
    src = next(r for r in _rows(out, "lineage_sources") if (r["session_id"], r["source_id"]) == ("sample-meeting", "lapel"))
    assert src["clock_method"] == "estimated"
    assert any(line.startswith(f"sample-meeting\tlapel\taudio\t{src['clock_offset_ns'] / 1e6:+.3f}\t"
                               f"{src['clock_skew_ppm']:+.3f}\testimated\troom_video") for line in lines)
    alarms = _rows(out, "drift_alarms")
    assert f"Drift alarms (ctal/alarms) ({len(alarms)})" in lines


def test_ctal_deid_quarantine_throughput_and_cache_are_those_of_the_commit(page, out):
    lines = _lines(page.text_expanded)
    ctal = Counter((r["session_id"], r["decision"]) for r in _rows(out, "ctal", ["session_id", "decision"]))
    ticks = Counter()
    for r in {(r["session_id"], r["tick_index"]) for r in _rows(out, "records", ["session_id", "tick_index"])}:
        ticks[r[0]] += 1
    decisions = sorted({d for _, d in ctal})
    assert decisions == ["gap"]  # the lapel recorders start late
    for sid, n in ticks.items():
        non_clean = len({r["tick_index"] for r in _rows(out, "ctal", ["session_id", "tick_index"]) if r["session_id"] == sid})
        row = "\t".join(map(str, [sid, n, n - non_clean, *(ctal.get((sid, d), 0) for d in decisions)]))
        assert row in lines, row
    counts = out.run["counts"]
    for name in ("faces_blurred", "frame_text_blurred", "pii_replaced"):
        assert f"{name}\t{counts[name]}" in lines, name
    for method, n in counts["voice_frames"].items():
        assert f"voice_frames\t{method}\t{n}" in lines
    lineage = _rows(out, "lineage_sources")
    for r in lineage:
        for h in r["deid"]:
            row = "\t".join(map(str, [r["session_id"], r["source_id"], r["modality"], r["events"], h["method"],
                                      h["detector"], h["count"]]))
            assert row in lines, row
    assert f"Per source (lineage/sources) ({sum(len(r['deid']) for r in lineage)})" in lines
    quarantine = _rows(out, "quarantine")
    assert f"Quarantined inputs ({len(quarantine)})" in lines  # the fixture's run quarantined nothing
    if not quarantine:
        assert _next(lines, "Quarantined inputs (0)") == "none recorded"
    timing = out.run["timing"]
    assert f"processing (ingest, align, embed)\t{timing['processing_s']:.3f}" in lines
    for m, n in counts["events"].items():
        assert f"events {m}\t{n}\t{n / timing['processing_s']:.1f}" in lines
    for g, hits in counts["cache"]["hits"].items():
        misses = counts["cache"]["misses"][g]
        if hits + misses:
            assert f"{g}\t{hits}\t{misses}\t{hits + misses}\t{hits / (hits + misses):.1%}" in lines


def test_the_monitor_windows_and_alarms_shown_are_the_committed_ones(page, out):
    lines = _lines(page.text_expanded)
    windows = _rows(out, "monitor_windows")
    alarms = _rows(out, "monitor_alarms")
    assert windows and f"Monitor windows (monitor/embedding) ({len(windows)})" in lines
    for w in windows:
        row = "\t".join(map(str, [w["model_id"], w["granularity"], w["window_index"], w["session_id"],
                                  f"{w['start_t_ns'] / 1e9:.2f}", f"{w['end_t_ns'] / 1e9:.2f}", w["vectors"]]))
        assert any(line.startswith(row) for line in lines), row
    assert f"Monitor alarms (monitor/alarms) ({len(alarms)})" in lines
    assert Counter(a["kind"] for a in alarms) == Counter(
        {k: n for k, n in out.run["counts"]["monitor_alarms"].items() if n})
    for a in alarms:  # an embedding alarm names its stream; a quality alarm (if any) its modality and property
        stream = (f"{a['model_id']} {a['granularity']}" if a.get("model_id") is not None
                  else f"{a.get('modality')} {a.get('property')}")
        assert any(line.startswith(f"{a['kind']}\t{stream}\t{a.get('session_id') or 'all'}\t")
                   and f"{a['value']:.4f}" in line for line in lines), a
    quality = [str(out.root / f) for f in out.snapshot.under(QUALITY_PATH) if f.endswith(".parquet")]
    n = ds.dataset(quality, format="parquet").count_rows() if quality else 0
    assert f"Modality quality (monitor/quality) ({n})" in lines
    if not n:
        assert _next(lines, "Modality quality (monitor/quality) (0)") == "none recorded"
    for q in (ds.dataset(quality, format="parquet").to_table().to_pylist() if n else []):  # as committed, row by row
        row = "\t".join(str(q[c]) for c in ("modality", "property")) + f"\t{q.get('session_id') or 'all'}\t"
        assert any(line.startswith(row) for line in lines), row


def test_no_personal_data_is_in_the_page(page, report, out):
    raw = report["bytes"].decode("utf-8").lower()
    shown = page.text_expanded.lower()
    for _kind, value, _page in PLANTED_PII:  # every planted identifier and its name parts
        for part in [value, *(w for w in value.split() if w.isalpha() and len(w) > 3)]:
            assert part.lower() not in raw and part.lower() not in shown, part
    pseudonyms = {t for r in _rows(out, "events_pdf", ["words"]) for w in r["words"] if w["entity"]
                  for t in tokens_in(w["text"])}  # the documents' keyed pseudonyms, as committed
    assert pseudonyms and not [p for p in pseudonyms if p.lower() in raw or html.escape(p).lower() in raw
                               or p.lower() in shown]
    assert tokens_in(page.text_expanded) == [] and tokens_in(report["bytes"].decode("utf-8")) == []
    subjects = {s for r in _rows(out, "lineage_sources", ["subjects"]) for s in r["subjects"]}
    assert subjects and not [s for s in subjects if s in raw]  # no data-subject id either
    # every inline image is one of the plots (a PNG as wide as a figure), never a frame
    sources = re.findall(rb'src="data:([a-z/]+);base64,([A-Za-z0-9+/=]+)"', report["bytes"])
    assert len(sources) == report["bytes"].count(b"<img") == len(page.images)
    for mime, data in sources:
        with Image.open(io.BytesIO(base64.b64decode(data))) as im:
            assert (mime, im.format, im.width) == (b"image/png", "PNG", FIG_WIDTH_IN * DPI)


def test_the_cli_writes_the_report_and_refuses_a_path_inside_out(lineage_run, tmp_path, monkeypatch, capsys):
    out = lineage_run.out
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    assert main(["report", str(out), "--out", str(out / "report.html")]) == 1
    assert "inside the output folder" in capsys.readouterr().err
    monkeypatch.chdir(out / "records")
    assert main(["report", str(out)]) == 1  # the default report.html, in a folder of OUT
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # nothing was written into OUT
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(out)]) == 0
    printed = capsys.readouterr().out
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    plots = page.count('<img class="plot"')
    assert str(tmp_path / "report.html") in printed and f"({plots} plots" in printed and plots >= 12
    assert page.startswith("<!DOCTYPE html>") and "Run report:" in page


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    from s3server import s3_server

    with s3_server(tmp_path_factory.mktemp("s3")) as server:
        yield server


def test_an_s3_out_gives_the_page_of_the_same_commit(lineage_run, s3, monkeypatch, tmp_path):
    """OUT copied object for object to s3://bucket/prefix (the commit names files relative to OUT)
    reads through pyarrow's S3 filesystem into the same page, plots included, but for its name."""
    from modalign.pipeline.report import build_report
    from s3server import use_aws_env

    use_aws_env(monkeypatch, s3)
    out, client = lineage_run.out, s3.client()
    for p in sorted(out.rglob("*")):
        rel = p.relative_to(out)
        if p.is_file() and rel.parts[0] != "cache":  # the feature cache is no part of a commit
            client.upload_file(str(p), s3.bucket, f"run/{rel.as_posix()}")
    uri = f"s3://{s3.bucket}/run"
    local = build_report(out)
    assert build_report(uri) == local.replace(str(out), uri)
    assert main(["report", uri, "--out", str(tmp_path / "s3.html")]) == 0
    assert (tmp_path / "s3.html").read_text(encoding="utf-8") == local.replace(str(out), uri)
