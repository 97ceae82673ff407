"""Faults of the environment (OUT read-only or full) stop the run with one clear message.

They are never recorded as bad input: no source is quarantined for them. The folders are real
tmpfs mounts (read-only, or a few hundred KiB); where this process may not mount (not root,
no CAP_SYS_ADMIN) the tests skip and say so.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from clips import write_clip, write_tone
from modalign.pipeline.runner import Runner
from modalign.schemas.config import RunConfig
from modalign.schemas.errors import EnvironmentFaultError

pytestmark = pytest.mark.integration


@pytest.fixture
def mount_tmpfs():
    mounted: list[Path] = []

    def mount(path: Path, size_kib: int, read_only: bool = False) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        opts = f"size={size_kib}k" + (",ro" if read_only else "")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}): needs root")
        mounted.append(path)
        return path

    yield mount
    for p in reversed(mounted):
        subprocess.run(["umount", "-l", str(p)], check=False)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("faults-in")
    write_tone(d / "a.wav", seconds=2.0)
    write_clip(d / "b.mp4", seconds=2.0, sound=False)
    return d


def test_a_read_only_out_stops_before_any_work(ray_local, inputs, tmp_path, mount_tmpfs):
    out = mount_tmpfs(tmp_path / "out", 1024, read_only=True)
    messages: list[str] = []
    with pytest.raises(EnvironmentFaultError, match="not writable.*Read-only"):
        Runner(RunConfig(key_store=tmp_path / "keys"), out, progress=messages.append).run(inputs)
    assert messages == []  # nothing started: no actor, no ingest, no quarantine line


def test_an_out_without_room_stops_before_any_work(ray_local, inputs, tmp_path, mount_tmpfs):
    out = mount_tmpfs(tmp_path / "out", 1024)
    with pytest.raises(EnvironmentFaultError, match="MiB free, under runtime.min_free_mb=256"):
        Runner(RunConfig(key_store=tmp_path / "keys"), out).run(inputs)


def test_a_disk_that_fills_mid_run_is_an_environment_fault_not_bad_input(ray_local, inputs, tmp_path, mount_tmpfs):
    out = mount_tmpfs(tmp_path / "out", 64)  # room for the probe, not for the events
    messages: list[str] = []
    cfg = RunConfig(key_store=tmp_path / "keys", runtime={"min_free_mb": 0})
    with pytest.raises(EnvironmentFaultError, match="No space left"):
        Runner(cfg, out, progress=messages.append).run(inputs)
    assert not any(m.startswith("quarantine") for m in messages)  # no source was blamed
    assert not (out / "quarantine").exists() and not (out / "run.json").exists()


def test_the_worker_reports_a_full_disk_as_a_fault_item(inputs, tmp_path, mount_tmpfs):
    """In-process: the worker's items for a source written onto a full OUT."""
    from modalign.pipeline.discovery import discover
    from modalign.pipeline.items import FaultItem, QuarantineItem, SourceJob
    from modalign.pipeline.worker import IngestWorker
    from modalign.schemas.files import stat_version

    out = mount_tmpfs(tmp_path / "out", 16)
    (tmp_path / "in").mkdir()
    write_tone(tmp_path / "in" / "long.wav", seconds=20.0)  # 2,000 MFCC frames: more than 16 KiB of events
    (session,) = discover(tmp_path / "in" / "long.wav")
    spec = session.manifest.sources[0]
    path = session.resolve(spec)
    job = SourceJob(run_id="r", session_id=session.manifest.session_id, spec=spec, path=path, uri=path.as_uri(),
                    version=stat_version(path))
    items = list(IngestWorker(RunConfig(), out, tmp_path / "keys").ingest(job))
    assert isinstance(items[-1], FaultItem) and "No space left" in items[-1].message
    assert not any(isinstance(i, QuarantineItem) for i in items)
