"""The store, the commit log and the lease on object storage (pipeline/objstore.py), against a
real S3 server: SeaweedFS ``weed mini`` (tests/s3server.py), one per test session. No Ray.

Where a test needs a fault the server would not produce (a throttled request, a reset
connection, a lost response, a server that ignores ``If-None-Match``), it is injected at the
botocore layer with botocore's event hooks on that one store's client; the server stays real
and serves every other request.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest
from s3server import s3_server, use_aws_env

from modalign.pipeline.commits import CommitLog
from modalign.pipeline.lease import Lease, LeaseRecord
from modalign.pipeline.objstore import Location, S3Options, S3Store, open_store, s3_filesystem
from modalign.pipeline.store import LocalStore
from modalign.schemas.errors import ConfigError, EnvironmentFaultError, OutputLockedError

pytestmark = pytest.mark.integration

FAST = S3Options(max_attempts=3, connect_timeout_s=1.0, read_timeout_s=10.0)


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("s3")) as server:
        yield server


@pytest.fixture
def aws_env(s3, monkeypatch):
    """The server through the standard AWS variables only (endpoint, credentials, region)."""
    return use_aws_env(monkeypatch, s3)


@pytest.fixture
def out(aws_env) -> str:
    """A fresh OUT prefix in the server's bucket."""
    return f"s3://{aws_env.bucket}/runs/{uuid.uuid4().hex[:12]}"


def _store(out: str, options: S3Options = FAST) -> S3Store:
    return S3Store(Location.parse(out), options)


def _count(store: S3Store, event: str) -> list[str]:
    """The names of the operations that reached ``event`` (one per HTTP attempt for before-send)."""
    seen: list[str] = []
    store.client.meta.events.register(event, lambda **kw: seen.append(kw.get("event_name", "")))
    return seen


# -- locations ---------------------------------------------------------------------------------
def test_a_location_is_a_bucket_prefix_or_a_folder(tmp_path):
    loc = Location.parse("s3://rec-2026/incoming/day1/")
    assert (loc.bucket, loc.prefix, loc.uri, loc.is_s3) == ("rec-2026", "incoming/day1", "s3://rec-2026/incoming/day1",
                                                            True)
    assert loc.key("_modalign/commits") == "incoming/day1/_modalign/commits"
    assert loc.arrow_path("a.parquet") == "rec-2026/incoming/day1/a.parquet"
    root = Location.parse("s3://rec-2026")
    assert root.key("a/b") == "a/b" and root.uri == "s3://rec-2026"
    assert Location.parse(str(tmp_path)).path == tmp_path and not Location.parse(tmp_path).is_s3
    assert Location.parse(f"file://{tmp_path}").path == tmp_path
    assert isinstance(open_store(tmp_path), LocalStore)
    with pytest.raises(ConfigError, match="'in' is not a valid S3 bucket name"):
        Location.parse("s3://in/x")
    with pytest.raises(ConfigError, match="unsupported location scheme gs://"):
        Location.parse("gs://bucket/x")
    with pytest.raises(ConfigError, match="'..' segment"):
        Location.parse("s3://bucket/a/../b")


# -- the store operations ------------------------------------------------------------------------
def test_put_get_list_delete_on_s3(out):
    store = open_store(out)
    assert isinstance(store, S3Store) and store.root == out and not store.local
    assert store.get("nothing/here.json") is None  # a 404 is None, not an error
    store.put("d/a.json", b"one")
    store.put("d/a.json", b"two")
    store.put("d/b.json", b"b")
    store.put("d/sub/deep.json", b"x")  # not a direct child
    store.put("d/.hidden.tmp", b"x")
    assert store.get("d/a.json") == b"two"
    assert store.list("d") == ["d/a.json", "d/b.json"] and store.list("nowhere") == []
    store.delete("d/a.json")
    store.delete("d/a.json")  # deleting what is gone is fine
    assert store.get("d/a.json") is None and store.list("d") == ["d/b.json"]
    raw = aws_keys(store)
    assert f"{store.location.prefix}/d/b.json" in raw and not [k for k in raw if "_modalign/probe" in k]


