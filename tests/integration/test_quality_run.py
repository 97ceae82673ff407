"""The modality quality gates in real runs: a ``drop`` expectation quarantines a dark stretch of a
video as one row with its session-time range and those frames are absent (gaps in the timeline);
against a reference run of a darkened copy of the sample's video the brightness alarms
(``quality_shift``), against an identical reference nothing does; ``inspect`` and the metrics show it."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

import modalign
from modalign.pipeline.cli import main
from modalign.pipeline.metrics import Metrics
from modalign.pipeline.runner import Runner
from modalign.schemas.config import RunConfig

pytestmark = pytest.mark.integration

MS = 1_000_000
FRAME_NS = 40 * MS  # the sample's 25 fps
DARK = range(50, 100)  # frames 2.0 s .. 3.96 s of the "stretch" session are nearly black
FAST = {"policy": {"face": {"action": "keep"}, "frame_text": {"action": "keep"}}, "embed": {"image_fps": 0.5}}
DROP = {"modality": "video", "property": "brightness_mean", "min": 16, "action": "drop"}


def _recode(src: Path, dst: Path, gain) -> None:
    """``src``'s frames times ``gain(i)`` (PyAV, H.264, the same 25 fps timing), without sound."""
    import av

    with av.open(str(src)) as inp, av.open(str(dst), "w") as out:
        s = out.add_stream("libx264", rate=25)
        s.width, s.height, s.pix_fmt = 640, 360, "yuv420p"
        s.codec_context.time_base = Fraction(1, 25)
        s.options = {"crf": "18", "g": "50"}
        s.thread_count = 1
        for i, frame in enumerate(inp.decode(video=0)):
            img = np.clip(np.round(frame.to_ndarray(format="rgb24") * gain(i)), 0, 255).astype(np.uint8)
            f = av.VideoFrame.from_ndarray(img, format="rgb24")
            f.pts, f.time_base = i, Fraction(1, 25)
            for p in s.encode(f):
                out.mux(p)
        for p in s.encode(None):
            out.mux(p)


def _session(folder: Path, session_id: str, video: Path, src: Path, gain) -> None:
    folder.mkdir(parents=True)
    _recode(src, folder / video.name, gain)
    (folder / "manifest.yaml").write_text(f"session_id: {session_id}\nsources:\n"
                                          f"  - {{id: cam, uri: {video.name}, modality: video, audio_track: false}}\n")


@pytest.fixture(scope="module")
def runs(ray_local, sample_manifest, tmp_path_factory):
    """OUT0: the sample's video darkened (x 89/142); OUT1: the sample's video ("meeting") and a copy with
    a black stretch ("stretch"), a drop expectation, against OUT0; OUT2: OUT1's input again against OUT1."""
    room = sample_manifest.parent / "room.mp4"
    root = tmp_path_factory.mktemp("quality")
    _session(root / "dark" / "meeting", "meeting", Path("room.mp4"), room, lambda i: 89 / 142)
    _session(root / "in" / "meeting", "meeting", Path("room.mp4"), room, lambda i: 1.0)
    _session(root / "in" / "stretch", "stretch", Path("room.mp4"), room, lambda i: 0.04 if i in DARK else 1.0)
    keys = root / "keys"
    quality = {"expectations": [DROP], "shift": {"min_events": 50}}
    out0, out1, out2 = root / "out0", root / "out1", root / "out2"
    s0 = Runner(RunConfig(key_store=keys, quality=quality, **FAST), out0, progress=lambda _m: None).run(root / "dark")
    metrics = Metrics()
    cfg1 = RunConfig(key_store=keys, quality=quality, monitor={"reference": str(out0)}, **FAST)
    s1 = Runner(cfg1, out1, progress=lambda _m: None, metrics=metrics).run(root / "in")
    cfg2 = RunConfig(key_store=keys, quality=quality, monitor={"reference": str(out1)}, **FAST)
    s2 = Runner(cfg2, out2, progress=lambda _m: None).run(root / "in")
    return {"out0": out0, "out1": out1, "out2": out2, "s0": s0, "s1": s1, "s2": s2, "metrics": metrics}


def test_a_drop_expectation_quarantines_the_dark_stretch_as_one_row_and_leaves_gaps(runs):
    out = modalign.open(runs["out1"])
    q = [r for r in out.table("quarantine").to_table().to_pylist()]
    (row,) = q
    assert (row["session_id"], row["source_id"], row["reason_code"], row["stage"]) == \
        ("stretch", "cam", "quality_expectation", "quality")
    assert (row["start_t_ns"], row["end_t_ns"]) == (DARK.start * FRAME_NS, (DARK.stop - 1) * FRAME_NS)
    assert f"{len(DARK)} record(s) dropped" in row["message"] and "video brightness_mean in [16, inf]" in row["message"]
    events = out.table("events_video").to_table(columns=["session_id", "frame_index", "t_ns"]).to_pylist()
    stretch = sorted(e["frame_index"] for e in events if e["session_id"] == "stretch")
    assert stretch == [i for i in range(150) if i not in DARK]
    assert len([e for e in events if e["session_id"] == "meeting"]) == 150
    records = out.table("records").to_table(columns=["session_id", "t_ns", "decision"]).to_pylist()
    inside = [r["decision"] for r in records if r["session_id"] == "stretch"
              and (DARK.start * FRAME_NS + 40 * MS) <= r["t_ns"] <= ((DARK.stop - 1) * FRAME_NS - 40 * MS)]
    assert inside and set(inside) == {"gap"}  # the aligner sees the dropped frames as gaps
    s1 = runs["s1"]
    assert s1["exit_code"] == 3 and s1["counts"]["quarantined"] == 1
    assert s1["counts"]["quality"] == {"warn": 0, "drop": len(DARK), "fail": 0}
    assert s1["quality"]["expectations"][0]["violations"] == len(DARK)
    lineage = {r["session_id"]: r["status"] for r in out.table("lineage_sources").to_table().to_pylist()}
    assert lineage == {"meeting": "ingested", "stretch": "partial"}
    assert runs["metrics"].value("modalign_quality_violations_total", modality="video", action="drop") == len(DARK)


