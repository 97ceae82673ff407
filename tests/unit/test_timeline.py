"""The session timeline in parts (``pipeline.timeline``): same rows as one-shot alignment, and a
restarted aligner resumes from its checkpoint plus the driver's log to the same rows."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from modalign.operators.align.aligner import TickAligner
from modalign.pipeline.layout import OutputLayout
from modalign.pipeline.timeline import NEEDS_RESUME, TimelineWriter
from modalign.schemas.config import RunConfig
from modalign.schemas.manifest import ClockMapping
from modalign.schemas.tables import MfccRow, TextBlockRow, VideoFrameRow

pytestmark = pytest.mark.unit

MS = 1_000_000
SECONDS = 24
ATTEMPT = "0123456789ab"
SOURCES = {"cam": ("video", VideoFrameRow), "mic": ("audio", MfccRow), "deck": ("pdf", TextBlockRow)}
CONFIG = RunConfig.model_validate({"align": {"part_s": 3.0}})


def _lineage(source_id: str) -> dict:
    return dict(session_id="s", source_id=source_id, source_uri=f"file:///{source_id}", source_version="sha256:x",
                operators="test@0", policy="p@1", model_id=None)


def _parts() -> list[tuple[str, pa.Table]]:
    """Event parts in arrival order: the slide deck's pages first (a document is read fast; blocks
    of one page share its times), then one second per part of a jittered camera with a hole and
    of 100 fps audio with a dropout."""
    rnd = np.random.default_rng(5)
    out = []
    pages = [0, 5_000, 11_000, 17_500]
    for p, start in enumerate(pages):
        end = pages[p + 1] * MS if p + 1 < len(pages) else None
        out.append(("deck", pa.table({"event_id": [f"deck/{p}/{b}" for b in range(2)],
                                      "t_ns": pa.array([start * MS] * 2, pa.int64()),
                                      "end_t_ns": pa.array([end, end], pa.int64())})))
    for sec in range(SECONDS):
        t = np.arange(sec * 1000, (sec + 1) * 1000, 40) * MS + rnd.integers(-6 * MS, 6 * MS, 25)
        keep = ~((t > 7_000 * MS) & (t < 7_600 * MS))
        out.append(("cam", pa.table({"event_id": [f"cam/{sec}/{i}" for i in np.flatnonzero(keep)],
                                     "t_ns": pa.array(t[keep], pa.int64())})))
        t = np.arange(sec * 1000, (sec + 1) * 1000, 10) * MS
        keep = ~((t > 13_000 * MS) & (t < 13_300 * MS))
        out.append(("mic", pa.table({"event_id": [f"mic/{sec}/{i}" for i in np.flatnonzero(keep)],
                                     "t_ns": pa.array(t[keep], pa.int64())})))
    return out


# The lapel's measured clock drifts past the 800 ms alarm threshold for a while: drift alarms and
# out_of_tolerance CTAL rows that span several parts.
WINDOWS = [(t * MS, (1_500 * MS if 9_000 <= t <= 15_000 else 0), 1.0) for t in range(0, SECONDS * 1000, 500)]


def _one_shot() -> dict[str, list[dict]]:
    al = TickAligner("s", CONFIG.align, trace_id="t" * 32)
    for sid, (mod, _) in SOURCES.items():
        al.register(sid, mod, _lineage(sid), ClockMapping())
    al.observe_offsets("mic", WINDOWS)
    for sid, table in _parts():
        al.add(sid, table)
    res = al.finish()
    return {"records": res.records.to_pylist(), "ctal": _no_trace(res.ctal.to_pylist()),
            "drift_alarms": res.alarms.to_pylist(), "ctal_summary": res.summary.to_pylist()}


def _multiset(rows: list[dict]) -> Counter:
    return Counter(json.dumps(r, sort_keys=True, default=str) for r in rows)


def _no_trace(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "trace_id"} for r in rows]


def _log(layout: OutputLayout) -> list[tuple]:
    """The driver's log of aligner calls for this session; event parts are written to OUT first."""
    log: list[tuple] = [("register", sid, mod, _lineage(sid), ClockMapping()) for sid, (mod, _) in SOURCES.items()]
    log.append(("observe_offsets", "mic", WINDOWS))
    seq = dict.fromkeys(SOURCES, 0)
    for sid, table in _parts():
        path = layout.events(SOURCES[sid][1], "s", sid, ATTEMPT, seq[sid])
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table.append_column("payload", pa.array([b"x"] * table.num_rows)), path)
        log.append(("add", sid, seq[sid], layout.relative(path), 0.0, table))
        seq[sid] += 1
        if sid == "deck" and seq[sid] == 4:  # the document's stream ended
            log.append(("finish_source", "deck", None))
    log += [("finish_source", sid, None) for sid in ("cam", "mic")]
    return log


def _call(w: TimelineWriter, entry: tuple):
    kind, sid, *args = entry
    if kind == "add":
        seq, _path, latency, table = args
        return w.add(sid, table, latency, seq)
    return getattr(w, kind)(sid, *args)