def aws_keys(store: S3Store) -> list[str]:
    return [o["Key"] for o in store.client.list_objects_v2(Bucket=store.bucket,
                                                           Prefix=store.location.prefix).get("Contents", [])]


def test_list_reads_every_page(out):
    store = _store(out, S3Options(page_size=3))
    for i in range(10):
        store.put(f"many/k{i:02d}.json", str(i).encode())
    store.put("many/sub/x.json", b"x")
    calls = _count(store, "before-call.s3.ListObjectsV2")
    assert store.list("many") == [f"many/k{i:02d}.json" for i in range(10)]
    assert len(calls) >= 4  # 10 keys and a sub-prefix, 3 per page


def test_create_if_absent_one_of_racing_writers_wins(out):
    """Six writers (each its own client, as separate processes would be) race for one key.
    SeaweedFS makes the losers wait for the winner's write (up to seconds), then answers 412."""
    stores = [_store(out) for _ in range(6)]
    for s in stores:
        s.ensure_conditional_writes()  # the one-off probe, so the race is only the create
    start = threading.Barrier(len(stores))
    wins: dict[int, bool] = {}

    def write(i: int) -> None:
        start.wait()
        wins[i] = stores[i].create("race/k.json", f"writer {i}".encode())

    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, won in wins.items() if won]
    assert len(winners) == 1, wins
    assert stores[0].get("race/k.json") == f"writer {winners[0]}".encode()
    assert not stores[1].create("race/k.json", b"late")  # later writers too


def test_a_store_that_ignores_if_none_match_is_refused(out):
    """The server honours If-None-Match; the header is removed from this client's PUTs before
    signing, which is what a store that ignores it amounts to."""
    store = _store(out)
    def drop_condition(request, **kw):
        if "If-None-Match" in request.headers:
            del request.headers["If-None-Match"]

    store.client.meta.events.register("before-sign.s3.PutObject", drop_condition)
    with pytest.raises(EnvironmentFaultError, match=rf"object store at {store.endpoint} \(bucket {store.bucket}\) "
                                                    r"ignores conditional writes"):
        store.create("_modalign/commits/v1.json", b"{}")
    assert store.get("_modalign/commits/v1.json") is None and store.list("_modalign/probe") == []
    with pytest.raises(EnvironmentFaultError, match="ignores conditional writes"):
        CommitLog(store).commit(None, run_id="r", sessions={}, shared=[], summary={})
    assert CommitLog(store).latest() is None


def test_a_create_whose_response_was_lost_is_still_the_writers(out):
    """The PUT succeeds on the server; botocore is told to retry it as if its response had been
    lost, so the retry meets the object with 412: the store reads it back and finds its own bytes."""
    store = _store(out)
    store.ensure_conditional_writes()
    retried: list[int] = []

    def lose_first_response(attempts, response, **kw):
        if not retried and response is not None and response[0].status_code == 200:
            retried.append(attempts)
            return 0  # retry at once
        return None

    store.client.meta.events.register_first("needs-retry.s3.PutObject", lose_first_response)
    assert store.create("lost/k.json", b"mine") and retried == [1]
    assert store.get("lost/k.json") == b"mine"
    assert not store.create("lost/k.json", b"someone else")  # a 412 without a retry: it exists


# -- retries and faults --------------------------------------------------------------------------
class _Raw:
    def __init__(self, body: bytes) -> None:
        self._body = io.BytesIO(body)

    def stream(self, **kw):
        yield self._body.read()


def test_transient_errors_are_retried(out):
    """The first PUT is answered 503 SlowDown and the first GET's connection is reset, both
    injected in botocore's before-send hook (no request reaches the server); the retries do."""
    from botocore.awsrequest import AWSResponse
    from botocore.exceptions import ConnectionClosedError

    store = _store(out)
    sends = _count(store, "before-send.s3")
    faults: list[str] = []

    def fault(request, event_name, **kw):
        op = event_name.rsplit(".", 1)[-1]
        if op == "PutObject" and "PutObject" not in faults:
            faults.append(op)
            body = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
            return AWSResponse(request.url, 503, {"Content-Type": "application/xml"}, _Raw(body))
        if op == "GetObject" and "GetObject" not in faults:
            faults.append(op)
            raise ConnectionClosedError(endpoint_url=request.url)
        return None

    store.client.meta.events.register("before-send.s3", fault)
    store.put("t/k.json", b"payload")
    assert store.get("t/k.json") == b"payload"
    assert faults == ["PutObject", "GetObject"]
    assert [s.rsplit(".", 1)[-1] for s in sends] == ["PutObject", "PutObject", "GetObject", "GetObject"]


