"""Crash, kill and second-writer tests with real processes: OUT is only ever a whole commit.

Each test starts ``modalign run`` as its own process (its own local Ray), kills the driver,
the ingest actor or the aligner actor with SIGKILL at a point where the attempt has written
files, and compares every committed table with a clean run as multisets of rows (0 lost, 0
duplicated). A killed aligner is restarted and resumed from its checkpoint: the run completes. Columns that differ between two clean runs by design (the run id, the CTAL
trace id, processing latencies) are left out of the comparison and listed in ``VOLATILE``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest

import modalign
from clips import write_clip, write_tone
from modalign.pipeline.layout import TABLES, safe_name
from modalign.pipeline.runner import Runner
from modalign.schemas.config import RunConfig
from modalign.schemas.errors import OutputLockedError

pytestmark = pytest.mark.integration

VOLATILE = {"run_id", "trace_id", "latency_ms"}
SECONDS = 8.0


def _rows(out: Path | modalign.pipeline.outputs.Output, name: str, where=None) -> Counter:
    """The committed rows of one table as a multiset (volatile columns left out)."""
    t = (modalign.open(out) if isinstance(out, Path) else out).table(name).to_table()
    keep = [c for c in t.column_names if c not in VOLATILE]
    rows = [json.dumps(r, sort_keys=True, default=str) for r in t.select(keep).to_pylist()
            if where is None or where(r)]
    return Counter(rows)


def _diff(a: Counter, b: Counter) -> tuple[int, int]:
    """(rows of ``a`` missing from ``b``, rows of ``b`` beyond ``a``): lost, duplicated or new."""
    return sum((a - b).values()), sum((b - a).values())


def _tables(out: Path, where=None) -> dict[str, Counter]:
    """Every committed table of one commit (the folder is opened once)."""
    output = modalign.open(out)
    return {name: _rows(output, name, where) for name in TABLES}


@contextmanager
def _reading(out: Path, expected: dict[str, Counter]):
    """A user reading OUT in a loop meanwhile; yields (commit version, (lost, extra) per table) per read."""
    reads: list[tuple[int, dict]] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            try:
                version = modalign.open(out).version
                reads.append((version, {k: _diff(expected[k], v) for k, v in _tables(out).items()}))
            except FileNotFoundError:  # a commit's files removed under a reader that opened it: it re-opens
                continue

    t = threading.Thread(target=reader)
    t.start()
    try:
        yield reads
    finally:
        stop.set()
        t.join()


def _assert_same(expected: dict[str, Counter], out: Path, where=None) -> dict[str, tuple[int, int]]:
    got = _tables(out, where)
    diffs = {name: _diff(expected[name], got[name]) for name in TABLES}
    assert all(d == (0, 0) for d in diffs.values()), {k: v for k, v in diffs.items() if v != (0, 0)}
    return diffs


def _on_disk_is_committed(out: Path) -> None:
    """Between runs every data folder holds exactly the committed files."""
    snap = modalign.open(out).snapshot
    layout = modalign.open(out).layout
    on_disk = {p.relative_to(out).as_posix() for folder in layout.data_folders() if (out / folder).is_dir()
               for p in (out / folder).rglob("*") if p.is_file()}
    assert on_disk == snap.files()


@pytest.fixture(scope="module")
def session(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("kill-in")
    write_clip(d / "talk.mp4", seconds=SECONDS, sound=True)
    write_tone(d / "lapel.wav", seconds=SECONDS)
    (d / "manifest.yaml").write_text("session_id: kill\nsources:\n"
                                     "  - {id: talk, uri: talk.mp4, modality: video}\n"
                                     "  - {id: lapel, uri: lapel.wav, modality: audio}\n")
    return d / "manifest.yaml"


@pytest.fixture(scope="module")
def clean(session, tmp_path_factory) -> tuple[Path, dict[str, Counter]]:
    """A clean run's output and its committed tables."""
    root = tmp_path_factory.mktemp("kill-clean")
    out = root / "out"
    proc = _start(session, out, root / "keys")
    assert proc.wait(timeout=600) == 0, _stderr(proc)[-3000:]
    return out, _tables(out)


def _keys(clean: tuple[Path, dict[str, Counter]]) -> Path:
    """The clean run's key vault: outputs keyed by the tenant key (voice anonymisation) only compare under it."""
    return clean[0].parent / "keys"