def _replayable(log: list[tuple]) -> list[tuple]:
    """The log as the driver keeps it: an add names its event part, the table is not kept."""
    return [e[:5] if e[0] == "add" else e for e in log]


def _committed(layout: OutputLayout, files: list[str]) -> dict[str, list[dict]]:
    """Rows of every file ``finish`` listed, per table, in part order."""
    out: dict[str, list[dict]] = {"records": [], "ctal": [], "drift_alarms": [], "ctal_summary": [], "ctal_jsonl": []}
    folder = {"records/": "records", "ctal/log/": "ctal", "ctal/alarms/": "drift_alarms",
              "ctal/summary/": "ctal_summary", "ctal/jsonl/": "ctal_jsonl"}
    for f in sorted(files):
        name = next(v for k, v in folder.items() if f.startswith(k))
        path = layout.path(f)
        rows = ([json.loads(line) for line in path.read_text().splitlines()] if name == "ctal_jsonl"
                else pq.read_table(path).to_pylist())
        out[name] += rows
    out["ctal"] = _no_trace(out["ctal"])
    return out


def test_parts_hold_the_rows_of_one_shot_alignment(tmp_path):
    layout = OutputLayout(tmp_path / "out")
    ref = _one_shot()
    assert ref["drift_alarms"] and any(r["decision"] == "out_of_tolerance" for r in ref["ctal"])
    assert any(r["decision"] == "gap" for r in ref["ctal"])

    w = TimelineWriter("s", CONFIG, layout, ATTEMPT, list(SOURCES))
    parts_seen = []
    for entry in _log(layout):
        assert _call(w, entry) != NEEDS_RESUME
        parts_seen.append(w.parts)
    res = w.finish()

    # Written as the watermarks advanced (part_s = 3 s of a 24 s session), not only at the end.
    assert parts_seen[len(parts_seen) // 2] >= 2 and res["parts"] >= 7
    records = [f for f in res["files"] if f.startswith("records/")]
    assert len(records) == res["parts"] and records[0] == f"records/s/{ATTEMPT}-00000.parquet"
    got = _committed(layout, res["files"])
    assert got["records"] == ref["records"]  # row for row, in tick order
    for name in ("ctal", "drift_alarms", "ctal_summary"):  # CTAL: gap and drift rows interleave per part
        assert _multiset(got[name]) == _multiset(ref[name]), name
    assert _no_trace(got["ctal_jsonl"]) == got["ctal"]
    assert res["ticks"] == SECONDS * 25 and res["ctal_rows"] == len(ref["ctal"])
    assert res["drift_alarms"] == len(ref["drift_alarms"])

    # The checkpoint is OUT's file of this attempt, not a committed one; it holds ids, times, counts.
    ckpt = layout.align_checkpoint("s", ATTEMPT)
    state = json.loads(ckpt.read_text())
    assert layout.relative(ckpt) not in res["files"] and state["parts"] == res["parts"] - 1
    assert state["consumed"]["cam"][0] == SECONDS and "payload" not in ckpt.read_text()
    buffered = sum(len(s["t"]) for s in state["aligner"]["sources"])
    assert 0 < buffered < 500  # the lateness window, not the session


@pytest.mark.parametrize("crash_at", [10, 40])
def test_a_restarted_writer_resumes_to_the_same_rows(tmp_path, crash_at):
    """``crash_at`` calls in (before the first part; mid-session, parts after the last
    checkpoint consumed), the instance is lost; a new one resumes from checkpoint + log."""
    clean_layout = OutputLayout(tmp_path / "clean")
    clean = TimelineWriter("s", CONFIG, clean_layout, ATTEMPT, list(SOURCES))
    for entry in _log(clean_layout):
        _call(clean, entry)
    expected = _committed(clean_layout, clean.finish()["files"])

    layout = OutputLayout(tmp_path / "out")
    log = _log(layout)
    first = TimelineWriter("s", CONFIG, layout, ATTEMPT, list(SOURCES))
    for entry in log[:crash_at]:
        _call(first, entry)
    ckpt = layout.align_checkpoint("s", ATTEMPT)
    if crash_at > 20:  # parts written, and event parts consumed after the last checkpoint
        saved = json.loads(ckpt.read_text())["consumed"]
        assert first.parts > 0 and sum(c.n for c in first.consumed.values()) > sum(n for n, _ in saved.values())
    else:
        assert first.parts == 0 and not ckpt.exists()
    del first  # the actor died: whatever it consumed after its last checkpoint is gone with it

    second = TimelineWriter("s", CONFIG, layout, ATTEMPT, list(SOURCES), restarted=True)
    assert second.held
    assert _call(second, log[crash_at]) == NEEDS_RESUME  # queued on it before the driver noticed: ignored
    info = second.resume(_replayable(log[:crash_at + 1]))
    assert info["replayed_parts"] > 0
    for entry in log[crash_at + 1:]:
        assert _call(second, entry) != NEEDS_RESUME
    got = _committed(layout, second.finish()["files"])
    for name in expected:
        assert _multiset(got[name]) == _multiset(expected[name]), name  # 0 lost, 0 duplicated
    assert got["records"] == expected["records"]
