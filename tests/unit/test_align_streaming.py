"""Streaming tick aligner: watermarks, lateness, determinism, bounded state, drift from offsets."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modalign.operators.align.aligner import TickAligner
from modalign.schemas.config import AlignConfig
from modalign.schemas.manifest import ClockMapping

pytestmark = pytest.mark.unit

MS = 1_000_000
TRACE = "t" * 32


def _lineage(source_id: str) -> dict:
    return dict(session_id="s", source_id=source_id, source_uri=f"file:///{source_id}", source_version="sha256:x",
                operators="test@0", policy="p@1", model_id=None)


def _table(ids: list[str], t: list[int], end: list[int | None] | None = None) -> pa.Table:
    cols = {"event_id": pa.array(ids, pa.string()), "t_ns": pa.array(t, pa.int64())}
    if end is not None:
        cols["end_t_ns"] = pa.array(end, pa.int64())
    return pa.table(cols)


MODALITY = {"cam": "video", "mic": "audio", "deck": "pdf"}


def _aligner(cfg: AlignConfig, lateness_ms: float, **kw) -> TickAligner:
    al = TickAligner("s", cfg, allowed_lateness_ms=lateness_ms, trace_id=TRACE, **kw)
    for sid, mod in MODALITY.items():
        al.register(sid, mod, _lineage(sid), ClockMapping())
    return al


def _batch(cfg, lateness_ms, events):
    """Reference: every source's events in one in-order batch, then finish."""
    al = _aligner(cfg, lateness_ms)
    for sid in MODALITY:
        ev = sorted((e for e in events if e[0] == sid), key=lambda e: (e[2], e[1]))
        if ev:
            al.add(sid, _table([e[1] for e in ev], [e[2] for e in ev], [e[3] for e in ev] if sid == "deck" else None))
    return al.finish()


