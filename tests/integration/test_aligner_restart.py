"""The driver and a real aligner actor: a killed aligner is resumed from its checkpoint and the
driver's log of calls (same rows as a writer that never died); one Ray cannot restart any more
fails the run at the next call, not at the end. And the timeline writer on a real S3 OUT."""

from __future__ import annotations

import json
import os
import re
import signal
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from modalign.pipeline.discovery import discover
from modalign.pipeline.layout import OutputLayout
from modalign.pipeline.runner import Runner, _SessionState
from modalign.pipeline.timeline import TimelineWriter
from modalign.schemas.config import RunConfig
from modalign.schemas.errors import EnvironmentFaultError
from modalign.schemas.manifest import ClockMapping
from modalign.schemas.tables import MfccRow, VideoFrameRow

pytestmark = pytest.mark.integration

MS = 1_000_000
SOURCES = {"cam": ("video", VideoFrameRow), "mic": ("audio", MfccRow)}


def _session(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    for name in ("cam.mp4", "mic.wav"):
        (d / name).write_bytes(b"\0" * 64)  # never ingested here: the aligner gets its events directly
    (d / "m.yaml").write_text("session_id: s\nsources:\n  - {id: cam, uri: cam.mp4, modality: video}\n"
                              "  - {id: mic, uri: mic.wav, modality: audio}\n")
    (session,) = discover(d)
    return session


def _parts(seconds: int = 12) -> list[tuple[str, pa.Table]]:
    rnd = np.random.default_rng(3)
    out = []
    for sec in range(seconds):
        t = np.arange(sec * 1000, (sec + 1) * 1000, 40) * MS + rnd.integers(-5 * MS, 5 * MS, 25)
        out.append(("cam", pa.table({"event_id": [f"cam/{sec}/{i}" for i in range(25)], "t_ns": t})))
        t = np.arange(sec * 1000, (sec + 1) * 1000, 10) * MS
        keep = ~((t > 6_000 * MS) & (t < 6_400 * MS))  # a dropout: gaps in records and CTAL
        out.append(("mic", pa.table({"event_id": [f"mic/{sec}/{i}" for i in np.flatnonzero(keep)], "t_ns": t[keep]})))
    return out


def _lineage(sid: str) -> dict:
    return dict(session_id="s", source_id=sid, source_uri=f"file:///{sid}", source_version="v", operators="o@1",
                policy="p@1", model_id=None)


def _rows(layout: OutputLayout, files: list[str]) -> dict[str, Counter]:
    out: dict[str, Counter] = {}
    for f in files:
        path = layout.path(f)
        rows = ([json.loads(x) for x in path.read_text().splitlines()] if f.endswith(".jsonl")
                else pq.read_table(path).to_pylist())
        c = out.setdefault(f.split("/s/")[0], Counter())
        c.update(json.dumps({k: v for k, v in r.items() if k != "latency_ms"}, sort_keys=True, default=str)
                 for r in rows)
    return out


def _drive(runner: Runner, st: _SessionState, layout: OutputLayout, kill_at: int | None = None) -> None:
    """The driver's calls for the session, as ``Runner._route`` makes them; SIGKILL after ``kill_at`` parts."""
    import ray

    refs = [runner._align(st, ("register", sid, mod, _lineage(sid), ClockMapping())) for sid, (mod, _) in SOURCES.items()]
    seq = dict.fromkeys(SOURCES, 0)
    for i, (sid, table) in enumerate(_parts()):
        path = layout.events(SOURCES[sid][1], "s", sid, runner.attempt, seq[sid])
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path)
        refs.append(runner._align(st, ("add", sid, seq[sid], layout.relative(path), 1.0), table))
        seq[sid] += 1
        if i == kill_at:
            ray.get(refs)  # what it was sent so far has been consumed (and parts written)
            assert any(layout.align_checkpoint("s", runner.attempt).parent.iterdir())
            os.kill(ray.get(st.aligner.pid.remote()), signal.SIGKILL)
        if len(refs) > 4:
            runner._collect(st, refs[:-4])
            refs = refs[-4:]
    refs += [runner._align(st, ("finish_source", sid, None)) for sid in SOURCES]
    runner._collect(st, refs)


