"""The progress displays (pipeline/progress.py): what each shows for the same events."""

from __future__ import annotations

import io
import json
import os
import re

import pytest
from rich.console import Console

from modalign.pipeline.cli import build_parser
from modalign.pipeline.progress import (Display, JsonDisplay, PlainDisplay, RichDisplay, RunProgress, make_display,
                                        progress_line)

pytestmark = pytest.mark.unit

S = 1_000_000_000
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def feed(d: Display) -> None:
    """A run of 2 sessions, 4 sources (one refused before work), a video cut into 2 ranges."""
    d.run_started(sessions=2, sources=4, quarantined=1)
    d.stage("ingest")
    d.stream_started("s1/cam range 1/2", "video", 10 * S)
    d.stream_started("s1/cam range 2/2", "video", 20 * S)
    d.stream_advanced("s1/cam range 1/2", "video", 125, 0, 5 * S - 40_000_000)
    d.stream_advanced("s1/cam range 2/2", "video", 100, 10 * S, 14 * S)
    d.stream_started("s1/mic", "audio", 30 * S)
    d.stream_advanced("s1/mic", "audio", 1500, 10 * S, 25 * S)
    d.stream_started("s2/slides", "pdf", None)
    d.stream_advanced("s2/slides", "pdf", 7, 0, 6 * S, [0, 3 * S, 6 * S])
    d.stream_advanced("s2/slides", "pdf", 2, 6 * S, 6 * S, [6 * S])  # a page seen again is not a new page
    d.embed_submitted(3)
    d.embed_done(2)
    d.quarantined()  # a range of the mic, say
    d.stream_done("s2/slides")
    d.source_done("ingested")
    d.source_done("partial")


def test_state_counts_units_per_modality_and_media_seconds():
    d = Display()
    feed(d)
    snap = d.state.snapshot()
    assert (snap["sources"], snap["sources_done"], snap["ingested"], snap["partial"], snap["quarantined"]) == \
        (4, 3, 1, 1, 1)
    assert snap["quarantine_rows"] == 2
    assert snap["frames"] == 225 and snap["pages"] == 3 and snap["audio_s"] == 15.0
    # ranges: 4.96 of 10 s and 4 of 10 s; the mic: 15 of 20 s; the slides have no length
    assert snap["media_s"] == pytest.approx(4.96 + 4 + 15, abs=0.05)
    assert snap["media_total_s"] == 40.0
    assert (snap["embed_batches"], snap["embed_done"]) == (3, 2)
    assert snap["streams"] == ["s1/cam range 1/2", "s1/cam range 2/2", "s1/mic"]  # the slides are done
    assert snap["eta_s"] is not None and snap["eta_s"] >= 0


def test_a_finished_stream_counts_whole_and_eta_is_zero_at_the_end():
    p = RunProgress()
    p.reset(1, 1)
    p.open("s/v", "video", 10 * S)
    p.advance("s/v", "video", 1, 0, 9_960_000_000)  # the last frame starts 40 ms before the end
    p.close_stream("s/v")
    assert p.media() == (10.0, 10.0)
    assert p.eta_s() == 0.0


def test_the_ranges_of_a_cut_video_count_in_the_total_before_they_start():
    """A 90 s video cut into 3 ranges on 1 actor: the total is 90 s from the start, not 30 s a range at a time."""
    d = Display()
    d.run_started(sessions=1, sources=1)
    for k in range(3):
        d.stream_planned(f"s/cam range {k + 1}/3", "video", 30.0)
    d.stream_started("s/cam range 1/3", "video", 30 * S)
    d.stream_advanced("s/cam range 1/3", "video", 750, 0, 15 * S)
    snap = d.state.snapshot()
    assert snap["media_total_s"] == 90.0 and snap["media_s"] == 15.0
    assert snap["streams"] == ["s/cam range 1/3"]  # planned ranges are not in flight
    eta = d.state.eta_s()
    assert eta is not None and eta > 0 and d.state.media() == (15.0, 90.0)
    d.stream_done("s/cam range 1/3")
    d.stream_started("s/cam range 2/3", "video", 60 * S)
    d.stream_advanced("s/cam range 2/3", "video", 1, 30 * S, 30 * S)  # its actual span takes over
    assert d.state.media() == (30.0, 90.0)


def test_a_range_knows_how_much_video_it_outputs():
    from modalign.operators.ingest.video import VideoRange

    # 25 fps in a 1/12800 time base (512 ticks a frame): frames 0..99 decoded, 25..74 owned
    pts = tuple(512 * i for i in range(100))
    mid = VideoRange(index=1, count=3, start_pts=512 * 25, end_pts=512 * 75, decode_from_pts=0, decode_to_pts=None,
                     first_index=0, pts=pts, before_pts=None, origin_pts=0, time_base=(1, 12800))
    assert mid.seconds == pytest.approx(2.0)  # 50 frames
    last = VideoRange(index=2, count=3, start_pts=512 * 75, end_pts=None, decode_from_pts=0, decode_to_pts=None,
                      first_index=0, pts=pts, before_pts=None, origin_pts=0, time_base=(1, 12800))
    assert last.seconds == pytest.approx(24 / 25)  # to its last frame's start


