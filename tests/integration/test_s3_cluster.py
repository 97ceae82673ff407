"""Batch and streaming on a two-node Ray cluster whose INPUT and OUT exist only on S3 (issue 13).

One module fixture starts a real SeaweedFS (``tests/s3server.py``) and a two-node Ray cluster
on this machine (``ray.cluster_utils.Cluster``: a head of 1 CPU and a worker node of 2, each
with its own temp folder, on loopback). The cluster's raylets, and so every worker, get the
AWS variables; the CLI processes get them too and the endpoint through the config. No path is
shared: sources are read from the bucket by the workers, outputs are written there by them,
and the CLI processes run in empty working and temp folders that stay empty.

The chaos part: ``modalign watch s3://BUCKET/live --out s3://BUCKET/stream`` joins the cluster
while the test uploads three sessions over time; about every 10 s an actor process of the
pipeline is SIGKILLed (aligner, ingest and embed in turn, until each kind was killed once), and once, after the first commit, the
watch driver itself (its process group: the cluster lives on, as a RayCluster does when a
watch pod dies), which is then started again. At the end a clean ``modalign run`` of the same
prefix on the same cluster commits the reference, and every table of the watch's OUT must
equal it as a multiset of rows: 0 lost, 0 duplicated.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from s3server import s3_server
from test_kill_recovery import _descendants, _diff, _rows

import modalign
from modalign.pipeline.layout import TABLES
from modalign.pipeline.watch import committed_versions
from modalign.schemas.config import StorageConfig

pytestmark = pytest.mark.integration

SESSIONS = ("standup", "review", "retro")
# The aligner first: a session's aligner lives only while that session runs, the ingest and embed
# actors for the watch's whole life (its warm pool), so they can still be killed after the last commit.
ACTORS = ("AlignerActor", "IngestActor", "EmbedActor")
KILL_EVERY_S = (8.0, 12.0)
DEADLINE_S = 720  # the whole chaos phase: a guard against a hang, not a timing (the issue asks for under 5 minutes
#                   on a quiet machine; it takes about 3 there, and twice that on a loaded CI machine)
# Faces and text shown in frames kept (not detected): the slowest stages, and exactly-once does
# not depend on them (tests/integration/test_watch.py uses the same).
POLICY = {"face": {"action": "keep"}, "frame_text": {"action": "keep"}}


@contextmanager
def _environ(env: dict[str, str]):
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _upload(client, bucket: str, folder: Path, prefix: str, session_id: str) -> None:
    """One session's files under ``prefix``: the media first, the manifest (renamed session) last."""
    for f in sorted(folder.iterdir(), key=lambda p: p.name == "manifest.yaml"):
        body = f.read_bytes()
        if f.name == "manifest.yaml":
            body = body.replace(b"session_id: sample-meeting", f"session_id: {session_id}".encode())
            assert f"session_id: {session_id}".encode() in body
        client.put_object(Bucket=bucket, Key=f"{prefix}/{session_id}/{f.name}", Body=body)