@st.composite
def sessions(draw):
    """Random events of three sources: jittered, with holes, shuffled within the lateness bound."""
    rnd = draw(st.randoms(use_true_random=False))
    dur_ms = draw(st.integers(300, 4000))
    events = []  # (source, id, t_ns, end_ns)
    period = draw(st.sampled_from([33_333_333, 40 * MS, 50 * MS]))
    t, i = draw(st.integers(-20, 200)) * MS, 0
    while t < dur_ms * MS:
        if rnd.random() > 0.1:  # 10 % of frames missing
            events.append(("cam", f"cam/{i}", t + rnd.randint(-6 * MS, 6 * MS), None))
        t += period
        i += 1
        if rnd.random() < 0.03:  # a hole of several frames
            t += rnd.randint(1, 8) * period
    start = draw(st.integers(0, 900)) * MS + rnd.randint(0, 9 * MS)
    for i, t in enumerate(range(start, dur_ms * MS, 10 * MS)):
        if not (dur_ms * MS // 3 < t < dur_ms * MS // 3 + 150 * MS):  # a 150 ms dropout
            events.append(("mic", f"mic/{i}", t, None))
    n_pages = draw(st.integers(0, 3))
    starts = sorted(rnd.sample(range(0, dur_ms), n_pages))
    for p, s in enumerate(starts):
        end = starts[p + 1] * MS if p + 1 < n_pages else None
        for b in range(rnd.randint(1, 3)):  # blocks of a page share its times
            events.append(("deck", f"deck/{p}/{b}", s * MS, end))
    # Equal times on one source must not make the output depend on arrival order.
    if events and rnd.random() < 0.3:
        e = rnd.choice([e for e in events if e[0] != "deck"] or events)
        if e[0] != "deck":
            events.append((e[0], e[1] + "-dup", e[2], None))
    lateness_ms = draw(st.sampled_from([0.0, 30.0, 250.0, 2000.0]))
    delays = [rnd.random() * lateness_ms * MS for _ in events]
    order = sorted(range(len(events)), key=lambda k: (events[k][2] + delays[k], k))
    n_cuts = rnd.choice([0, 5, 40, 150])
    cuts = sorted(rnd.sample(range(1, len(order)), min(len(order) - 1, n_cuts))) if len(order) > 1 else []
    batches = [order[a:b] for a, b in zip([0] + cuts, cuts + [len(order)])]
    cfg = AlignConfig(tolerance_ms={"video": float(draw(st.integers(1, 45))), "audio": float(draw(st.integers(1, 40))),
                                    "pdf": float(draw(st.integers(20, 300)))})
    polls = [rnd.random() < 0.7 for _ in batches]
    return events, batches, polls, lateness_ms, cfg


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sessions())
def test_streaming_equals_in_order_batch(case):
    events, batches, polls, lateness_ms, cfg = case
    ref = _batch(cfg, lateness_ms, events)

    al = _aligner(cfg, lateness_ms)
    finished = set()
    for batch, poll in zip(batches, polls):
        for sid in MODALITY:  # one add() per source present in the arrival batch
            ev = [events[k] for k in batch if events[k][0] == sid]
            if ev:
                assert sid not in finished
                al.add(sid, _table([e[1] for e in ev], [e[2] for e in ev],
                                   [e[3] for e in ev] if sid == "deck" else None))
        for sid in MODALITY:  # a source whose events have all arrived says so
            if sid not in finished and all(events[k][0] != sid for b in batches[batches.index(batch) + 1:] for k in b):
                if poll:
                    al.finish_source(sid)
                    finished.add(sid)
        if poll:
            al.poll()
    got = al.finish()

    assert got.ctal.filter(pc.equal(got.ctal.column("decision"), "late")).num_rows == 0
    assert got.records.equals(ref.records)
    assert got.ctal.equals(ref.ctal)
    assert got.summary.equals(ref.summary)
    assert got.alarms.equals(ref.alarms) and got.ticks == ref.ticks

    # Properties of the (shared) result.
    rec = got.records.to_pylist()
    tol = {m: cfg.tolerance_ms[m] * MS for m in ("video", "audio", "pdf")}
    matched = [r for r in rec if r["decision"] == "matched"]
    assert all(abs(r["residual_ns"]) <= tol[r["modality"]] for r in matched)
    point_ids = [r["event_id"] for r in matched if r["modality"] != "pdf"]
    assert len(point_ids) == len(set(point_ids))  # no event matched twice
    points = [e[2] for e in events if e[0] != "deck"]
    end = (max(points) + 1) if points else (max((e[2] for e in events), default=-1) + 1)
    assert got.ticks == max(0, -(-end // (40 * MS)))  # ticks cover the session exactly
    for sid in MODALITY:
        assert [r["tick_index"] for r in rec if r["source_id"] == sid] == list(range(got.ticks))
    # Every gap is in the CTAL log with the source named; matched ticks are not.
    gap_ticks = {r["tick_index"] for r in rec if r["decision"] == "gap"}
    assert {c["tick_index"] for c in got.ctal.to_pylist() if c["decision"] == "gap"} == gap_ticks


def _stream(minutes: float, batch_s: float = 1.0, lateness_ms: float = 2000.0, retain: bool = True):
    """Video 25 fps + MFCC 100 Hz, in arrival batches of batch_s; yields (aligner, max buffered)."""
    al = TickAligner("s", allowed_lateness_ms=lateness_ms, retain=retain, trace_id=TRACE)
    al.register("cam", "video", _lineage("cam"), ClockMapping())
    al.register("mic", "audio", _lineage("mic"), ClockMapping())
    end_ns = int(minutes * 60 * 1e9)
    step = int(batch_s * 1e9)
    peak, polled = 0, []
    for b0 in range(0, end_ns, step):
        for sid, period in (("cam", 40 * MS), ("mic", 10 * MS)):
            k0, k1 = -(-b0 // period), -(-min(b0 + step, end_ns) // period)
            t = np.arange(k0, k1, dtype=np.int64) * period + (3 * MS if sid == "cam" else 0)
            al.add(sid, _table([f"{sid}/{k}" for k in range(k0, k1)], t.tolist()))
        peak = max(peak, al.buffered_events())
        polled.append(al.poll())
    return al, peak, polled


def test_state_is_bounded_by_the_lateness_window_not_the_session():
    al1, peak1, polled1 = _stream(1.0, retain=False)
    al5, peak5, _ = _stream(5.0, retain=False)
    # Held: one 1 s batch + 2 s lateness + the 3-tolerance horizon on both sides of the
    # next undecided tick (2 x 120 ms), of video (25/s) and audio (100/s) events.
    assert peak1 == peak5
    assert peak5 <= (1.0 + 2.0 + 0.24) * (25 + 100)
    # Ticks flow out while the stream runs: by the last batch only the lateness window is pending.
    assert polled1[-1].tick_end >= 25 * (60 - 3)
    rest = al1.finish()
    parts = [p.records for p in polled1] + [rest.records]
    assert pa.concat_tables(parts).num_rows == 2 * 25 * 60
    whole, _, _ = _stream(1.0, retain=True)
    assert pa.concat_tables(parts).equals(whole.finish().records)


def test_late_event_is_logged_never_matched_and_emitted_ticks_stay():
    al = TickAligner("s", allowed_lateness_ms=100, trace_id=TRACE)
    al.register("cam", "video", _lineage("cam"), ClockMapping())
    al.register("mic", "audio", _lineage("mic"), ClockMapping())
    cam_t = [k * 40 * MS for k in range(50) if k != 10]  # frame of tick 10 is missing ...
    al.add("cam", _table([f"cam/{k}" for k in range(50) if k != 10], cam_t))
    al.add("mic", _table([f"mic/{k}" for k in range(200)], [k * 10 * MS for k in range(200)]))
    first = al.poll()
    assert first.tick_end > 11 and first.records.num_rows == 2 * first.tick_end
    assert al.watermark("cam") == 49 * 40 * MS - 100 * MS
    # ... and arrives after tick 10 was emitted: logged as late, not matched anywhere.
    assert al.add("cam", _table(["cam/10"], [400 * MS])) == 0
    res = al.finish()
    late = [c for c in res.ctal.to_pylist() if c["decision"] == "late"]
    assert len(late) == 1 and late[0]["tick_index"] == 10 and "cam/10" in late[0]["reason"]
    assert late[0]["observed_offsets_ns"] == [0, None]  # order: cam, mic
    ids = [r["event_id"] for r in res.records.to_pylist()]
    assert "cam/10" not in ids
    tick10 = [r for r in res.records.to_pylist() if r["tick_index"] == 10 and r["source_id"] == "cam"]
    assert tick10[0]["decision"] == "gap"
    assert res.records.slice(0, first.records.num_rows).equals(first.records)


def test_nothing_is_emitted_before_every_expected_source_is_registered():
    al = TickAligner("s", allowed_lateness_ms=0, expected_sources=["cam", "deck"])
    al.register("cam", "video", _lineage("cam"), ClockMapping())
    al.add("cam", _table([f"cam/{k}" for k in range(100)], [k * 40 * MS for k in range(100)]))
    assert al.poll().records.num_rows == 0
    al.register("deck", "pdf", _lineage("deck"), ClockMapping())
    al.add("deck", _table(["deck/0"], [0], [None]))
    al.finish_source("deck")
    out = al.poll()
    assert out.tick_end > 0 and out.records.num_rows == 2 * out.tick_end
    with pytest.raises(Exception, match="late_source"):
        al.register("mic", "audio", _lineage("mic"), ClockMapping())


def test_explicit_watermark_releases_ticks_and_finish_source_flushes():
    al = TickAligner("s", allowed_lateness_ms=10_000)
    al.register("cam", "video", _lineage("cam"), ClockMapping())
    al.register("mic", "audio", _lineage("mic"), ClockMapping())
    al.add("cam", _table([f"cam/{k}" for k in range(100)], [k * 40 * MS for k in range(100)]))
    al.add("mic", _table([f"mic/{k}" for k in range(400)], [k * 10 * MS for k in range(400)]))
    assert al.poll().tick_end == 0  # 10 s lateness holds everything back
    al.advance_watermark("cam", 2_000 * MS)
    al.advance_watermark("mic", 2_000 * MS)
    assert al.poll().tick_end == 47  # ticks with t + 3 * 40 ms < 2 s: t < 1.88 s, k <= 46
    al.finish_source("cam")
    al.finish_source("mic")
    assert al.poll().tick_end == 100
    assert al.finish().ticks == 100


def _drift_aligner(windows, chunks: int, skew_ppm: float = 0.0):
    al = TickAligner("s", trace_id=TRACE, allowed_lateness_ms=0)
    al.register("cam", "video", _lineage("cam"), ClockMapping())
    al.register("mic", "audio", _lineage("mic"), ClockMapping(offset_ns=300 * MS, skew_ppm=skew_ppm))
    al.observe_offsets("mic", windows)
    cam = [k * 40 * MS for k in range(1500)]  # 60 s
    mic = [k * 10 * MS for k in range(6000)]
    for part in np.array_split(np.arange(1500), chunks):
        al.add("cam", _table([f"cam/{k}" for k in part], [cam[k] for k in part]))
        lo, hi = part[0] * 4, part[-1] * 4 + 4
        al.add("mic", _table([f"mic/{k}" for k in range(lo, hi)], mic[lo:hi]))
        al.poll()
    return al.finish()


def test_drift_alarm_from_observed_offsets_is_chunking_independent():
    # The mic's measured offset grows 20 ms per second from 300 ms (a 2 % slow clock) while
    # its mapping says a constant 300 ms; one window every 2 s, one of them a wrong peak.
    windows = [(t * MS, 300 * MS + 20 * t * 1000, 0.9) for t in range(1000, 60000, 2000)]
    windows[5] = (windows[5][0], 5_000 * MS, 0.9)  # isolated wrong peak: removed by the running median
    windows.append((31_000 * MS, -9_000 * MS, 0.0))  # zero confidence: ignored
    a = _drift_aligner(windows, chunks=1)
    b = _drift_aligner(windows, chunks=37)
    assert a.alarms.equals(b.alarms) and a.ctal.equals(b.ctal) and a.records.equals(b.records)
    alarms = a.alarms.to_pylist()
    assert len(alarms) == 1
    # Residual 20 ms/s * t crosses 800 ms at t = 40 s exactly; the first tick above is 40.04 s.
    assert alarms[0]["start_tick"] == 1001 and alarms[0]["end_tick"] == 1499
    assert alarms[0]["sources"] == ["mic", "cam"]
    assert alarms[0]["max_residual_ms"] == pytest.approx(20 * 59.0, abs=0.01)  # held after the last window
    oot = [c for c in a.ctal.to_pylist() if c["decision"] == "out_of_tolerance"]
    assert [c["tick_index"] for c in oot] == list(range(1001, 1500))
    assert oot[0]["observed_offsets_ns"][0] == 0 and oot[0]["observed_offsets_ns"][1] > 800 * MS
    # A drift that the mapping in use explains (offset 300 ms, skew 1 %) is no alarm.
    explained = [(t * MS, round(t * MS - (t * MS - 300 * MS) / 1.01), 1.0) for t in range(1000, 60000, 2000)]
    fitted = _drift_aligner(explained, chunks=3, skew_ppm=10_000)
    assert fitted.alarms.num_rows == 0 and "out_of_tolerance" not in fitted.ctal.column("decision").to_pylist()


def test_short_drift_runs_raise_nothing():
    windows = [(t * MS, 300 * MS, 1.0) for t in range(0, 60000, 1000)]
    windows[20] = (20_000 * MS, 2_000 * MS, 1.0)  # one spike, smoothed away
    assert _drift_aligner(windows, chunks=5).alarms.num_rows == 0


def test_a_tick_waits_for_the_events_that_decide_its_competitor():
    # Tick 0 wants frame e1 (25 ms) but tick 1 (40 ms) is nearer and takes it, until frame
    # e2 (50 ms), within the lateness bound but after a later frame, frees e1 for tick 0.
    # Tick 0 must therefore wait for every frame up to 3 tolerances after it.
    cfg = AlignConfig(tolerance_ms={"video": 45.0, "audio": 40.0, "pdf": 200.0})
    streamed = TickAligner("s", cfg, allowed_lateness_ms=200, trace_id=TRACE)
    streamed.register("cam", "video", _lineage("cam"), ClockMapping())
    for ids, t in ((["e1", "e3", "e5"], [25, 78, 250]), (["e2"], [50])):  # watermark 50 ms, then e2 at 50 ms
        streamed.add("cam", _table(ids, [x * MS for x in t]))
        streamed.poll()
    got = {r["tick_index"]: r["event_id"] for r in streamed.finish().records.to_pylist()}
    assert (got[0], got[1], got[2], got[6]) == ("e1", "e2", "e3", "e5")


def test_a_source_cut_short_shows_its_missing_time_as_gaps():
    """Defect: a source whose worker died mid-way ended the timeline at its last event ('0 gaps')."""
    cfg = AlignConfig(tick_hz=25)
    al = TickAligner("s", cfg, trace_id=TRACE)
    al.register("cam", "video", _lineage("cam"), ClockMapping())
    al.add("cam", _table([f"c{i}" for i in range(25)], [i * 40_000_000 for i in range(25)]))  # 1 s of 4 s
    al.expect_until("cam", 4_000_000_000)
    al.finish_source("cam")
    res = al.finish()
    assert res.ticks == 100  # the whole recording, not the part that arrived
    decisions = res.records.column("decision").to_pylist()
    assert decisions[:25] == ["matched"] * 25 and decisions[25:] == ["gap"] * 75
    gaps = res.ctal.filter(pc.equal(res.ctal.column("decision"), "gap"))
    assert gaps.num_rows == 75 and res.summary.column("gaps").to_pylist() == [75]