def _start(inp: Path, out: Path, keys: Path, command: tuple[str, ...] = ("run",),
           **config_sections: dict) -> subprocess.Popen:
    """``modalign run`` (or ``command``: a watch) in a process of its own, with one ingest actor (so the
    kill hits a known source) unless ``config_sections`` say otherwise."""
    config = keys.parent / f"config-{time.monotonic_ns()}.json"
    config.write_text(json.dumps({"runtime": {"num_cpus": 2, "ingest_actors": 1}, **config_sections}))
    env = dict(os.environ, MODALIGN_KEY_STORE=str(keys), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "modalign.pipeline.cli", command[0], str(inp), "--out", str(out), "--config",
           str(config), "--json", *command[1:]]
    log = keys.parent / f"run-{time.monotonic_ns()}.log"  # a file, not a pipe: a full pipe would block the run
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=f, start_new_session=True)
    proc.log = log  # type: ignore[attr-defined]
    return proc


def _stderr(proc: subprocess.Popen) -> str:
    return proc.log.read_text()  # type: ignore[attr-defined]


def _new_parts(out: Path, old: set[str], folder: str = "events") -> list[Path]:
    return [p for p in (out / folder).rglob("*.parquet") if p.relative_to(out).as_posix() not in old]


def _wait_for(cond, timeout: float = 300, what: str = "") -> object:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _actor(driver: subprocess.Popen, name: str) -> int | None:
    """The pid of the run's Ray worker process that hosts actor ``name``."""
    return next((p for p in _descendants(driver.pid) if _cmdline(p).startswith(f"ray::{name}")), None)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(driver: subprocess.Popen, kids: list[int]) -> None:
    """Leave no process of a killed run behind (whatever Ray's own clean-up did)."""
    for p in kids:
        _kill(p)
    try:
        os.killpg(driver.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    driver.wait(timeout=30)


def _lease_holder(out: Path) -> int | None:
    """The pid of the live holder of OUT's lease (None: nobody holds it)."""
    from modalign.pipeline.lease import Lease
    from modalign.pipeline.store import LocalStore

    rec = Lease(LocalStore(out), "reader").current()
    return None if rec is None or rec.released else rec.pid


def _copy(out: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "out"
    shutil.copytree(out, dst)
    return dst


def test_sigkill_of_the_driver_mid_rerun_leaves_the_old_commit(clean, session, tmp_path):
    out0, expected = clean
    out = _copy(out0, tmp_path)
    old = modalign.open(out).snapshot.files()
    version = modalign.open(out).version
    driver = _start(session, out, _keys(clean))
    with _reading(out, expected) as reads:  # a user reading OUT while it is re-run and killed
        _wait_for(lambda: _new_parts(out, old), what="the re-run's first events part")
        kids = _descendants(driver.pid)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
    _reap(driver, kids)
    assert _new_parts(out, old)  # the killed attempt did write files: none of them is visible
    assert reads and all(v == version and all(d == (0, 0) for d in r.values()) for v, r in reads)
    _assert_same(expected, out)
    assert modalign.open(out).run == modalign.open(out0).run  # run.json's commit, not the dead attempt's

    # A second writer while a run holds the lease is refused, naming the holder; nothing is written.
    rerun = _start(session, out, _keys(clean))
    _wait_for(lambda: _lease_holder(out) == rerun.pid, what="the re-run's lease")
    with pytest.raises(OutputLockedError, match=f"being written by run .* \\(pid {rerun.pid} on "):
        Runner(RunConfig(key_store=_keys(clean)), out).run(session)
    with _reading(out, expected) as reads:  # across the commit and the removal of the old files
        assert rerun.wait(timeout=600) == 0, _stderr(rerun)[-3000:]
    assert {v for v, _ in reads} <= {version, version + 1} and modalign.open(out).version == version + 1
    assert reads and all(all(d == (0, 0) for d in r.values()) for _, r in reads)  # never a mix of the two
    _assert_same(expected, out)  # the crashed attempt's leftovers were swept, not committed
    _on_disk_is_committed(out)


def test_sigkill_of_the_aligner_mid_session_is_resumed_from_its_checkpoint(clean, session, tmp_path):
    """The aligner is killed after it has written timeline parts and a checkpoint, while the video
    still streams: Ray restarts it, the driver replays its log of calls (events re-read from their
    parts in OUT), and the run commits exactly the clean run's rows."""
    out0, expected = clean
    out = _copy(out0, tmp_path)
    checkpoints = out / "_modalign" / "checkpoints" / "align" / "kill"
    # Every source at once (the audio is one batch each, the video streams on), 0.5 s parts.
    driver = _start(session, out, _keys(clean), runtime={"num_cpus": 4, "ingest_actors": 3}, align={"part_s": 0.5})
    _wait_for(lambda: checkpoints.is_dir() and any(checkpoints.iterdir()), what="the aligner's first checkpoint")
    _kill(_wait_for(lambda: _actor(driver, "AlignerActor"), what="the aligner actor"))
    rc = driver.wait(timeout=600)
    stderr = _stderr(driver)
    assert rc == 0, stderr[-3000:]
    resumed = re.search(r"resumed from its checkpoint after (\d+) part\(s\), (\d+) event part\(s\) re-read", stderr)
    assert resumed and int(resumed[1]) >= 1, stderr[-3000:]
    _assert_same(expected, out)  # every table: 0 rows lost, 0 duplicated
    records = [f for f in modalign.open(out).snapshot.files() if f.startswith("records/kill/")]
    assert len(records) >= 2  # the timeline was committed in parts
    _on_disk_is_committed(out)  # the checkpoint and the old commit's files are gone


def test_sigkill_of_the_ingest_actor_cuts_one_source_short_and_retries_the_rest(clean, session, tmp_path):
    out0, expected = clean
    out = tmp_path / "out"  # a fresh OUT: the killed run's own commit is compared with the clean one
    driver = _start(session, out, _keys(clean))
    _wait_for(lambda: (out / "events" / "video").is_dir() and _new_parts(out, set(), "events/video"),
              what="the video's first events part")
    _kill(_wait_for(lambda: _actor(driver, "IngestActor"), what="the ingest actor"))
    rc = driver.wait(timeout=600)
    stderr = _stderr(driver)
    assert rc == 3, stderr[-3000:]  # completed, with one source quarantined
    (q,) = modalign.open(out).table("quarantine").to_table().to_pylist()
    assert q["source_id"] == "talk" and q["reason_code"] == "worker_failed" and "died" in q["message"]
    assert q["start_t_ns"] is not None and q["end_t_ns"] >= SECONDS * 1e9 * 0.95  # the missing range

    def other(r: dict) -> bool:
        return r.get("source_id") not in ("talk",)

    # The queued sources were retried on the restarted actor: every one of their rows, exactly once.
    for name in ("events_audio", "features"):
        assert _diff(_rows(out0, name, other), _rows(out, name, other)) == (0, 0), name
    # The cut-short video kept its first events, none twice, and its missing time is gaps.
    talk = lambda r: r.get("source_id") == "talk"  # noqa: E731
    kept, full = _rows(out, "events_video", talk), _rows(out0, "events_video", talk)
    assert 0 < sum(kept.values()) < sum(full.values()) and not (kept - full)
    records = modalign.open(out).table("records").to_table().to_pylist()
    clean_ticks = modalign.open(out0).table("records").to_table().num_rows
    assert len(records) == clean_ticks  # the timeline still spans the whole recording
    last = max(q["start_t_ns"], 0)
    talk_after = [r for r in records if r["source_id"] == "talk" and r["t_ns"] > last + 200_000_000]
    assert talk_after and all(r["decision"] == "gap" for r in talk_after)
    ctal_gaps = [r for r in modalign.open(out).table("ctal").to_table().to_pylist()
                 if r["decision"] == "gap" and "talk" in r["reason"]]
    assert len(ctal_gaps) >= len(talk_after)
    summary = {r["source_id"]: r for r in modalign.open(out).table("ctal_summary").to_table().to_pylist()}
    assert summary["talk"]["gaps"] >= len(talk_after)

    # The next run re-ingests it: the same output as a clean run.
    rerun = _start(session, out, _keys(clean))
    assert rerun.wait(timeout=600) == 0, _stderr(rerun)[-3000:]
    _assert_same(expected, out)
    _on_disk_is_committed(out)


def test_a_watch_redoes_a_session_cut_short_by_a_dying_ingest_actor_and_exits_clean(clean, session, tmp_path):
    """The watch commits the cut-short session (its quarantine row says so), redoes it whole on the
    restarted actor, and exits 0: the accepted commit holds no quarantine row any more."""
    out0, expected = clean
    out = tmp_path / "out"
    watch = _start(session.parent, out, _keys(clean), command=("watch", "--once", "--settle", "0", "--interval", "1"))
    _wait_for(lambda: (out / "events" / "video").is_dir() and _new_parts(out, set(), "events/video"),
              what="the video's first events part")
    _kill(_wait_for(lambda: _actor(watch, "IngestActor"), what="the ingest actor"))
    rc = watch.wait(timeout=600)
    stderr = _stderr(watch)
    assert "session kill was cut short by a dying worker (attempt 1 of 3); it is redone" in stderr, stderr[-3000:]
    assert rc == 0, stderr[-3000:]
    assert modalign.open(out).table("quarantine").to_table().num_rows == 0
    _assert_same(expected, out)
    _on_disk_is_committed(out)


def test_a_rerun_drops_rows_of_sources_that_are_gone_or_shorter(ray_local, clean, session, tmp_path):
    out0, _ = clean
    out = _copy(out0, tmp_path)
    inp = tmp_path / "in"
    shutil.copytree(session.parent, inp)
    (inp / "lapel.wav").unlink()
    (inp / "manifest.yaml").write_text("session_id: kill\nsources:\n  - {id: talk, uri: talk.mp4, modality: video}\n")
    write_clip(inp / "talk.mp4", seconds=2.0, sound=True)
    inp = inp / "manifest.yaml"
    fresh = tmp_path / "fresh"
    Runner(RunConfig(key_store=tmp_path / "keys"), fresh, progress=lambda _m: None).run(inp)
    Runner(RunConfig(key_store=tmp_path / "keys"), out, progress=lambda _m: None).run(inp)
    assert _tables(out) == _tables(fresh)  # as if the old sources had never been there
    features = modalign.open(out).table("features").to_table()
    assert "lapel" not in set(features.column("source_id").to_pylist())
    per_index = Counter((safe_name(r["model_id"]), r["granularity"])
                        for r in features.select(["model_id", "granularity"]).to_pylist())
    indexes = modalign.open(out).run["indexes"]  # the FAISS vectors too
    assert indexes and {(ix["model_id"], ix["granularity"]): ix["vectors"] for ix in indexes} == per_index
    _on_disk_is_committed(out)


def _dying_ingest_actor(marker: Path):
    """A real ingest actor that dies once, right after yielding a payload's EmbedItem and before
    its table (a moment a SIGKILL from outside hits only by chance): the driver's ref to the table
    then holds the actor's death, and the embed call it is forwarded to fails with it."""
    import ray

    from modalign.pipeline.actors import IngestActor
    from modalign.pipeline.items import EmbedItem

    @ray.remote(max_restarts=2, max_task_retries=0)
    class DiesBeforeATable(IngestActor.__ray_metadata__.modified_class):
        def ingest(self, job):
            for item in super().ingest(job):
                yield item
                if isinstance(item, EmbedItem) and item.rows and not marker.exists():
                    marker.touch()
                    time.sleep(0.5)  # the item reaches the driver, which then waits for the table
                    os._exit(1)

    return DiesBeforeATable


def test_an_ingest_actor_dying_between_an_item_and_its_table_cuts_the_source_short(ray_local, clean, session,
                                                                                   tmp_path, monkeypatch):
    """Not the embed actor's death (the run would stop as the machine's fault): the source it came
    from is cut short, and the next source runs whole on the restarted actor."""
    from modalign.pipeline import actors
    from modalign.pipeline.runner import EXIT_QUARANTINED

    out0, _ = clean
    marker = tmp_path / "died"
    monkeypatch.setattr(actors, "IngestActor", _dying_ingest_actor(marker))
    out = tmp_path / "out"
    config = RunConfig(key_store=_keys(clean), runtime={"num_cpus": 2, "ingest_actors": 1})
    summary = Runner(config, out, progress=lambda msg: None).run(session)
    assert marker.exists() and summary["exit_code"] == EXIT_QUARANTINED
    (q,) = modalign.open(out).table("quarantine").to_table().to_pylist()
    assert q["reason_code"] == "worker_failed" and "ingest worker died" in q["message"], q
    cut = q["source_id"]
    lineage = {r["source_id"]: r["status"] for r in modalign.open(out).table("lineage_sources").to_table().to_pylist()}
    assert lineage.pop(cut) == "partial" and set(lineage.values()) == {"ingested"}, lineage

    def other(r: dict) -> bool:
        return r.get("source_id") != cut

    for name in ("events_video", "events_audio", "features"):  # the other source: every row, exactly once
        assert _diff(_rows(out0, name, other), _rows(out, name, other)) == (0, 0), name
    kept = _rows(out, f"events_{'video' if cut == 'talk' else 'audio'}", lambda r: not other(r))
    assert sum(kept.values()) > 0  # the events before the death are kept