def _actor_logs(node_dir: Path) -> set[str]:
    """The pipeline actors whose workers ran on one node (its workers' own log files)."""
    found = set()
    for f in node_dir.glob("session_*/logs/worker-*.out"):
        text = f.read_text(errors="replace")
        found |= {name for name in ACTORS if f":actor_name:{name}" in text}
    return found


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from ray.cluster_utils import Cluster

    root = tmp_path_factory.mktemp("s3-cluster")
    ray_dir = Path(tempfile.mkdtemp(prefix="mcl", dir="/tmp"))  # Ray's socket paths must stay short
    with s3_server(root / "s3") as s3:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RAY_ADDRESS"))}
        env.update(AWS_ACCESS_KEY_ID=s3.access_key, AWS_SECRET_ACCESS_KEY=s3.secret_key, AWS_REGION="us-east-1",
                   AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull)
        with _environ(env):  # the raylets, and the workers they start, take this environment
            c = Cluster(initialize_head=True, head_node_args=dict(
                num_cpus=1, temp_dir=str(ray_dir / "head"), include_dashboard=False, node_ip_address="127.0.0.1"))
            c.add_node(num_cpus=2, temp_dir=str(ray_dir / "worker"), node_ip_address="127.0.0.1")
            c.wait_for_nodes()
        try:
            raylets = [p.process.pid for node in c.list_all_nodes()
                       for p in node.all_processes.get("raylet", [])]
            config = root / "config.json"
            config.write_text(json.dumps({"key_store": str(root / "keys"), "storage": {"endpoint_url": s3.endpoint},
                                          "runtime": {"ingest_actors": 2}, "policy": POLICY,
                                          # small windows: the monitor's tables are compared too
                                          "monitor": {"embedding": {"window": 4, "reference_windows": 2}}}))
            yield {"s3": s3, "address": c.address, "env": env, "config": config, "root": root, "raylets": raylets,
                   "nodes": {"head": ray_dir / "head", "worker": ray_dir / "worker"}}
        finally:
            c.shutdown()
            shutil.rmtree(ray_dir, ignore_errors=True)


