"""INPUT on object storage without a server: key containment (the same rules and codes as a
folder), sessions from a listing of keys, and the readers a worker uses for an object
(a hashing reader over a seeking decoder, an in-memory file a child tool opens by path)."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import pytest

from modalign.pipeline.discovery import ObjectPath, Session, folder_sessions
from modalign.schemas.errors import InputError
from modalign.schemas.files import MemoryFile, SeekableHashingReader
from modalign.schemas.manifest import Manifest, SourceSpec

pytestmark = pytest.mark.unit

URIS = ["a.wav", "sub/b.wav", "sub/../c.wav", "../other/x.wav", "../../outside/canary.pdf", "/etc/passwd",
        "/rec/meeting/a.wav", "s3://bucket/rec/meeting/a.wav", "http://example.com/a.wav"]


def _manifest() -> Manifest:
    return Manifest(session_id="m", sources=[SourceSpec(id=f"s{i}", uri=u, modality="audio")
                                             for i, u in enumerate(URIS)])


def _outcomes(session: Session) -> dict[str, str]:
    out = {}
    for spec in session.manifest.sources:
        try:
            out[spec.uri] = session.resolve(spec).as_uri()
        except InputError as exc:
            out[spec.uri] = str(exc.code)
    return out


def test_keys_resolve_inside_the_manifest_prefix_with_the_codes_of_a_folder(tmp_path):
    base = ObjectPath("bucket", "rec/meeting")
    on_s3 = _outcomes(Session(_manifest(), base, base.join("manifest.yaml")))
    assert on_s3 == {
        "a.wav": "s3://bucket/rec/meeting/a.wav", "sub/b.wav": "s3://bucket/rec/meeting/sub/b.wav",
        "sub/../c.wav": "s3://bucket/rec/meeting/c.wav", "../other/x.wav": "path_outside_root",
        "../../outside/canary.pdf": "path_outside_root", "/etc/passwd": "path_outside_root",
        "/rec/meeting/a.wav": "path_outside_root",  # absolute: refused even where it would land inside
        "s3://bucket/rec/meeting/a.wav": "unsupported", "http://example.com/a.wav": "unsupported"}
    folder = tmp_path / "rec" / "meeting"
    folder.mkdir(parents=True)
    local = _outcomes(Session(_manifest(), folder, folder / "manifest.yaml"))
    same = [u for u in URIS if u != "/rec/meeting/a.wav"]  # a local absolute path inside the folder is allowed
    assert {u: v if v.startswith(("path_", "unsupported")) else "ok" for u, v in on_s3.items() if u in same} == \
           {u: v if v.startswith(("path_", "unsupported")) else "ok" for u, v in local.items() if u in same}


def test_a_listing_of_keys_gives_the_sessions_of_a_folder():
    keys = ["rec/meeting/manifest.yaml", "rec/meeting/a.wav", "rec/meeting/notes.txt", "rec/lone/clip.mp4",
            "rec/Über Café.wav"]
    manifests = {"rec/meeting/manifest.yaml": b"session_id: meeting\nsources:\n  - {id: a, uri: a.wav, modality: audio}\n"}
    read: list[str] = []

    def get(path: ObjectPath) -> bytes | None:
        read.append(path.key)
        return manifests.get(path.key)

    sessions = folder_sessions([ObjectPath("bucket", k) for k in keys], read=get, objects={})
    assert read == ["rec/meeting/manifest.yaml"]  # media objects are never read
    by_id = {s.manifest.session_id: s for s in sessions}
    assert set(by_id) == {"meeting", "clip", "Uber_Cafe-" + hashlib.sha256("Über Café.wav".encode()).hexdigest()[:8]}
    assert by_id["meeting"].manifest_path == ObjectPath("bucket", "rec/meeting/manifest.yaml")
    assert by_id["clip"].resolve(by_id["clip"].manifest.sources[0]) == ObjectPath("bucket", "rec/lone/clip.mp4")


class _Counting(io.BytesIO):
    """An in-memory object that counts the bytes read from it."""

    def __init__(self, data: bytes, counter: list[int]) -> None:
        super().__init__(data)
        self.counter = counter

    def read(self, n: int = -1) -> bytes:
        data = super().read(n)
        self.counter[0] += len(data)
        return data


def test_hashing_reader_over_an_opener_hashes_every_byte_once_whatever_the_seeks():
    data = os.urandom(300_000)
    counter = [0]
    opened: list[int] = []

    def opener():
        opened.append(1)
        return _Counting(data, counter)

    r = SeekableHashingReader(opener=opener)
    r.seek(250_000)  # a decoder reading an index at the end first
    r.read(10_000)
    r.seek(0)
    r.read(100_000)
    r.seek(50_000)  # back over hashed bytes: not hashed twice
    r.read(80_000)
    r.close()  # the decoder closes it before the end: the rest is read once more
    assert r.hexdigest() == hashlib.sha256(data).hexdigest()
    assert r.reread_bytes == len(data) - 130_000 and len(opened) == 2


def test_memory_file_is_read_by_a_child_tool_through_its_fd_and_capped():
    from modalign.operators.sandbox import run_limited

    data = os.urandom(200_000)
    with MemoryFile() as mem:
        mem.fill([data[:123_456], data[123_456:]], max_bytes=len(data))
        assert mem.hexdigest() == hashlib.sha256(data).hexdigest() and mem.path.is_file()
        proc = run_limited(["sha256sum", str(mem.path)], timeout=30, memory_mb=256)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()
        fd = mem.fd
    assert mem.fd == -1 and not Path(f"/proc/self/fd/{fd}").exists()  # the memory is freed with the fd
    with MemoryFile() as mem, pytest.raises(OverflowError):
        mem.fill([data], max_bytes=len(data) - 1)


def test_open_container_on_a_reader_alone_says_what_the_object_is():
    from modalign.operators.ingest._av import open_container
    from modalign.schemas.errors import UnreadableInputError, UnsupportedInputError

    with pytest.raises(UnreadableInputError) as empty:
        open_container(None, "s3://b/k.mp4", "video_frames", reader=io.BytesIO(b""))
    assert empty.value.code == "file_empty"
    with pytest.raises(UnsupportedInputError) as pdf:
        open_container(None, "s3://b/k.mp4", "video_frames", reader=io.BytesIO(b"%PDF-1.4\n" + b"x" * 2000))
    assert pdf.value.code == "wrong_type"
