"""schemas.files: the one file hash and the one atomic write."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import pytest

from modalign.schemas.files import SeekableHashingReader, atomic_write, sha256_file

pytestmark = pytest.mark.unit

PAYLOAD = bytes(range(256)) * 9001  # ~2.3 MB: spans several read chunks


def test_sha256_file_equals_hashlib(tmp_path):
    p = tmp_path / "blob.bin"
    p.write_bytes(PAYLOAD)
    assert sha256_file(p) == hashlib.sha256(PAYLOAD).hexdigest()
    assert sha256_file(str(p), chunk=7) == hashlib.sha256(PAYLOAD).hexdigest()


def test_sha256_of_an_empty_file(tmp_path):
    p = tmp_path / "empty"
    p.write_bytes(b"")
    assert sha256_file(p) == hashlib.sha256(b"").hexdigest()


def test_hashing_reader_hashes_what_read_returns(tmp_path):
    p = tmp_path / "blob.bin"
    p.write_bytes(PAYLOAD)
    got = bytearray()
    with SeekableHashingReader(p) as r:
        while block := r.read(65_537):
            got += block
        assert r.hexdigest() == hashlib.sha256(PAYLOAD).hexdigest() == sha256_file(p)
        assert r.reread_bytes == 0 and r.seekable() and r.readable()  # read in order: nothing read twice
    assert bytes(got) == PAYLOAD and r.closed


def test_hashing_reader_feeds_a_buffered_reader(tmp_path):
    """A decoder may wrap its input in io.BufferedReader, which calls readinto()."""
    p = tmp_path / "blob.bin"
    p.write_bytes(PAYLOAD)
    r = SeekableHashingReader(p)
    buffered = io.BufferedReader(r, buffer_size=4096)  # type: ignore[arg-type]
    assert buffered.read() == PAYLOAD
    assert r.hexdigest() == hashlib.sha256(PAYLOAD).hexdigest() and r.reread_bytes == 0


def test_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    p = tmp_path / "sub" / "out.txt"  # the parent folder is created
    assert atomic_write(p, lambda tmp: Path(tmp).write_text("first")) == p
    atomic_write(p, lambda tmp: Path(tmp).write_text("second"))
    assert p.read_text() == "second"
    assert sorted(os.listdir(p.parent)) == ["out.txt"]


def test_a_crash_in_write_fn_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    p = tmp_path / "out.txt"
    p.write_text("old")

    def crash(tmp: Path) -> None:
        tmp.write_text("half a fi")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        atomic_write(p, crash)
    assert p.read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["out.txt"]


def test_a_crash_before_write_fn_creates_anything_is_clean(tmp_path):
    p = tmp_path / "out.txt"

    def crash(tmp: Path) -> None:
        raise ValueError("bad table")

    with pytest.raises(ValueError):
        atomic_write(p, crash)
    assert os.listdir(tmp_path) == []


def test_the_written_file_gets_the_usual_mode(tmp_path):
    """write_fn creates the file itself, so it is not left private the way mkstemp would."""
    p = tmp_path / "out.bin"
    atomic_write(p, lambda tmp: tmp.write_bytes(b"x"))
    ref = tmp_path / "ref.bin"
    ref.write_bytes(b"x")
    assert (p.stat().st_mode & 0o777) == (ref.stat().st_mode & 0o777)


@pytest.mark.parametrize("faststart", [False, True])
def test_seekable_hashing_reader_hashes_what_pyav_reads_once(tmp_path, faststart):
    """PyAV seeks (an mp4's index can sit at the end): the hash still equals the file's, and
    finishing it re-reads only what the decoder skipped, not the file."""
    import av
    import numpy as np

    path = tmp_path / "clip.mp4"
    opts = {"movflags": "faststart"} if faststart else {}
    with av.open(str(path), "w", options=opts) as c:
        s = c.add_stream("libx264", rate=25)
        s.width, s.height, s.pix_fmt = 320, 240, "yuv420p"
        rng = np.random.default_rng(0)
        for _ in range(50):
            img = rng.integers(0, 255, (240, 320, 3), dtype=np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    with SeekableHashingReader(path) as reader:
        with av.open(reader) as c:
            frames = sum(1 for _ in c.decode(video=0))
        assert frames == 50
        assert reader.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest() == sha256_file(path)
        assert reader.reread_bytes < 0.05 * path.stat().st_size  # at most the trailing index, re-read once
