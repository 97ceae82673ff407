"""The whole hostile corpus in one folder, plus one good WAV, through the runner on Ray.

Every hostile file ends as exactly one quarantine row with its reason code; the run goes
on, exits with the "quarantined" code, the good file's records are complete, and the run
finishes in bounded time. Files discovery does not take as media (a .txt) are ignored.
"""

from __future__ import annotations

import hashlib
import signal
import time
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from hostile_corpus import CORPUS, write_corpus, write_wav
from modalign.pipeline.runner import EXIT_QUARANTINED, Runner
from modalign.schemas.config import RunConfig

pytestmark = pytest.mark.integration

MAX_RUN_S = 240  # ~40 s here on 2 shared cores; a hang or a retry loop would blow it


# Media names that lead out of the folder (symlinks): refused before any byte is read.
ESCAPES = {"escape.wav": "path_outside_root", "etc_hostname.wav": "path_outside_root"}


@pytest.fixture(scope="module")
def hostile_folder(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hostile_run")
    write_corpus(d)
    write_wav(d / "good.wav", seconds=2.0)
    outside = write_wav(tmp_path_factory.mktemp("outside") / "secret.wav", seconds=1.0, seed=7)
    (d / "escape.wav").symlink_to(outside)
    (d / "etc_hostname.wav").symlink_to("/etc/hostname")
    return d


def test_hostile_corpus_is_quarantined_and_the_good_file_completes(ray_local, hostile_folder, tmp_path):
    out = tmp_path / "out"

    def hung(*_):
        raise TimeoutError(f"the run did not finish in {MAX_RUN_S} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(MAX_RUN_S)  # a hang fails the test instead of the suite
    started = time.monotonic()
    try:
        summary = Runner(RunConfig(key_store=tmp_path / "keys"), out, progress=lambda _m: None).run(hostile_folder)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    elapsed = time.monotonic() - started

    assert summary["exit_code"] == EXIT_QUARANTINED
    assert elapsed < MAX_RUN_S
    rows = ds.dataset(out / "quarantine", format="parquet").to_table().to_pylist()
    names = [Path(r["source_uri"]).name for r in rows]
    expected = {h.name: h.runner_code for h in CORPUS if h.runner_code is not None} | ESCAPES
    assert sorted(names) == sorted(expected)  # exactly one row per hostile media file, none for good.wav
    for r in rows:
        name = Path(r["source_uri"]).name
        assert r["reason_code"] == expected[name], name
        assert r["message"] and len(r["message"]) < 400
    by_name = {Path(r["source_uri"]).name: r for r in rows}
    assert by_name["empty.mp4"]["stage"] == "discover"
    for h in CORPUS:
        if h.partial:  # a range after the good part, not the whole source
            r = by_name[h.name]
            assert r["start_t_ns"] is not None and r["end_t_ns"] is not None and r["start_t_ns"] > 0

    lineage = ds.dataset(out / "lineage" / "sources", format="parquet").to_table().to_pylist()
    status = {Path(r["source_uri"]).name: r["status"] for r in lineage if r["track_of"] is None}
    tracks = {Path(r["source_uri"]).name: r["status"] for r in lineage if r["track_of"] is not None}
    assert status["good.wav"] == "ingested"
    assert tracks["wav_as.mp4"] == "ingested"  # no video stream, but its sound is real: the audio track reads it
    assert "notes.txt" not in status and "notes.txt" not in names  # not media: never discovered
    for name in ESCAPES:  # never read: no version, no hash, no lineage row of its content
        assert by_name[name]["source_version"] is None and name not in status
    secret = hashlib.sha256((hostile_folder / "escape.wav").resolve().read_bytes()).hexdigest()
    assert not any(secret in p.read_bytes().decode("latin-1") for p in out.rglob("*") if p.is_file())
    for h in CORPUS:
        if h.runner_code is not None and h.name in status:
            assert status[h.name] == ("partial" if h.partial else "quarantined"), h.name

    # the good file is complete: 2 s of audio -> 50 ticks of 40 ms, all matched, voiced flags present
    good = ds.dataset(out / "records" / "good", format="parquet").to_table()
    assert abs(good.num_rows - 50) <= 1 and set(good.column("decision").to_pylist()) == {"matched"}
    events = ds.dataset(out / "events" / "audio" / "good", format="parquet").to_table().sort_by("frame_index")
    assert events.num_rows == (32000 - 400) // 160 + 1
    assert events.column("voiced").to_pylist() == [True] * events.num_rows  # a tone from the first frame
