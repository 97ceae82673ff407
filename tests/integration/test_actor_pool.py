"""A warm actor pool (a watch's) never starts a run on an actor Ray restarted: each run gets every
actor's whole restart budget, so deaths spread over a long watch do not add up to a failed session."""

from __future__ import annotations

import os
import signal
import time

import pytest

from modalign.pipeline.actors import ActorPool
from modalign.schemas.config import RunConfig

pytestmark = pytest.mark.integration


def _wait_restarted(actor, old_pid: int, timeout: float = 120.0) -> int:
    """The actor's new process id once Ray has restarted it after ``old_pid`` died."""
    import ray

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid = ray.get(actor.pid.remote(), timeout=30)
            if pid != old_pid:
                return pid
        except ray.exceptions.RayError:
            pass  # restarting
        time.sleep(0.5)
    raise AssertionError(f"the actor was not restarted in {timeout} s")


def test_a_warm_pool_replaces_restarted_actors_before_the_next_run(ray_local, tmp_path):
    import ray

    cfg = RunConfig(key_store=tmp_path / "keys")
    args = (cfg, str(tmp_path / "out"), str(tmp_path / "keys"))
    pool = ActorPool()
    pool.ready(*args, "attempt-1", 2, {"num_cpus": 0}, [], n_embed=1)  # no chains: no model to load
    first = dict(pool.pids)
    assert sorted(first) == [("embed", 0), ("ingest", 0), ("ingest", 1)] and len(set(first.values())) == 3
    try:
        pool.ready(*args, "attempt-2", 2, {"num_cpus": 0}, [], n_embed=1)  # nothing died: the same actors
        assert pool.pids == first and pool.replaced == 0

        os.kill(first[("ingest", 1)], signal.SIGKILL)  # Ray restarts it: one restart of two used
        os.kill(first[("embed", 0)], signal.SIGKILL)
        restarted = _wait_restarted(pool.ingest[1], first[("ingest", 1)])
        _wait_restarted(pool.embedders[0], first[("embed", 0)])
        old = (pool.ingest[1], pool.embedders[0])

        pool.ready(*args, "attempt-3", 2, {"num_cpus": 0}, [], n_embed=1)
        assert pool.replaced == 2
        assert pool.pids[("ingest", 0)] == first[("ingest", 0)]  # the untouched actor stays
        assert pool.pids[("ingest", 1)] not in (first[("ingest", 1)], restarted)  # a fresh process
        assert pool.ingest[1] is not old[0] and pool.embedders[0] is not old[1]
        with pytest.raises(ray.exceptions.RayActorError):  # the restarted one was killed, not left running
            ray.get(old[0].pid.remote(), timeout=60)
        assert ray.get(pool.ingest[1].pid.remote()) == pool.pids[("ingest", 1)]
    finally:
        pool.close()


def _maps_torch(pid: int) -> bool:
    """Whether process ``pid`` has torch's native library mapped (it imported torch)."""
    with open(f"/proc/{pid}/maps", encoding="utf-8") as f:
        return "libtorch_cpu" in f.read()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/<pid>/maps (Linux)")
def test_ingest_actors_warm_every_chain_without_importing_torch(ray_local, tmp_path):
    """Only the embed actor needs torch: an ingest actor with its video, audio and PDF chains set
    up (MediaPipe, the NumPy MTCNN, spaCy, tesseract) has not loaded it (it cost ~2 CPU s and
    ~170 MiB of RSS per actor)."""
    cfg = RunConfig(key_store=tmp_path / "keys")
    pool = ActorPool()
    chains = [("video", "default"), ("audio", "default"), ("pdf", "default")]
    pool.ready(cfg, str(tmp_path / "out"), str(tmp_path / "keys"), "attempt-1", 1, {"num_cpus": 0}, chains)
    try:
        assert not _maps_torch(pool.pids[("ingest", 0)])
        assert _maps_torch(pool.pids[("embed", 0)])  # the check sees torch where it is loaded
    finally:
        pool.close()