def _cli(cluster: dict, name: str, *args: str) -> subprocess.Popen:
    """A modalign command joined to the cluster, in its own empty working and temp folders."""
    work = cluster["root"] / name
    (work / "cwd").mkdir(parents=True)
    (work / "tmp").mkdir()
    env = dict(cluster["env"], TMPDIR=str(work / "tmp"), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    log = open(work / "stderr.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "modalign.pipeline.cli", *args, "--address", cluster["address"],
                             "--config", str(cluster["config"])], cwd=work / "cwd", env=env,
                            stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    proc.work = work  # type: ignore[attr-defined]
    return proc


def _log(proc: subprocess.Popen) -> str:
    return (proc.work / "stderr.log").read_text(errors="replace")[-4000:]  # type: ignore[attr-defined]


class _Killer(threading.Thread):
    """SIGKILLs a pipeline actor process of the cluster about every 10 s: the kinds in turn
    (``ACTORS``), each as soon as one is running after the pause."""

    def __init__(self, raylets: list[int]) -> None:
        super().__init__(daemon=True)
        self.raylets, self.stop, self.killed = raylets, threading.Event(), []
        self.rng = random.Random(13)

    def _running(self, actor: str) -> list[int]:
        return [pid for r in self.raylets for pid in _descendants(r)
                if _proc_cmdline(pid).startswith(f"ray::{actor}")]

    def run(self) -> None:
        turn = 0
        while not self.stop.wait(self.rng.uniform(*KILL_EVERY_S)):
            actor = ACTORS[turn % len(ACTORS)]
            while not self.stop.is_set() and not (procs := self._running(actor)):
                self.stop.wait(0.2)
            if self.stop.is_set():
                return
            try:
                os.kill(self.rng.choice(procs), signal.SIGKILL)
            except ProcessLookupError:
                continue
            self.killed.append(actor)
            turn += 1


def _proc_cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.fixture(scope="module")
def chaos(cluster, tmp_path_factory) -> dict:
    from modalign.pipeline.sample import generate_sample

    s3, bucket = cluster["s3"], cluster["s3"].bucket
    client = s3.client()
    sample = tmp_path_factory.mktemp("sample")
    generate_sample(sample, duration_s=4.5, seed=0)
    storage = StorageConfig(endpoint_url=s3.endpoint)
    stream_out, batch_out = f"s3://{bucket}/stream", f"s3://{bucket}/batch"

    def committed() -> dict:
        with _environ(cluster["env"]):
            return committed_versions(stream_out, storage)

    watch_args = ("watch", f"s3://{bucket}/live", "--out", stream_out, "--interval", "0.5", "--settle", "1",
                  "--max-in-flight", "1", "--metrics-port", "0", "--lease-wait", "120")
    killer = _Killer(cluster["raylets"])
    started = time.monotonic()
    watches = [_cli(cluster, "watch-1", *watch_args)]
    killer.start()
    driver_killed_at = None
    try:
        _upload(client, bucket, sample, "live", SESSIONS[0])
        uploads = {SESSIONS[0]: time.monotonic()}
        # until every session is committed and every kind of actor was killed once (a faster pipeline
        # can commit the three sessions before the third kill)
        while len(committed()) < len(SESSIONS) or set(killer.killed) != set(ACTORS):
            now = time.monotonic()
            assert now - started < DEADLINE_S, f"not all sessions committed and actors killed in {DEADLINE_S} s: " \
                                              f"{committed()}, killed {killer.killed}\n" \
                                              f"{_log(watches[-1])}"
            assert watches[-1].poll() is None, f"the watch exited {watches[-1].returncode}:\n{_log(watches[-1])}"
            nxt = len(uploads)  # the next session ~12 s after the previous one
            if nxt < len(SESSIONS) and now - uploads[SESSIONS[nxt - 1]] > 12:
                _upload(client, bucket, sample, "live", SESSIONS[nxt])
                uploads[SESSIONS[nxt]] = now
            if driver_killed_at is None and committed() and len(uploads) > 1:
                os.killpg(watches[-1].pid, signal.SIGKILL)  # the driver, mid-batch; the cluster lives on
                watches[-1].wait(timeout=30)
                driver_killed_at = now - started
                watches.append(_cli(cluster, "watch-2", *watch_args))
            time.sleep(0.5)
    finally:
        killer.stop.set()
        killer.join()
    watch = watches[-1]
    watch.send_signal(signal.SIGTERM)  # drain and stop
    rc = watch.wait(timeout=120)
    chaos_s = time.monotonic() - started

    batch = _cli(cluster, "batch", "run", f"s3://{bucket}/live", "--out", batch_out)
    batch_rc = batch.wait(timeout=300)
    return {"watches": watches, "watch_rc": rc, "batch": batch, "batch_rc": batch_rc, "killed": killer.killed,
            "driver_killed_at": driver_killed_at, "chaos_s": chaos_s, "storage": storage, "committed": committed(),
            "stream": stream_out, "batch_out": batch_out}


def test_watch_under_chaos_commits_exactly_what_a_clean_batch_run_commits(cluster, chaos):
    assert chaos["watch_rc"] == 0, _log(chaos["watches"][-1])
    assert chaos["batch_rc"] in (0, 3), _log(chaos["batch"])
    assert chaos["driver_killed_at"] is not None and len(chaos["watches"]) == 2
    assert set(chaos["killed"]) == set(ACTORS), chaos["killed"]  # every kind at least once
    with _environ(cluster["env"]):
        stream = modalign.open(chaos["stream"], chaos["storage"])
        batch = modalign.open(chaos["batch_out"], chaos["storage"])
        assert chaos["committed"] == committed_versions(chaos["batch_out"], chaos["storage"])
        assert set(chaos["committed"]) == set(SESSIONS)
        diffs = {}
        for name in TABLES:
            expected, got = _rows(batch, name), _rows(stream, name)
            diffs[name] = _diff(expected, got)
            assert sum(expected.values()) > 0 or name in ("drift_alarms", "quarantine", "monitor_alarms"), name
    print(f"\nchaos: {len(chaos['killed'])} actor kills ({', '.join(sorted(chaos['killed']))}), watch driver "
          f"SIGKILLed at {chaos['driver_killed_at']:.0f} s, {chaos['chaos_s']:.0f} s in all; (lost, duplicated) per "
          f"table: {diffs}")
    assert all(d == (0, 0) for d in diffs.values()), {k: v for k, v in diffs.items() if v != (0, 0)}


def test_both_nodes_ran_pipeline_actors_and_nothing_was_written_locally(cluster, chaos):
    for node, folder in cluster["nodes"].items():
        assert _actor_logs(folder), f"no pipeline actor ran on the {node} node"
    assert _actor_logs(cluster["nodes"]["worker"]) | _actor_logs(cluster["nodes"]["head"]) >= {"IngestActor",
                                                                                               "EmbedActor"}
    for proc in [*chaos["watches"], chaos["batch"]]:
        for sub in ("cwd", "tmp"):
            left = sorted(p.name for p in (proc.work / sub).rglob("*"))
            assert left == [], f"{proc.work.name} wrote {left} into its local {sub}"
    with _environ(cluster["env"]):
        lineage = modalign.open(chaos["batch_out"], chaos["storage"]).table("lineage_sources").to_table().to_pylist()
    client = cluster["s3"].client()
    for row in lineage:  # read by a worker from the bucket, hashed on the way
        assert row["source_uri"].startswith(f"s3://{cluster['s3'].bucket}/live/")
        if row["track_of"] is None:
            key = row["source_uri"].split("/", 3)[3]
            import hashlib

            body = client.get_object(Bucket=cluster["s3"].bucket, Key=key)["Body"].read()
            assert row["source_sha256"] == "sha256:" + hashlib.sha256(body).hexdigest(), key
            assert row["source_version"].startswith("etag:") and row["source_version"].endswith(f":{len(body)}")


# Run by a driver joined to the cluster (``_cli``'s environment): the batch OUT, on S3 only, as a Ray
# Data Dataset whose join tasks the cluster places (Ray Data spreads them), each row tagged with the
# node its task ran on by a map fused into that task; and the same samples read here by ``aligned``.
_RAY_DATA = r'''
import hashlib, json, sys
import numpy as np, ray
import modalign
from modalign.pipeline.dataset import plain_batch, rows_of
from modalign.pipeline.local_ray import join_ray
from modalign.schemas.config import StorageConfig

def norm(v):
    if isinstance(v, np.ndarray):
        return norm(v.tolist())
    if isinstance(v, (list, tuple)):
        return [norm(x) for x in v]
    if isinstance(v, dict):
        return {k: norm(x) for k, x in v.items()}
    return v.item() if isinstance(v, np.generic) else v

def digest(row):
    return hashlib.sha256(json.dumps(norm(row), sort_keys=True, default=repr).encode()).hexdigest()

def tag(batch):
    return batch.append_column("node", [[ray.get_runtime_context().get_node_id()] * len(batch)])

address, uri, endpoint = sys.argv[1:4]
join_ray(address)  # a loopback cluster: joined on loopback
out = modalign.open(uri, StorageConfig(endpoint_url=endpoint))
args = dict(unit="clip", clip_s=1.0, decode=False, chunk_s=1.0)
rows = out.ray_dataset(**args).map_batches(tag, batch_format="pyarrow").take_all()
nodes = sorted({r.pop("node") for r in rows})
local = [r for b in out.aligned(**args) for r in rows_of(plain_batch(b))]
print(json.dumps({"ray": sorted(map(digest, rows)), "local": sorted(map(digest, local)), "nodes": nodes,
                  "cluster": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"]),
                  "sessions": sorted({r["session_id"] for r in local})}))
'''


def test_ray_data_reads_the_s3_output_on_both_nodes_and_gives_the_local_samples(cluster, chaos):
    """Issue 16's Ray Data reader on a real two-node cluster: OUT exists only on S3, each node's tasks
    read it there, and the rows equal ``aligned``'s (every sample once)."""
    work = cluster["root"] / "ray-data"
    work.mkdir()
    env = dict(cluster["env"], TMPDIR=str(work), PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-c", _RAY_DATA, cluster["address"], chaos["batch_out"],
                           cluster["s3"].endpoint], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["sessions"] == sorted(SESSIONS)
    assert len(got["local"]) >= 3 * 4  # 4.5 s sessions, 1 s clips
    assert got["ray"] == got["local"]  # as multisets: 0 lost, 0 duplicated
    assert len(got["cluster"]) == 2 and got["nodes"] == got["cluster"], "the join tasks did not run on both nodes"