def test_permanent_errors_are_not_retried_and_say_what_to_fix(aws_env, monkeypatch):
    missing = _store(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/out")
    sends = _count(missing, "before-send.s3")
    with pytest.raises(EnvironmentFaultError, match=rf"bucket {missing.bucket} does not exist at "
                                                    rf"{aws_env.endpoint}") as err:
        missing.get("_modalign/commits/v1.json")
    assert err.value.code == "environment_fault" and len(sends) == 1

    wrong = "wrong-" + uuid.uuid4().hex
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    refused = _store(f"s3://{aws_env.bucket}/out")
    sends = _count(refused, "before-send.s3")
    with pytest.raises(EnvironmentFaultError, match=r"credentials were refused \(SignatureDoesNotMatch\)") as err:
        refused.list("_modalign/commits")
    assert len(sends) == 1
    text = str(err.value)
    assert aws_env.bucket in text and aws_env.endpoint in text
    assert wrong not in text and aws_env.secret_key not in text


def test_an_unreachable_endpoint_is_an_environment_fault_naming_it(aws_env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    endpoint = f"http://127.0.0.1:{port}"
    store = _store(f"s3://{aws_env.bucket}/out", S3Options(endpoint_url=endpoint, max_attempts=2,
                                                           connect_timeout_s=0.5))
    t0 = time.monotonic()
    with pytest.raises(EnvironmentFaultError, match=rf"cannot reach the object store at {endpoint} \(bucket "):
        CommitLog(store).latest()
    assert time.monotonic() - t0 < 5


# -- the commit log and the lease on S3 ---------------------------------------------------------
def test_commit_log_on_s3(out):
    log = CommitLog.of(out)
    assert log.latest() is None and log.versions() == []
    v1 = log.commit(None, run_id="r1", sessions={"a": {"run_id": "r1", "files": ["records/a/r1.parquet"]}},
                    shared=[], summary={"run_id": "r1"})
    v2 = log.commit(v1, run_id="r2", sessions={"b": {"run_id": "r2", "files": ["records/b/r2.parquet"]}},
                    shared=["index/m__frame-r2.faiss"], summary={"run_id": "r2"})
    again = CommitLog.of(out)  # another process's view
    assert again.versions() == [1, 2] and again.latest() == v2
    assert again.latest().files() == {"records/a/r1.parquet", "records/b/r2.parquet", "index/m__frame-r2.faiss"}

    results: dict[str, object] = {}
    start = threading.Barrier(2)

    def commit(run_id: str) -> None:
        log_ = CommitLog(_store(out))
        log_.store.ensure_conditional_writes()
        start.wait()
        try:
            results[run_id] = log_.commit(v2, run_id=run_id, sessions={}, shared=[], summary={"run_id": run_id})
        except OutputLockedError as exc:
            results[run_id] = exc

    threads = [threading.Thread(target=commit, args=(r,)) for r in ("w1", "w2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    locked = [r for r, v in results.items() if isinstance(v, OutputLockedError)]
    assert len(locked) == 1 and "committed version 3 of " + out in str(results[locked[0]])
    winner = next(r for r in results if r not in locked)
    assert CommitLog.of(out).latest().run_id == winner and CommitLog.of(out).versions() == [1, 2, 3]


def test_a_lease_on_s3_refuses_a_second_holder_and_is_taken_over_after_its_ttl(out):
    first = Lease(_store(out), "a" * 32, ttl_s=1.0).acquire()
    with pytest.raises(OutputLockedError, match=rf"{out} is being written by run aaaaaaaaaaaa \(pid {os.getpid()} "
                                                rf"on {socket.gethostname()}\)"):
        Lease(_store(out), "b" * 32).acquire()
    time.sleep(1.2)  # no heartbeat (acquire without the context manager): the ttl runs out
    second = Lease(_store(out), "b" * 32).acquire()
    assert second.record.generation == 2 and second.took_over.run_id == "a" * 32
    with pytest.raises(OutputLockedError, match="lost the lease .* to run bbbbbbbbbbbb"):
        first.check()
    second.release()
    assert [k.rsplit("/", 1)[1] for k in second.store.list("_modalign/lease/out")] == [f"g{2:020d}.json"]


def test_on_s3_a_dead_pid_on_this_host_does_not_free_a_lease(out):
    """Pids are not shared between the machines of an object store (every pod has a pid 1), so
    only the heartbeat's age frees a lease there; a local folder still checks the pid."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    now = time.time()
    rec = LeaseRecord(generation=1, run_id="f" * 32, host=socket.gethostname(), pid=dead.pid, acquired_at=now,
                      heartbeat_at=now, ttl_s=30.0)
    store = _store(out)
    assert store.create("_modalign/lease/out/g00000000000000000001.json", json.dumps(rec.__dict__).encode())
    with pytest.raises(OutputLockedError, match=rf"by run ffffffffffff \(pid {dead.pid} "):
        Lease(store, "b" * 32).acquire()
    assert rec.stale(now) and not rec.stale(now, check_pid=False)


def test_the_heartbeat_keeps_an_s3_lease_alive_past_its_ttl(out):
    with Lease(_store(out), "a" * 32, ttl_s=1.0) as lease:
        time.sleep(1.5)
        assert time.time() - lease.current().heartbeat_at < 1.0
        with pytest.raises(OutputLockedError, match="being written by run aaaaaaaaaaaa"):
            Lease(_store(out), "b" * 32).acquire()
    with Lease(_store(out), "b" * 32) as after:  # released on exit: taken at once
        assert after.record.generation == 2 and after.took_over is None


# -- pyarrow on the same location ------------------------------------------------------------------
def test_s3_filesystem_reads_and_writes_the_stores_objects(out):
    import pyarrow as pa
    import pyarrow.parquet as pq

    loc = Location.parse(out)
    fs = s3_filesystem(loc, FAST)  # endpoint from AWS_ENDPOINT_URL, which pyarrow itself ignores
    table = pa.table({"t_ns": pa.array([0, 40_000_000, 80_000_000], pa.int64()), "text": ["a", "b", "c"]})
    pq.write_table(table, loc.arrow_path("records/s/part-0.parquet"), filesystem=fs)
    store = open_store(loc)
    assert store.list("records/s") == ["records/s/part-0.parquet"]
    assert pq.read_table(pa.BufferReader(store.get("records/s/part-0.parquet"))).equals(table)
    store.put("sources/clip.bin", b"\x00\x01" * 1000)
    with fs.open_input_stream(loc.arrow_path("sources/clip.bin")) as f:
        assert f.read() == b"\x00\x01" * 1000


def test_the_server_fixture_leaves_no_process(tmp_path):
    with s3_server(tmp_path, bucket="fixture-check") as server:
        assert server.client().head_bucket(Bucket="fixture-check")["ResponseMetadata"]["HTTPStatusCode"] == 200
        pgid = os.getpgid(server.pid)
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


def test_parallel_calls_of_a_store_are_bounded(out):
    store = _store(out, S3Options(max_concurrency=2))
    store.put("p/k.json", b"k")
    lock, inflight, peak = threading.Lock(), [0], [0]

    def enter(**kw):
        with lock:
            inflight[0] += 1
            peak[0] = max(peak[0], inflight[0])
        time.sleep(0.02)  # hold the slot long enough for the others to pile up

    def leave(**kw):
        with lock:
            inflight[0] -= 1

    store.client.meta.events.register("before-call.s3", enter)
    store.client.meta.events.register("after-call.s3", leave)
    got: list[bytes | None] = []
    threads = [threading.Thread(target=lambda: got.append(store.get("p/k.json"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [b"k"] * 8 and peak[0] == 2