def test_a_reference_of_the_darkened_video_raises_a_brightness_alarm(runs, capsys):
    out = modalign.open(runs["out1"])
    rows = out.table("monitor_quality").to_table().to_pylist()
    meeting = {r["property"]: r for r in rows if r["session_id"] == "meeting"}
    b = meeting["brightness_mean"]
    assert b["current_n"] == 150 and b["reference_n"] == 150 and b["reference"] == str(runs["out0"])
    assert b["reference_mean"] == pytest.approx(b["current_mean"] * 89 / 142, abs=1.5)
    assert b["alarm"] and b["psi"] > 1 and b["shift_sigmas"] > 3
    assert not meeting["width"]["alarm"] and not meeting["channels"]["alarm"]  # same resolution and format
    assert {r["session_id"] for r in rows} == {"meeting", "stretch", None}  # per session, and both together
    alarms = [a for a in out.table("monitor_alarms").to_table().to_pylist() if a["kind"] == "quality_shift"]
    assert ("video", "brightness_mean", "meeting") in {(a["modality"], a["property"], a["session_id"]) for a in alarms}
    mine = next(a for a in alarms if (a["property"], a["session_id"]) == ("brightness_mean", "meeting"))
    assert (mine["start_t_ns"], mine["end_t_ns"], mine["threshold"]) == (0, 149 * FRAME_NS, 0.25)
    assert mine["value"] == pytest.approx(b["psi"])
    s1 = runs["s1"]
    assert s1["counts"]["monitor_alarms"]["quality_shift"] == len(alarms) == s1["monitor"]["quality"]["alarms"]
    assert runs["metrics"].value("modalign_monitor_alarms", alarm="quality_shift") == len(alarms)
    assert runs["metrics"].value("modalign_quality_shift_alarms", modality="video") == len(alarms)
    # the reference run itself: summary rows, no reference, no alarm
    ref_rows = modalign.open(runs["out0"]).table("monitor_quality").to_table().to_pylist()
    assert ref_rows and all(r["reference"] is None and r["psi"] is None and not r["alarm"] for r in ref_rows)
    assert main(["inspect", str(runs["out1"])]) == 0
    text = capsys.readouterr().out
    assert f"{len(alarms)} shift alarm(s) against {runs['out0']}" in text
    assert "[quality_shift] video brightness_mean meeting: psi" in text


def test_an_identical_reference_raises_no_quality_alarm(runs):
    out = modalign.open(runs["out2"])
    rows = out.table("monitor_quality").to_table().to_pylist()
    assert rows and all(r["reference"] == str(runs["out1"]) for r in rows)
    assert not any(r["alarm"] for r in rows)
    both = {(r["property"], r["session_id"]): r for r in rows}
    assert both[("brightness_mean", None)]["psi"] == pytest.approx(0.0, abs=1e-9)  # the same events
    assert runs["s2"]["counts"]["monitor_alarms"]["quality_shift"] == 0
    assert not [a for a in (out.table("monitor_alarms").to_table().to_pylist() if out.files("monitor_alarms") else [])
                if a["kind"] == "quality_shift"]


def test_a_fail_expectation_stops_the_run_before_its_commit(runs, tmp_path, capsys):
    """``fail``: exit 1 with one message naming the source, the property, the value and the expectation;
    nothing of the run is committed."""
    import yaml

    root = runs["out1"].parent
    cfg = tmp_path / "fail.yaml"
    cfg.write_text(yaml.safe_dump({"key_store": str(root / "keys"), **FAST, "quality": {"expectations": [
        {"modality": "video", "property": "channels", "min": 3, "max": 3, "action": "fail"},
        {**DROP, "action": "fail"}]}}))
    out = tmp_path / "out"
    assert main(["run", str(root / "in" / "stretch"), "--out", str(out), "--config", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert "[quality_failed]" in err and str(root / "in" / "stretch" / "room.mp4") in err
    assert "source cam: brightness_mean = 6." in err and f"at session time {DARK.start * 0.04:.3f} s" in err
    assert "video brightness_mean in [16, inf] (quality.expectations[1], action fail)" in err
    assert "nothing of it was committed" in err
    with pytest.raises(modalign.schemas.errors.ConfigError, match="no commit"):
        modalign.open(out)
    # what the run wrote was swept (the feature cache is no table: it is kept for a re-run)
    assert not [p for p in out.rglob("*.parquet") if p.relative_to(out).parts[0] != "cache"]
