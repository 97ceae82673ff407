"""``modalign run`` with OUT on object storage: a real SeaweedFS (tests/s3server.py), real Ray.

One shared run (module scope): a subprocess (its own local Ray, started by the runner, with
the AWS credentials in its environment and the endpoint in the config's ``storage`` section
only, so the workers get it from the config JSON) runs the same local INPUT three times: into
``s3://BUCKET/runs/out``, into a local folder, and into the S3 prefix again. Its working
directory and TMPDIR are private, so "nothing is written to a local OUT" can be checked.
A subprocess because the workers of the shared test Ray (``ray_local``) were started before
the server existed and would not see its credentials.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest
from clips import write_clip, write_tone
from s3server import s3_server, use_aws_env

import modalign
from modalign.pipeline.commits import CommitLog
from modalign.pipeline.layout import OutputLayout, attempt_of
from modalign.pipeline.runner import EXIT_QUARANTINED, Runner
from modalign.schemas.config import RunConfig
from modalign.schemas.errors import EnvironmentFaultError

pytestmark = pytest.mark.integration

VOLATILE = {"run_id", "trace_id", "latency_ms"}  # differ between two clean runs by design
OURS = (".parquet", ".faiss", ".jsonl")

SCRIPT = r"""
import json, sys
from dataclasses import replace
from pathlib import Path
from modalign.pipeline.objstore import Location, S3Options, S3Store
from modalign.pipeline.runner import Runner
from modalign.schemas.config import RunConfig

cfg_file, input_dir, s3_out, local_out, result = sys.argv[1:6]
cfg = RunConfig.model_validate_json(Path(cfg_file).read_text())
store = S3Store(Location.parse(s3_out), S3Options.from_config(cfg.storage))
res = {"progress": [], "listings": [], "summaries": []}
for out in (s3_out, local_out, s3_out):
    res["summaries"].append(Runner(cfg, out, progress=res["progress"].append).run(Path(input_dir)))
    if out == s3_out:
        res["listings"].append(store.walk(""))
Path(result).write_text(json.dumps(res, default=str))
"""


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("s3")) as server:
        yield server


@pytest.fixture
def aws(s3, monkeypatch):
    """The server's credentials through the standard AWS variables (the endpoint: per test)."""
    return use_aws_env(monkeypatch, s3)