def test_a_killed_aligner_is_resumed_and_a_dead_one_fails_at_once(ray_local, tmp_path):
    from modalign.pipeline.actors import AlignerActor

    session = _session(tmp_path)
    config = RunConfig.model_validate({"key_store": str(tmp_path / "keys"), "align": {"part_s": 1.0}})
    said: list[str] = []
    runner = Runner(config, tmp_path / "out", progress=said.append)
    layout = runner.layout
    st = _SessionState(session, aligner=AlignerActor.options(num_cpus=0).remote(
        "s", config.model_dump_json(), str(runner.out), runner.attempt, list(SOURCES)))
    _drive(runner, st, layout, kill_at=13)
    got = runner._finish_aligner(st)
    (resumed,) = [m for m in said if "resumed" in m]  # once, however many calls failed
    parts, replayed = map(int, re.search(r"after (\d+) part\(s\), (\d+) event part", resumed).groups())
    assert parts >= 1 and replayed >= 1  # from the checkpoint, plus what it had consumed since

    clean_layout = OutputLayout(tmp_path / "clean")
    clean = TimelineWriter("s", config, clean_layout, runner.attempt, list(SOURCES))  # same attempt: same trace id
    for sid, (mod, _) in SOURCES.items():
        clean.register(sid, mod, _lineage(sid), ClockMapping())
    seq = dict.fromkeys(SOURCES, 0)
    for sid, table in _parts():
        clean.add(sid, table, 1.0, seq[sid])
        seq[sid] += 1
    for sid in SOURCES:
        clean.finish_source(sid)
    expected = clean.finish()
    assert got["ticks"] == expected["ticks"] == 300 and got["gaps"] == expected["gaps"] > 0
    assert len([f for f in got["files"] if f.startswith("records/")]) >= 5
    assert _rows(layout, got["files"]) == _rows(clean_layout, expected["files"])  # 0 lost, 0 duplicated

    # Restarts used up (none allowed here): the next collected call fails the run, naming the aligner.
    runner2 = Runner(config, tmp_path / "out2", progress=said.append)
    st2 = _SessionState(session, aligner=AlignerActor.options(num_cpus=0, max_restarts=0).remote(
        "s", config.model_dump_json(), str(runner2.out), runner2.attempt, list(SOURCES)))
    ref = runner2._align(st2, ("register", "cam", "video", _lineage("cam"), ClockMapping()))
    runner2._collect(st2, [ref])
    os.kill(ray_local.get(st2.aligner.pid.remote()), signal.SIGKILL)
    ref = runner2._align(st2, ("register", "mic", "audio", _lineage("mic"), ClockMapping()))
    with pytest.raises(EnvironmentFaultError, match="the aligner of session s died and cannot be restarted"):
        runner2._collect(st2, [ref])


def test_parts_and_checkpoint_on_an_s3_out_resume_to_the_same_rows(tmp_path, monkeypatch):
    """The same writer over a real S3 store (SeaweedFS): parts and the checkpoint are objects, a
    restarted writer reads the checkpoint and re-reads event parts from the store, and the sweep
    of the commit removes the checkpoint."""
    import uuid

    from s3server import s3_server, use_aws_env

    from modalign.pipeline.commits import sweep

    config = RunConfig.model_validate({"align": {"part_s": 1.0}})
    with s3_server(tmp_path / "s3") as s3:
        use_aws_env(monkeypatch, s3)
        layout = OutputLayout.of(f"s3://{s3.bucket}/tl-{uuid.uuid4().hex[:8]}")
        log, events = [("register", sid, mod, _lineage(sid), ClockMapping()) for sid, (mod, _) in SOURCES.items()], []
        seq = dict.fromkeys(SOURCES, 0)
        for sid, table in _parts():
            path = layout.events(SOURCES[sid][1], "s", sid, "0123456789ab", seq[sid])
            layout.write_table(path, table)
            events.append(layout.relative(path))
            log.append(("add", sid, seq[sid], layout.relative(path), 1.0, table))
            seq[sid] += 1
        log += [("finish_source", sid, None) for sid in SOURCES]

        def call(w, entry):
            kind, sid, *args = entry
            return w.add(sid, args[3], args[2], args[0]) if kind == "add" else getattr(w, kind)(sid, *args)

        first = TimelineWriter("s", config, layout, "0123456789ab", list(SOURCES))
        for entry in log[:15]:
            call(first, entry)
        assert first.parts >= 2 and layout.exists(first.checkpoint_path)
        second = TimelineWriter("s", config, layout, "0123456789ab", list(SOURCES), restarted=True)
        assert second.restored_parts == first.parts
        info = second.resume([e[:5] if e[0] == "add" else e for e in log[:15]])
        assert info["replayed_parts"] >= 1
        for entry in log[15:]:
            call(second, entry)
        got = second.finish()

        local = OutputLayout(tmp_path / "local")
        clean = TimelineWriter("s", config, local, "0123456789ab", list(SOURCES))
        for entry in log:
            call(clean, entry)
        expected = clean.finish()
        assert got["files"] == expected["files"]
        for f in expected["files"]:
            data = layout.read_bytes(layout.path(f))
            if f.endswith(".jsonl"):
                assert data == local.path(f).read_bytes(), f
            else:
                assert pq.read_table(pa.BufferReader(data)).equals(pq.read_table(local.path(f))), f

        assert sweep(layout.store, set(got["files"]) | set(events), layout.data_folders()) == 1
        assert not layout.exists(second.checkpoint_path)
