"""The commit log, the lease and the store under them (pipeline/commits.py, lease.py, store.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from modalign.pipeline.commits import CommitLog, sweep
from modalign.pipeline.lease import Lease, LeaseRecord
from modalign.pipeline.store import LocalStore
from modalign.schemas.errors import OutputLockedError


def test_create_writes_only_if_absent_and_one_of_racing_writers_wins(tmp_path):
    store = LocalStore(tmp_path)
    assert store.create("a/k.json", b"first") and not store.create("a/k.json", b"second")
    assert store.get("a/k.json") == b"first"
    wins = []
    threads = [threading.Thread(target=lambda i=i: wins.append(store.create("race.json", str(i).encode())))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wins.count(True) == 1 and store.get("race.json").decode() in {str(i) for i in range(8)}
    assert store.list("a") == ["a/k.json"]  # no temporary file is left or listed
    assert not [p for p in tmp_path.rglob(".*")]


def test_a_commit_replaces_its_sessions_and_carries_the_others(tmp_path):
    log = CommitLog.of(tmp_path)
    assert log.latest() is None
    v1 = log.commit(None, run_id="r1", sessions={"a": {"run_id": "r1", "files": ["records/a/r1.parquet"]},
                                                 "b": {"run_id": "r1", "files": ["records/b/r1.parquet"]}},
                    shared=["index/m__frame-r1.faiss"], summary={"run_id": "r1"})
    v2 = log.commit(v1, run_id="r2", sessions={"a": {"run_id": "r2", "files": ["records/a/r2.parquet"]}},
                    shared=[], summary={"run_id": "r2"})
    latest = log.latest()
    assert (latest.version, latest.summary) == (2, {"run_id": "r2"}) and latest == v2
    assert latest.files() == {"records/a/r2.parquet", "records/b/r1.parquet"}
    assert latest.under("records") == ["records/a/r2.parquet", "records/b/r1.parquet"]
    with pytest.raises(OutputLockedError, match="committed version 2"):  # a writer that did not see v2
        log.commit(v1, run_id="r3", sessions={}, shared=[], summary={})
    assert log.latest() == v2


def test_a_commit_records_the_sha256_of_its_new_files_and_carries_the_parents(tmp_path):
    import hashlib

    for name, data in (("records/a/r1.parquet", b"a1"), ("records/b/r1.parquet", b"b1"), ("records/a/r2.parquet", b"a2")):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    log = CommitLog.of(tmp_path)
    v1 = log.commit(None, run_id="r1", sessions={"a": {"run_id": "r1", "files": ["records/a/r1.parquet"]},
                                                 "b": {"run_id": "r1", "files": ["records/b/r1.parquet"]}},
                    shared=[], summary={})
    sha = {n: "sha256:" + hashlib.sha256(d).hexdigest() for n, d in
           (("records/a/r1.parquet", b"a1"), ("records/b/r1.parquet", b"b1"), ("records/a/r2.parquet", b"a2"))}
    assert v1.digests == {k: sha[k] for k in ("records/a/r1.parquet", "records/b/r1.parquet")}
    (tmp_path / "records/b/r1.parquet").write_bytes(b"changed after its commit")  # carried: not re-read
    v2 = log.commit(v1, run_id="r2", sessions={"a": {"run_id": "r2", "files": ["records/a/r2.parquet"]}},
                    shared=[], summary={})
    assert log.latest().digests == v2.digests == {k: sha[k] for k in ("records/a/r2.parquet", "records/b/r1.parquet")}


def test_only_the_last_records_are_kept(tmp_path):
    log = CommitLog.of(tmp_path)
    snap = None
    for i in range(25):
        snap = log.commit(snap, run_id=f"r{i}", sessions={}, shared=[], summary={})
    assert log.versions() == list(range(6, 26)) and log.latest().version == 25


def test_sweep_removes_only_uncommitted_files_of_ours(tmp_path):
    keep = {"records/s/aaaa.parquet", "index/m__frame-aaaa.faiss"}
    mine = ["records/s/bbbb.parquet", "records/s/.bbbb.parquet.0123.tmp", "ctal/jsonl/s/bbbb.jsonl",
            "index/m__frame-bbbb.faiss"]
    users = ["records/notes.txt", "elsewhere/x.parquet"]
    for rel in [*keep, *mine, *users]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x")
    assert sweep(tmp_path, keep, ["records", "ctal/jsonl", "index"]) == len(mine)
    assert all((tmp_path / r).exists() for r in [*keep, *users]) and not any((tmp_path / r).exists() for r in mine)
    assert not (tmp_path / "ctal" / "jsonl").exists()  # emptied folders go


def _record(store: LocalStore, **kw) -> None:
    rec = dict(generation=1, run_id="f" * 32, host="other-host", pid=1, acquired_at=time.time(),
               heartbeat_at=time.time(), ttl_s=30.0, released=False)
    rec.update(kw)
    store.create(f"_modalign/lease/out/g{rec['generation']:020d}.json", json.dumps(rec).encode())


def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    store = LocalStore(tmp_path)
    with Lease(store, "a" * 32):
        with pytest.raises(OutputLockedError, match=r"being written by run aaaaaaaaaaaa \(pid \d+ on .*heartbeat"):
            Lease(store, "b" * 32).acquire()
    with Lease(store, "b" * 32) as second:  # released: the next writer gets it, with a new generation
        assert second.record.generation == 2 and second.took_over is None


def test_the_refusal_names_what_holds_the_lease_and_a_record_with_newer_fields_still_reads(tmp_path):
    store = LocalStore(tmp_path)
    with Lease(store, "c" * 32, writer="watch"):
        with pytest.raises(OutputLockedError, match=r"being written by watch cccccccccccc \(pid \d+ on "):
            Lease(store, "d" * 32).acquire()
    _record(store, generation=2, run_id="e" * 32, host=socket.gethostname(), pid=os.getpid(), writer="erasure",
            added_by_a_later_version=True)
    with pytest.raises(OutputLockedError, match=r"being written by erasure eeeeeeeeeeee "):
        Lease(store, "f" * 32).acquire()


def test_a_release_the_full_disk_prevents_does_not_hide_the_error_that_ended_the_run(tmp_path, monkeypatch):
    """OUT fills up mid-run: the run's own EnvironmentFaultError is what leaves the ``with``, not
    the OSError of the lease's release (which the full disk makes fail too); the record stays
    live until its ttl. Without an error in flight, a failed release is an EnvironmentFaultError
    naming the lease."""
    from modalign.schemas.errors import EnvironmentFaultError

    def full(*_a, **_k):
        raise OSError(28, "No space left on device")

    store = LocalStore(tmp_path)
    with pytest.raises(EnvironmentFaultError, match="cannot write the events"):
        with Lease(store, "a" * 32, ttl_s=30):
            monkeypatch.setattr(store, "put", full)
            raise EnvironmentFaultError("cannot write the events (No space left on device)")
    monkeypatch.undo()
    assert not LeaseRecord(**json.loads(store.get(Lease(store, "x" * 32)._key(1)))).released
    with pytest.raises(OutputLockedError):  # still held: this process lives and its ttl has not passed
        Lease(store, "b" * 32).acquire()
    other = LocalStore(tmp_path / "other")
    with pytest.raises(EnvironmentFaultError, match=r"cannot release the lease of 'out' .*No space left"):
        with Lease(other, "b" * 32):
            monkeypatch.setattr(other, "put", full)


def test_a_live_remote_holder_blocks_and_a_stale_one_is_taken_over(tmp_path):
    store = LocalStore(tmp_path)
    _record(store, generation=1)
    with pytest.raises(OutputLockedError, match="on other-host"):
        Lease(store, "b" * 32).acquire()
    _record(store, generation=2, heartbeat_at=time.time() - 31)  # its heartbeat stopped a ttl ago
    lease = Lease(store, "b" * 32).acquire()
    assert lease.record.generation == 3 and lease.took_over.host == "other-host"
    assert [k.rsplit("/", 1)[1] for k in store.list("_modalign/lease/out")] == [f"g{3:020d}.json"]


def test_a_holder_on_this_host_whose_process_died_is_taken_over_at_once(tmp_path):
    import socket

    store = LocalStore(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _record(store, host=socket.gethostname(), pid=dead.pid)
    lease = Lease(store, "b" * 32).acquire()
    assert lease.took_over.pid == dead.pid


def test_a_holder_that_was_taken_over_learns_it_and_cannot_commit(tmp_path):
    store = LocalStore(tmp_path)
    old = Lease(store, "a" * 32, ttl_s=2).acquire()
    old.check()
    stale = LeaseRecord(**{**json.loads(store.get(old._key(1))), "heartbeat_at": time.time() - 10})
    store.put(old._key(1), json.dumps(stale.__dict__).encode())  # as if its process had paused for 10 s
    new = Lease(store, "b" * 32).acquire()
    with pytest.raises(OutputLockedError, match="lost the lease .* to run bbbbbbbbbbbb"):
        old.check()
    with pytest.raises(OutputLockedError):
        old.heartbeat()
    old.release()  # does not touch the new holder's record
    new.check()


def test_the_heartbeat_keeps_a_lease_alive_past_its_ttl(tmp_path):
    store = LocalStore(tmp_path)
    with Lease(store, "a" * 32, ttl_s=2.0) as lease:
        time.sleep(3.0)
        rec = lease.current()
        assert rec.run_id == "a" * 32 and time.time() - rec.heartbeat_at < 2.0
        with pytest.raises(OutputLockedError):
            Lease(store, "b" * 32).acquire()


def test_a_commit_of_a_newer_format_is_refused_not_misread(tmp_path):
    from modalign.schemas.errors import ConfigError

    LocalStore(tmp_path).create("_modalign/commits/v00000000000000000001.json",
                                json.dumps({"format": 99, "version": 1}).encode())
    with pytest.raises(ConfigError, match="newer modalign \\(format 99"):
        CommitLog.of(tmp_path).latest()


def test_a_lease_can_wait_for_its_holder_to_release_it(tmp_path):
    store = LocalStore(tmp_path)
    holder = Lease(store, "a" * 32).__enter__()
    with pytest.raises(OutputLockedError, match="being written by"):
        Lease(store, "b" * 32).acquire()  # wait_s 0: refused at once
    threading.Timer(0.5, holder.release).start()
    told = []
    waiter = Lease(store, "c" * 32, wait_s=30, on_wait=told.append)
    t = time.monotonic()
    with waiter:
        assert waiter.record.run_id == "c" * 32 and 0.4 < time.monotonic() - t < 10
    assert told and "being written by" in told[0].message
    cancel = threading.Event()
    with Lease(store, "d" * 32):
        threading.Timer(0.3, cancel.set).start()
        with pytest.raises(OutputLockedError):  # a stop request ends the wait
            Lease(store, "e" * 32, wait_s=30, cancel=cancel).acquire()


def test_a_released_lease_says_whether_out_was_left_swept(tmp_path):
    """A writer that released after its own sweep lets the next one skip the walk of OUT; a
    holder that died (never released) or released without sweeping does not."""
    store = LocalStore(tmp_path)
    with Lease(store, "a" * 32) as first:
        assert first.swept is False  # nobody held OUT before
        first.swept = True  # its sweep is done
    with Lease(store, "b" * 32) as second:
        assert second.swept is True
        second.swept = False  # it starts writing ...
    with Lease(store, "c" * 32) as third:  # ... and released without having swept
        assert third.swept is False
        third.swept = True
    dead = Lease(store, "d" * 32).acquire()  # holds it, then "dies": never released
    dead.swept = True
    taker = Lease(store, "e" * 32, ttl_s=0.01)
    time.sleep(0.05)
    rec = dead.current()
    store.put(dead._key(rec.generation), json.dumps({**rec.__dict__, "heartbeat_at": 0.0}).encode())
    with taker:
        assert taker.took_over is not None and taker.swept is False