@pytest.fixture(scope="module")
def runs(s3, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("s3-output")
    inp = root / "in"
    (inp / "meet").mkdir(parents=True)
    write_clip(inp / "meet" / "clip.mp4", seconds=1.0)  # video + its sound track
    write_tone(inp / "meet" / "tone.wav", seconds=1.0)
    (inp / "meet" / "manifest.yaml").write_text(
        "session_id: meet\nsubjects: [subject-0001]\nsources:\n  - {id: cam, uri: clip.mp4, modality: video}\n"
        "  - {id: mic, uri: tone.wav, modality: audio}\n")
    write_tone(inp / "solo.wav", seconds=0.5, hz=330.0)  # a lone file: a session of its own
    (inp / "empty.mp4").write_bytes(b"")  # quarantined
    cfg = RunConfig.model_validate({"key_store": str(root / "keys"), "storage": {"endpoint_url": s3.endpoint}})
    (root / "cfg.json").write_text(cfg.model_dump_json())
    cwd, tmp = root / "cwd", root / "tmpdir"
    cwd.mkdir()
    tmp.mkdir()
    ray_tmp = Path(tempfile.mkdtemp(prefix="ms3", dir="/tmp"))  # Ray's socket paths must stay short
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID=s3.access_key, AWS_SECRET_ACCESS_KEY=s3.secret_key, AWS_REGION="us-east-1",
               AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull, TMPDIR=str(tmp),
               RAY_TMPDIR=str(ray_tmp), PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    s3_out, local_out = f"s3://{s3.bucket}/runs/out", root / "local-out"
    try:
        proc = subprocess.run([sys.executable, "-c", SCRIPT, str(root / "cfg.json"), str(inp), s3_out,
                               str(local_out), str(root / "result.json")], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    res = json.loads((root / "result.json").read_text())
    return {**res, "root": root, "input": inp, "cwd": cwd, "tmpdir": tmp, "s3_out": s3_out, "local_out": local_out,
            "cfg": cfg}


def rows(table: pa.Table) -> list[tuple]:
    """A table's rows without the run-specific columns, as a sorted list (a multiset)."""
    keep = [c for c in table.column_names if c not in VOLATILE]
    return sorted((repr(r) for r in table.select(keep).to_pylist()))


def test_the_s3_out_holds_the_same_tables_as_a_local_out(runs, aws):
    s3o, local = modalign.open(runs["s3_out"]), modalign.open(runs["local_out"])
    assert s3o.uri == runs["s3_out"] and s3o.filesystem is not None
    assert s3o.tables() == local.tables()
    for name in ("events_video", "events_audio", "records", "ctal_summary", "features", "quarantine",
                 "lineage_sources"):
        assert name in s3o.tables(), name
    for name in s3o.tables():
        a, b = s3o.table(name).to_table(), local.table(name).to_table()
        assert a.num_rows > 0 and a.schema == b.schema, name
        assert rows(a) == rows(b), name
    q = s3o.table("quarantine").to_table().to_pylist()
    assert [(Path(r["source_uri"]).name, r["reason_code"]) for r in q] == [("empty.mp4", "file_empty")]
    assert runs["summaries"][0]["exit_code"] == runs["summaries"][1]["exit_code"] == EXIT_QUARANTINED

    # the commit lists the same paths relative to OUT, up to the attempt in each name
    def names(out, summary) -> set[str]:
        return {f.replace(attempt_of(summary["run_id"]), "ATTEMPT") for f in CommitLog.of(out).latest().files()}

    assert names(runs["s3_out"], runs["summaries"][2]) == names(runs["local_out"], runs["summaries"][1])

    # FAISS indexes built from the committed feature objects, written as objects: same ids and vectors
    from modalign.operators.cache.index import FeatureIndex

    indexes = runs["summaries"][2]["indexes"]
    assert {(ix["model_id"], ix["granularity"]) for ix in indexes} == \
        {(ix["model_id"], ix["granularity"]) for ix in runs["summaries"][1]["indexes"]}
    layout = OutputLayout.of(runs["s3_out"])
    for ix in indexes:
        remote = FeatureIndex.from_bytes(layout.read_bytes(layout.path(ix["path"])))
        mine = FeatureIndex.load(local.root / next(i["path"] for i in runs["summaries"][1]["indexes"]
                                                   if i["granularity"] == ix["granularity"]
                                                   and i["model_id"] == ix["model_id"]))
        assert sorted(remote.ids()) == sorted(mine.ids()) and len(remote) == ix["vectors"] > 0
        for fid in remote.ids()[:3]:
            assert (remote.reconstruct(int(fid)) == mine.reconstruct(int(fid))).all()


def test_nothing_is_written_to_a_local_path_and_the_cache_is_said_to_be_off(runs):
    assert list(runs["cwd"].iterdir()) == []  # no "s3:" folder, no cache folder, nothing
    written = [p for p in runs["tmpdir"].rglob("*") if p.is_file() and p.name.endswith(OURS + (".json",))]
    assert written == []
    said = [m for m in runs["progress"] if m.startswith("feature cache:")]
    assert len(said) == 2 and "s3://" in said[0]  # the two S3 runs, not the local one
    assert (runs["local_out"] / "cache").is_dir()  # the local run keeps its cache, as before


def test_a_rerun_replaces_the_commit_and_sweeps_the_old_objects(runs, aws):
    first, second = runs["listings"]
    log = CommitLog.of(runs["s3_out"])
    assert log.versions() == [1, 2]
    snap = log.latest()
    assert snap.run_id == runs["summaries"][2]["run_id"]

    def expected(listing: list[str], files: set[str]) -> set[str]:
        events = {k for k in listing if k.startswith("lineage/openlineage/")}  # append-only, by design
        records = {k for k in listing if k.startswith("_modalign/")}
        assert set(listing) == files | events | records | {"run.json"}
        assert {k.rsplit("/", 1)[0] for k in records} <= {"_modalign/commits", "_modalign/lease/out"}
        return events

    v1 = json.loads(OutputLayout.of(runs["s3_out"]).read_bytes(OutputLayout.of(runs["s3_out"]).path(
        "_modalign/commits/v00000000000000000001.json")))
    v1_files = {f for s in v1["sessions"].values() for f in s["files"]} | set(v1["shared"])
    events_before = expected(first, v1_files)
    events_after = expected(second, snap.files())
    assert not v1_files & snap.files() and not v1_files & set(second)  # every old object is gone
    assert len(events_after) == 2 * len(events_before) > 0  # each run's START/COMPLETE events
    assert all(attempt_of(snap.run_id) in f for f in snap.files())
    run_json = json.loads(OutputLayout.of(runs["s3_out"]).read_bytes(OutputLayout.of(runs["s3_out"]).path("run.json")))
    assert run_json["run_id"] == snap.run_id == modalign.open(runs["s3_out"]).run["run_id"]
    ev = json.loads(OutputLayout.of(runs["s3_out"]).read_bytes(
        OutputLayout.of(runs["s3_out"]).path(sorted(events_after)[-1])))
    assert ev["eventType"] == "COMPLETE" and any(o["namespace"] == f"s3://{aws.bucket}" for o in ev["outputs"])


def test_inspect_and_the_watch_read_an_s3_out(runs, aws):
    from modalign.pipeline.inspect import collect
    from modalign.pipeline.watch import STATUS_FILE, Watch, committed_versions, local_listing

    s3_info, local_info = collect(runs["s3_out"]), collect(runs["local_out"])
    assert s3_info["tables"] == local_info["tables"] and s3_info["tables"]["records"] > 0
    assert s3_info["residuals"] == local_info["residuals"] and len(s3_info["quarantine"]) == 1

    versions = committed_versions(runs["s3_out"])
    assert versions == committed_versions(runs["local_out"]) and set(versions) == {"meet", "solo", "empty"}
    # a watch of the same INPUT into the S3 OUT: lease and status object there, nothing pending (no Ray)
    cfg = runs["cfg"]
    status = Watch(cfg, local_listing(runs["input"], runs["s3_out"]), runs["s3_out"], settle_s=0, once=True,
                   progress=lambda _m: None).run()
    assert status["sessions_committed"] == 0 and status["exit_code"] == 0
    assert status["sessions"]["discovered"] == 3 and not status["sessions"].get("ready")
    layout = OutputLayout.of(runs["s3_out"])
    kept = json.loads(layout.read_bytes(layout.path(STATUS_FILE)))
    assert kept["state"] == "stopped" and kept["out"] == runs["s3_out"] and kept["watch_id"] == status["watch_id"]
    leases = [k for k in layout.store.walk("_modalign/lease/out")]
    record = json.loads(layout.store.get(leases[-1]))
    assert record["writer"] == "watch" and record["released"]


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("fault", ["unreachable", "no_bucket"])
def test_an_unusable_store_fails_before_any_work_naming_it(aws, tmp_path, fault):
    write_tone(tmp_path / "tone.wav", seconds=0.5)
    endpoint = f"http://127.0.0.1:{_closed_port()}" if fault == "unreachable" else aws.endpoint
    bucket = aws.bucket if fault == "unreachable" else "no-such-bucket-here"
    cfg = RunConfig.model_validate({"key_store": str(tmp_path / "keys"), "storage": {
        "endpoint_url": endpoint, "max_attempts": 1, "connect_timeout_s": 1}})
    with pytest.raises(EnvironmentFaultError) as err:
        Runner(cfg, f"s3://{bucket}/out", progress=lambda _m: None).run(tmp_path)
    assert endpoint in err.value.message and bucket in err.value.message
    assert ("reach" in err.value.message) if fault == "unreachable" else ("does not exist" in err.value.message)
    assert not (tmp_path / "keys").exists()  # the key store is made after the check: no work began
    assert aws.secret_key not in err.value.message


def _same(runs, result: dict) -> str:
    """``result`` as JSON with what differs between the two OUTs by design replaced: OUT itself, the
    run ids and attempts in names, commit versions and times, the feature cache (none on S3)."""
    text = json.dumps(result, sort_keys=True, default=str)
    for out in (runs["s3_out"], str(runs["local_out"])):
        text = text.replace(out, "OUT")
    for summary in runs["summaries"]:
        text = text.replace(summary["run_id"], "RUN").replace(attempt_of(summary["run_id"]), "ATTEMPT")
    doc = json.loads(text)

    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()
                    if k not in {"segment", "commit", "content_from", "committed_at", "cache"}}
        return [clean(v) for v in x] if isinstance(x, list) else x

    return json.dumps(clean(doc), sort_keys=True)


def test_lineage_trace_access_and_search_answer_the_same_on_s3(runs, aws):
    from modalign.pipeline.lineage import access, trace
    from modalign.pipeline.search import search

    s3o = modalign.open(runs["s3_out"])
    feature = s3o.table("features").to_table(columns=["feature_id", "event_id"]).to_pylist()[0]
    records = s3o.files("records")[0]
    for text in (str(feature["feature_id"]), feature["event_id"], "meet:3",
                 s3o.layout.relative(records), f"s3://{records}"):
        remote = trace(runs["s3_out"], text)
        local = trace(runs["local_out"], text.replace(f"s3://{s3o.root}/", "").replace(
            attempt_of(runs["summaries"][2]["run_id"]), attempt_of(runs["summaries"][1]["run_id"])))
        assert remote["origins"] and remote["out"] == runs["s3_out"]
        assert _same(runs, remote) == _same(runs, local), text

    remote, local = access(runs["s3_out"], "subject-0001"), access(runs["local_out"], "subject-0001")
    assert {(s["session_id"], s["source_id"]) for s in remote["sources"]} >= {("meet", "cam"), ("meet", "mic")}
    assert remote["features"] and _same(runs, remote) == _same(runs, local)
    named = {f["cache_key"] for f in remote["features"]}  # what the rows name; no segment holds them on S3
    assert {e["cache_key"] for e in remote["cache"]} == named and all(e["segment"] is None for e in remote["cache"])
    assert access(runs["s3_out"], "subject-0009")["sources"] == []

    hits = search(runs["s3_out"], record=feature["event_id"], k=2)
    assert hits[0]["event_id"] == feature["event_id"] and hits[0]["score"] > 0.999
    assert [h["feature_id"] for h in hits] == [h["feature_id"] for h in search(runs["local_out"],
                                                                              record=feature["event_id"], k=2)]


def test_erasure_and_cache_gc_are_refused_on_s3_naming_why(runs, aws):
    from modalign.pipeline.cache_admin import cache_gc, cache_stats
    from modalign.pipeline.erasure import erase
    from modalign.schemas.errors import ConfigError

    for call in (lambda: erase(runs["s3_out"], subject="subject-0001"), lambda: cache_gc(runs["s3_out"]),
                 lambda: cache_stats(runs["s3_out"])):
        with pytest.raises(ConfigError, match="not supported on an s3:// OUT yet"):
            call()
    assert CommitLog.of(runs["s3_out"]).versions() == [1, 2]  # nothing was written


def test_open_takes_the_endpoint_from_a_storage_section(runs, aws, monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    out = modalign.open(runs["s3_out"], {"endpoint_url": aws.endpoint})
    assert out.version == 2 and out.table("records").count_rows() == modalign.open(runs["local_out"]).table(
        "records").count_rows() > 0


def test_the_denylist_of_an_s3_out_is_read_from_the_store(aws, tmp_path):
    """What a run into an S3 OUT refuses: the committed denylist objects, keyed with the key store's key."""
    import uuid

    from modalign.pipeline.commits import Snapshot
    from modalign.pipeline.erasure import DENYLIST, DENYLIST_KEY, Denylist, ErasureKeys, key_id, keyed

    key = ErasureKeys(tmp_path / "keys").get(DENYLIST_KEY, create=True)
    layout = OutputLayout.of(f"s3://{aws.bucket}/deny/{uuid.uuid4().hex[:8]}")
    rel = f"{DENYLIST}/abcdef012345.json"
    layout.write_json(layout.path(rel), {"format": 1, "entries": [
        {"kind": "subject", "key": keyed(key, "subject", "subject-0042"), "key_id": key_id(key),
         "erasure_id": "e" * 32, "erased_at": "2026-12-01T00:00:00Z"}]})
    snap = Snapshot(version=1, run_id="r" * 32, committed_at="2026-12-01T00:00:00Z", shared=(rel,))
    deny = Denylist.load(layout, snap, tmp_path / "keys")
    assert "erased" in deny.refusal("file:///in/a.wav", "v1", None, ["subject-0042"])
    assert deny.refusal("file:///in/a.wav", "v1", None, ["subject-0001"]) is None
    assert Denylist.load(layout, replace(snap, shared=()), tmp_path / "keys").entries == ()