def test_plain_lines_have_the_figures_and_no_control_codes():
    buf = io.StringIO()
    d = PlainDisplay(buf, every_s=0)
    feed(d)
    d.message("ingest s1/cam (video): 225 events, ingested")
    d.run_ended()
    text = buf.getvalue()
    assert not ANSI.search(text)
    lines = text.splitlines()
    assert "modalign: ingest s1/cam (video): 225 events, ingested" in lines
    last = lines[-1]
    assert last.startswith("modalign: progress [ingest, ")
    assert "3/4 sources done (1 ingested, 1 partial, 1 quarantined; 2 quarantine rows)" in last
    assert "media 24.0/40.0 s (60%)" in last and "225 frames, 15.0 s audio, 3 pages" in last
    assert "embed 2/3 batches" in last and "aligned 0/2 sessions" in last


def test_plain_lines_are_periodic_not_per_event():
    buf = io.StringIO()
    d = PlainDisplay(buf, every_s=3600)
    feed(d)  # the first line (run started) is due; the events after it within the hour are not
    assert len([line for line in buf.getvalue().splitlines() if "progress" in line]) == 1
    d.run_ended()  # the last line always comes
    assert len([line for line in buf.getvalue().splitlines() if "progress" in line]) == 2


def test_json_lines_parse_and_carry_the_snapshot():
    buf = io.StringIO()
    d = JsonDisplay(buf, every_s=0)
    feed(d)
    d.message("hello", "warning")
    d.run_ended()
    rows = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert {"message", "progress"} == {r["event"] for r in rows}
    assert {"ts", "level", "event"} <= set(rows[0])
    assert any(r["event"] == "message" and r["message"] == "hello" and r["level"] == "warning" for r in rows)
    final = rows[-1]
    assert final["event"] == "progress" and final["final"] is True
    assert (final["frames"], final["pages"], final["sources_done"]) == (225, 3, 3)


def test_rich_bars_show_the_run_and_each_stream_in_flight():
    buf = io.StringIO()
    d = RichDisplay(Console(file=buf, force_terminal=True, width=160, color_system=None))
    feed(d)
    d.message("clock s1/mic: offset +730.0 ms")
    d.run_ended()
    d.close()
    text = ANSI.sub("", buf.getvalue())
    assert "━" in text  # the bars
    last = text[text.rindex("sources "):]  # the last frame drawn
    for line in ("sources", "recordings (s)", "embed batches", "sessions aligned", "s1/mic (audio)",
                 "s1/cam range 1/2 (video)"):
        assert line in last
    assert "3/4" in last and "4 discovered, 1 ingested, 1 partial, 1 quarantined" in last
    assert "225 frames, 15 s audio, 3 pages" in last and "15.0 s audio" in last
    assert "s2/slides (pdf)" not in last  # done: its bar is hidden
    assert "modalign: clock s1/mic: offset +730.0 ms" in text


def test_quiet_shows_warnings_only(capsys):
    d = Display()
    feed(d)
    d.message("ingest s1/cam: 225 events")
    d.message("metrics not served: port in use", "warning")
    d.run_ended()
    err = capsys.readouterr().err
    assert err == "modalign: metrics not served: port in use\n"


def test_make_display_follows_the_stream_and_the_options():
    assert type(make_display(stream=io.StringIO())) is PlainDisplay
    assert type(make_display(stream=io.StringIO(), log_format="json")) is JsonDisplay
    assert type(make_display(stream=io.StringIO(), quiet=True)) is Display
    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "w") as tty:
            d = make_display(stream=tty)
            assert type(d) is RichDisplay
            d.close()
    finally:
        os.close(master)


def test_cli_options_reach_every_command_that_reports():
    p = build_parser()
    args = p.parse_args(["run", "in", "--out", "o", "--quiet", "--log-format", "json"])
    assert args.quiet and args.log_format == "json"
    args = p.parse_args(["watch", "in", "--out", "o", "-q"])
    assert args.quiet and args.log_format == "text"
    args = p.parse_args(["lineage", "erase", "o", "--source", "x", "--log-format", "json"])
    assert args.log_format == "json"
    with pytest.raises(SystemExit):
        p.parse_args(["run", "in", "--out", "o", "--log-format", "xml"])


def test_progress_line_without_media():
    d = Display()
    d.run_started(1, 1)
    assert "media" not in progress_line(d.state.snapshot())
    assert progress_line(d.state.snapshot()).endswith("eta -")
