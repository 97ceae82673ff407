"""``modalign watch`` on a real local Ray: each session version committed exactly once.

Sessions are dropped into a watched folder while the watch runs (in this process, on the shared
Ray), a file still being written is left alone until it settles, at most one session is in
flight, a changed source replaces its session's old version, and a watch SIGKILLed in the middle
of a session (its own process and Ray) is restarted with ``--once`` and leaves the same tables as
a clean run: multisets of rows, 0 lost, 0 duplicated (the helpers of ``test_kill_recovery``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
from test_kill_recovery import _descendants, _diff, _on_disk_is_committed, _reap, _tables, _wait_for

import modalign
from clips import write_tone
from modalign.pipeline.commits import CommitLog
from modalign.pipeline.listing import LocalListing
from modalign.pipeline.runner import Runner
from modalign.pipeline.watch import STATUS_FILE, Watch, committed_versions
from modalign.schemas.config import RunConfig
from modalign.schemas.errors import OutputLockedError
from modalign.schemas.files import stat_version

pytestmark = pytest.mark.integration

SETTLE_S = 1.5


def _uri(p: Path) -> str:
    return p.resolve().as_uri()


def _at(iso: str) -> float:
    return datetime.strptime(iso, "%Y-%m-%dT%H:%M:%S.%f%z").timestamp()


def _wav_bytes(scratch: Path, seconds: float, hz: float) -> bytes:
    write_tone(scratch, seconds=seconds, hz=hz)
    return scratch.read_bytes()


def _new_sessions(out: Path) -> list[tuple[int, list[str]]]:
    """Per commit record: (version, the sessions that commit wrote)."""
    log = CommitLog.of(out)
    found = []
    for v in log.versions():
        snap = json.loads(log.store.get(log.records.key(v)))
        found.append((v, sorted(sid for sid, s in snap["sessions"].items() if s["run_id"] == snap["run_id"])))
    return found


@pytest.fixture(scope="module")
def watched(ray_local, tmp_path_factory):
    """A watch (settle 1.5 s, one session in flight) into which a file is written in pieces, then
    a settled file dropped; stopped (drained) while the second is in flight."""
    root = tmp_path_factory.mktemp("watch")
    inp, out = root / "in", root / "out"
    inp.mkdir()
    cfg = RunConfig(key_store=root / "keys")
    messages: list[str] = []
    watch = Watch(cfg, LocalListing(inp), out, interval_s=0.2, settle_s=SETTLE_S, max_in_flight=1,
                  progress=messages.append)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(watch.run()))
    thread.start()
    try:
        data = _wav_bytes(root / "tone.wav", 1.0, 660.0)
        writes = []
        with open(inp / "growing.wav", "wb") as f:  # written in pieces over ~1.2 s while the watch polls
            for i in range(0, len(data), len(data) // 6 + 1):
                f.write(data[i:i + len(data) // 6 + 1])
                f.flush()
                writes.append(time.time())
                time.sleep(0.2)
        write_tone(inp / "first.wav", seconds=1.0)
        os.utime(inp / "first.wav", (time.time() - 60, time.time() - 60))  # settled: ready at once
        _wait_for(lambda: watch.in_flight == ["first"], timeout=60, what="first in flight")
        with pytest.raises(OutputLockedError, match="being written by watch"):  # a run meanwhile is refused
            Runner(cfg, out).run(inp)
        _wait_for(lambda: watch.in_flight == ["growing"], timeout=120, what="growing in flight")
    finally:
        watch.stop()  # what SIGTERM does: the session in flight commits, then the watch ends
        thread.join(timeout=120)
    return inp, out, cfg, result, writes, messages


def test_dropped_sessions_are_committed_once_and_one_at_a_time(watched):
    inp, out, _cfg, status, writes, messages = watched
    assert status["state"] == "stopped" and status["exit_code"] == 0 and not status["in_flight"]
    # Every commit wrote exactly one session, and each session was committed once.
    assert [s for _v, s in _new_sessions(out)] == [["first"], ["growing"]]
    committed = committed_versions(out)
    for name in ("first", "growing"):  # the committed version is the file's final one
        assert committed[name] == {(_uri(inp / f"{name}.wav"), stat_version(inp / f"{name}.wav"))}
    records = modalign.open(out).table("records").to_table()
    assert sorted(set(records.column("session_id").to_pylist())) == ["first", "growing"]
    assert 24 <= records.num_rows / 2 <= 26  # 1 s at 25 ticks/s each: nothing twice

    on_disk = json.loads((out / STATUS_FILE).read_text())
    assert on_disk["state"] == "stopped" and on_disk["max_seen_in_flight"] == 1
    rec = {r["session_id"]: r for r in on_disk["recent"]}
    first, growing = rec["first"], rec["growing"]
    # The file being written was not picked before it had settled after its last write ...
    assert _at(growing["started_at"]) >= writes[-1] + SETTLE_S - 0.05  # mtime resolution
    assert _at(growing["ready_at"]) >= writes[-1] + SETTLE_S - 0.05
    # ... it was ready while `first` was in flight, and waited for it (backpressure).
    assert _at(growing["ready_at"]) < _at(first["committed_at"]) <= _at(growing["started_at"])
    assert growing["lag_s"] >= _at(first["committed_at"]) - _at(growing["ready_at"])
    assert on_disk["sessions_committed"] == 2 and on_disk["lag_s"]["p50"] > 0
    assert on_disk["throughput"]["recorded_s_per_busy_s"] > 0
    assert any("lag p50" in m for m in messages)


def test_the_watch_keeps_its_actors_warm_across_batches(watched):
    _inp, out, *_ = watched
    log = CommitLog.of(out)
    actors = [json.loads(log.store.get(log.records.key(v)))["summary"]["actors"] for v in log.versions()]
    assert len(actors) == 2 and set(actors[0]["pids"]) == {"ingest-0", "ingest-1", "embed-0"}
    assert actors[1]["pids"] == actors[0]["pids"]  # the second batch ran on the first's processes: no model load


def test_a_changed_source_replaces_its_session_and_the_rest_is_not_redone(watched):
    inp, out, cfg, _status, _writes, _messages = watched
    old = stat_version(inp / "first.wav")
    old_commits = _new_sessions(out)
    write_tone(inp / "first.wav", seconds=2.0, hz=880.0)  # new bytes: a new version of a known source
    new = stat_version(inp / "first.wav")
    status = Watch(cfg, LocalListing(inp), out, settle_s=0, once=True, progress=lambda _m: None).run()
    assert status["exit_code"] == 0 and status["sessions_committed"] == 1
    assert _new_sessions(out) == [*old_commits, (old_commits[-1][0] + 1, ["first"])]  # growing not redone
    assert committed_versions(out)["first"] == {(_uri(inp / "first.wav"), new)}
    output = modalign.open(out)
    for name in ("events_audio", "records", "features", "lineage_sources"):  # every row of the new version only
        t = output.table(name).to_table().to_pylist()
        mine = [r for r in t if r["session_id"] == "first"]
        assert mine and {r["source_version"] for r in mine} == {new}, name
    assert 49 <= sum(1 for r in output.table("records").to_table().to_pylist() if r["session_id"] == "first") <= 51
    # The old version stays traceable: its run's OpenLineage session event, and the commit record.
    events = [json.loads(p.read_text()) for p in sorted((out / "lineage" / "openlineage").glob("*.json"))]
    versions = [facet["datasetVersion"] for e in events if e["eventType"] == "COMPLETE"
                and e["job"]["name"].endswith(".session.first")
                for i in e["inputs"] for facet in [i["facets"]["version"]]]
    assert versions.count(old) >= 1 and versions.count(new) == 1
    assert old_commits[0][1] == ["first"] and CommitLog.of(out).versions()[0] == old_commits[0][0]

    # Restarted again with nothing changed: nothing is redone, nothing committed.
    again = Watch(cfg, LocalListing(inp), out, settle_s=0, once=True, progress=lambda _m: None).run()
    assert again["sessions_committed"] == 0 and again["sessions"]["committed"] == 2
    assert len(_new_sessions(out)) == len(old_commits) + 1


# Faces and text shown in frames kept (not detected): the slowest stages of the sample, and exactly-once
# does not depend on them; the clean run and the watch share the config.
FAST = {"runtime": {"num_cpus": 2, "ingest_actors": 1},
        "policy": {"face": {"action": "keep"}, "frame_text": {"action": "keep"}}}


def _watch_process(inp: Path, out: Path, keys: Path, *extra: str) -> subprocess.Popen:
    config = keys.parent / "watch-config.json"
    config.write_text(json.dumps(FAST))
    env = dict(os.environ, MODALIGN_KEY_STORE=str(keys), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "modalign.pipeline.cli", "watch", str(inp), "--out", str(out), "--config",
           str(config), "--settle", "0", "--interval", "0.2", *extra]
    log = keys.parent / f"watch-{time.monotonic_ns()}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=f, start_new_session=True)
    proc.log = log  # type: ignore[attr-defined]
    return proc


def test_sigkill_mid_session_then_once_commits_it_exactly_once(ray_local, tmp_path):
    from modalign.pipeline.sample import generate_sample

    inp = tmp_path / "in"
    generate_sample(inp / "meeting", duration_s=4.5, seed=0)  # `modalign sample`, as short as it makes
    keys = tmp_path / "keys"
    clean = tmp_path / "clean"
    Runner(RunConfig(key_store=keys, **FAST), clean, progress=lambda _m: None).run(inp)  # the same folder, batch
    expected = _tables(clean)

    out = tmp_path / "out"
    driver = _watch_process(inp, out, keys)
    _wait_for(lambda: (out / "events").is_dir() and any((out / "events").rglob("*.parquet")), timeout=300,
              what="the watch's first events part")
    kids = _descendants(driver.pid)
    driver.send_signal(signal.SIGKILL)
    driver.wait(timeout=30)
    _reap(driver, kids)
    assert any((out / "events").rglob("*.parquet")) and committed_versions(out) == {}  # written, not committed

    # Restarted with --once (in this process, on the shared Ray: one Ray start less).
    status = Watch(RunConfig(key_store=keys, **FAST), LocalListing(inp), out, settle_s=0, once=True,
                   progress=lambda _m: None).run()
    assert status["exit_code"] == 0 and status["sessions_committed"] == 1
    got = _tables(out)
    diffs = {name: _diff(expected[name], got[name]) for name in expected}
    assert all(d == (0, 0) for d in diffs.values()), {k: v for k, v in diffs.items() if v != (0, 0)}
    assert sum(sum(c.values()) for c in got.values()) > 0
    assert [s for _v, s in _new_sessions(out)] == [["sample-meeting"]]  # one commit, one session
    _on_disk_is_committed(out)  # the killed attempt's parts were swept
    status = json.loads((out / STATUS_FILE).read_text())
    assert status["sessions_committed"] == 1 and status["recent"][0]["session_id"] == "sample-meeting"
