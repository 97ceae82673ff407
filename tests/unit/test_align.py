"""Tick aligner: tolerance windows, uniqueness, gaps, page hold, CTAL and drift."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modalign.operators.align.aligner import TickAligner
from modalign.operators.align.drift import drift_segments
from modalign.operators.align.matching import match_points
from modalign.operators.align.ticks import tick_times
from modalign.operators.align.clock import SessionClock, pts_to_ns, samples_to_ns
from modalign.schemas.config import AlignConfig
from modalign.schemas.manifest import ClockMapping

pytestmark = pytest.mark.unit

MS = 1_000_000


def _lineage(source_id: str) -> dict:
    return dict(session_id="s", source_id=source_id, source_uri=f"file:///{source_id}", source_version="sha256:x",
                operators="test@0", policy="p@1", model_id=None)


def _events(source_id: str, t: list[int], end: list[int | None] | None = None) -> pa.Table:
    cols = {"event_id": [f"{source_id}/{i}" for i in range(len(t))], "t_ns": pa.array(t, pa.int64())}
    if end is not None:
        cols["end_t_ns"] = pa.array(end, pa.int64())
    return pa.table(cols)


def test_tick_times_exact_for_an_hour():
    t = tick_times(90_000, 25.0)
    assert t[1] == 40 * MS and t[-1] == 89_999 * 40 * MS
    t30 = tick_times(3, 29.97)
    assert t30.tolist() == [0, 33_366_700, 66_733_400]


def test_clock_mapping_is_exact_integer_arithmetic():
    c = SessionClock.from_mapping(ClockMapping(offset_ns=700 * MS, skew_ppm=100.0))
    hour = 3600 * 10**9
    assert c.to_session(hour) == 700 * MS + hour + 360 * MS  # 100 ppm of an hour = 360 ms
    assert c.to_session_array(np.array([0, hour])).tolist() == [700 * MS, c.to_session(hour)]
    from fractions import Fraction
    assert pts_to_ns(90_000 * 3600, Fraction(1, 90_000)) == hour
    assert samples_to_ns(16_000 * 3600 + 1, 16_000) == hour + 62_500


def test_points_within_tolerance_else_gap():
    ticks = np.array([0, 40, 80, 120]) * MS
    events = np.array([5, 78, 200]) * MS
    assert match_points(ticks, events, 33 * MS).tolist() == [0, -1, 1, -1]


def test_each_event_matched_once_nearest_tick_wins():
    ticks = np.array([0, 40, 80]) * MS
    events = np.array([55]) * MS  # 15 ms from tick 40, 25 ms from tick 80
    assert match_points(ticks, events, 33 * MS).tolist() == [-1, 0, -1]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 5_000), min_size=0, max_size=80, unique=True),
    st.integers(1, 60),
    st.randoms(use_true_random=False),
)
def test_property_matches_in_tolerance_unique_and_order_independent(ms_times, tol_ms, rnd):
    times = [m * MS + rnd.randint(-999_999, 999_999) for m in ms_times]
    cfg = AlignConfig(tolerance_ms={"video": float(tol_ms), "audio": 40.0, "pdf": 200.0})

    def run(batches):
        al = TickAligner("s", cfg)
        al.register("cam", "video", _lineage("cam"), ClockMapping())
        al.register("mic", "audio", _lineage("mic"), ClockMapping())
        al.add("mic", _events("mic", list(range(0, 5_000 * MS, 10 * MS))))
        for b in batches:
            al.add("cam", b)
        return al.finish()

    ids = [f"cam/{i}" for i in range(len(times))]
    table = pa.table({"event_id": ids, "t_ns": pa.array(times, pa.int64())})
    ordered = run([table.take(np.argsort(times))]) if times else run([])
    perm = list(range(len(times)))
    rnd.shuffle(perm)
    chunks = [table.take(perm[i:i + 7]) for i in range(0, len(perm), 7)]
    shuffled = run(chunks)
    assert ordered.records.equals(shuffled.records)

    rec = ordered.records.to_pandas() if False else ordered.records.to_pylist()
    cam = [r for r in rec if r["source_id"] == "cam"]
    matched = [r for r in cam if r["decision"] == "matched"]
    assert all(abs(r["residual_ns"]) <= tol_ms * MS for r in matched)
    assert len({r["event_id"] for r in matched}) == len(matched)
    # Ticks cover the session: every tick index once per source, last tick within one period of the end.
    assert [r["tick_index"] for r in cam] == list(range(ordered.ticks))
    end = max(times + [5_000 * MS - 10 * MS]) + 1
    assert ordered.ticks == -(-end // (40 * MS))


def test_pdf_page_held_until_next_and_seen_within_tolerance():
    al = TickAligner("s")
    al.register("cam", "video", _lineage("cam"), ClockMapping())
    al.register("deck", "pdf", _lineage("deck"), ClockMapping())
    al.add("cam", _events("cam", [k * 40 * MS for k in range(100)]))  # 4 s of video
    al.add("deck", _events("deck", [1000 * MS, 1000 * MS, 3000 * MS], [3000 * MS, 3000 * MS, None]))
    res = al.finish()
    deck = [r for r in res.records.to_pylist() if r["source_id"] == "deck"]
    assert deck[0]["decision"] == "gap"  # before page 0, outside the 200 ms window
    assert deck[20]["event_id"] == "deck/0" and deck[20]["residual_ns"] == 200 * MS  # 800 ms: 200 ms early
    assert deck[19]["decision"] == "gap"  # 760 ms: 240 ms early, outside tolerance
    assert deck[50]["event_id"] == "deck/0" and deck[50]["residual_ns"] == 0  # held
    assert deck[73]["event_id"] == "deck/0" and deck[73]["residual_ns"] == 0  # 80 ms before the change: still held
    assert deck[75]["event_id"] == "deck/2" and deck[99]["event_id"] == "deck/2"  # last page held to the end
    # Gaps are in the CTAL log with the missing source named; matched ticks are not.
    ctal = res.ctal.to_pylist()
    assert {c["tick_index"] for c in ctal} == set(range(20))
    assert all("deck" in c["reason"] and c["decision"] == "gap" for c in ctal)
    summary = {r["source_id"]: r for r in res.summary.to_pylist()}
    assert summary["deck"]["gaps"] == 20 and summary["cam"]["gaps"] == 0


def test_drift_alarm_needs_consecutive_ticks():
    ticks = np.arange(20) * 40 * MS
    spread = np.zeros(20)
    spread[3:6] = 900 * MS  # 3 ticks: no alarm
    spread[10:16] = 1200 * MS  # 6 ticks: one alarm
    rows = drift_segments("s", ticks, spread, 800 * MS, 5, ["a", "b"])
    assert len(rows) == 1
    assert (rows[0]["start_tick"], rows[0]["end_tick"]) == (10, 15)
    assert rows[0]["start_t_ns"] == 400 * MS and rows[0]["max_residual_ms"] == 1200.0


@settings(max_examples=200, deadline=None)
@given(st.integers(-4 * 3600 * 10**9, 4 * 3600 * 10**9), st.integers(-10**7, 10**7), st.integers(-10**10, 10**10))
def test_clock_array_equals_exact_integers_for_hours_at_any_skew(local_ns, skew_ppb, offset_ns):
    c = SessionClock(offset_ns=offset_ns, skew_ppb=skew_ppb)
    exact = offset_ns + local_ns + (local_ns * skew_ppb) // 10**9  # Python ints: no overflow
    assert c.to_session(local_ns) == exact
    assert c.to_session_array(np.array([local_ns], np.int64))[0] == exact
    # to_local inverts it: the last local ns that maps at or before a session time.
    t = c.to_local(exact)
    assert c.to_session(t) <= exact < c.to_session(t + 1)


def test_clock_for_four_hours_at_one_percent_skew():
    c = SessionClock.from_mapping(ClockMapping(offset_ns=-5 * 10**9, skew_ppm=10_000.0))
    four_h = 4 * 3600 * 10**9
    local = np.array([0, four_h - 1, four_h], np.int64)  # local * skew_ppb would overflow int64
    assert c.to_session_array(local).tolist() == [c.to_session(int(x)) for x in local]
    assert c.to_session(four_h) == -5 * 10**9 + four_h + 144 * 10**9  # 1 % of 4 h = 144 s


def test_pdf_blocks_of_one_page_are_one_event_named_by_the_smallest_id():
    def run(order):
        al = TickAligner("s", trace_id="t")
        al.register("cam", "video", _lineage("cam"), ClockMapping())
        al.register("deck", "pdf", _lineage("deck"), ClockMapping())
        al.add("cam", _events("cam", [k * 40 * MS for k in range(10)]))
        for i in order:
            al.add("deck", pa.table({"event_id": [f"deck/{i}"], "t_ns": pa.array([0], pa.int64()),
                                     "end_t_ns": pa.array([None], pa.int64())}))
        return al.finish().records

    a, b = run([2, 0, 1]), run([0, 1, 2])
    assert a.equals(b)
    assert set(a.filter(pc.equal(a.column("source_id"), "deck")).column("event_id").to_pylist()) == {"deck/0"}


def test_idle_source_times_out_and_releases_ticks():
    al = TickAligner("s", allowed_lateness_ms=0, idle_timeout_s=5.0)
    al.register("cam", "video", _lineage("cam"), ClockMapping())
    al.register("mic", "audio", _lineage("mic"), ClockMapping())
    al.add("cam", _events("cam", [k * 40 * MS for k in range(100)]))
    al.add("mic", _events("mic", [k * 10 * MS for k in range(100)]))  # the mic stops after 1 s
    import time

    now = time.monotonic()
    assert al.poll(now=now).tick_end < 25
    assert al.poll(now=now + 60).tick_end > 90  # mic silent for 60 s: treated as finished
