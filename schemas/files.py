"""File helpers every layer shares: one content hash and one atomic write.

``sha256_file`` is the hash behind source content hashes in lineage and model digests;
``SeekableHashingReader`` computes the same hash of the bytes a decoder (which may seek)
reads through it, so a source is read once (a local file, or any seekable file object such
as an object-store reader); ``MemoryFile`` holds a source a tool must open by path in
anonymous memory (Linux ``memfd``: never a file on disk), hashed as it is filled. ``atomic_write`` is how anything we write lands: a temporary file in
the same folder, fsynced, then renamed over the target, so a reader never sees half a file
and a crash leaves the old one.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

CHUNK_BYTES = 1 << 20


def sha256_file(path: Path | str, chunk: int = CHUNK_BYTES) -> str:
    """sha256 hex digest of a file's bytes, read ``chunk`` bytes at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def stat_version(path: Path | str) -> str:
    """A local file's version without reading it (its size and modification time), as an
    object store's ETag is: ``local:<bytes>:<mtime ns>``. The content hash is taken while the
    file is read (``SeekableHashingReader``) and recorded beside it."""
    st = os.stat(path)
    return f"local:{st.st_size}:{st.st_mtime_ns}"


def atomic_write(path: Path | str, write_fn: Callable[[Path], object]) -> Path:
    """Write ``path`` atomically and return it: ``write_fn(tmp)`` creates a temporary file in the
    same folder (a fresh hidden name), which is fsynced and renamed over ``path``
    (``os.replace``). If ``write_fn`` raises, the old ``path`` is untouched and the temporary
    file is removed. Creates the parent folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A fresh name that write_fn creates itself, so the file gets the usual (umask) mode.
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        write_fn(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # gone after a successful replace
    return path


def fsync_dir(path: Path | str) -> None:
    """Make the entries of a folder (a rename or link into it) durable: fsync the folder itself."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SeekableHashingReader:
    """A seekable read-only view of a file for a decoder (PyAV) that hashes the file as the
    decoder reads it: the sha256 advances over the longest prefix read so far in order, and
    ``hexdigest()`` reads only what the decoder never reached (a trailing index, a skipped
    tail) to finish it. So a source is read once and its hash equals ``sha256_file``.

    ``reread_bytes`` counts the bytes ``hexdigest()`` had to read itself.

    ``opener`` (instead of ``path``): how to open the source (a seekable binary file object),
    called now and, if the decoder closed it before the hash is finished, once more."""

    def __init__(self, path: Path | str | None = None, *, opener: Callable[[], BinaryIO] | None = None) -> None:
        if (path is None) == (opener is None):
            raise TypeError("give a path or an opener")
        self.path = Path(path) if path is not None else None
        self._open: Callable[[], BinaryIO] = opener or (lambda: open(self.path, "rb"))  # type: ignore[arg-type]
        self._f = self._open()
        self._h = hashlib.sha256()
        self._hashed = 0  # bytes [0, _hashed) are in the hash
        self.reread_bytes = 0
        self._digest: str | None = None

    def _feed(self, pos: int, data: bytes | memoryview) -> None:
        if pos <= self._hashed < pos + len(data):
            self._h.update(memoryview(data)[self._hashed - pos:])
            self._hashed = pos + len(data)

    def read(self, size: int = -1) -> bytes:
        pos = self._f.tell()
        data = self._f.read(size)
        self._feed(pos, data)
        return data

    def readinto(self, buffer: bytearray | memoryview) -> int:
        pos = self._f.tell()
        n = self._f.readinto(buffer) or 0
        self._feed(pos, memoryview(buffer).cast("B")[:n])
        return n

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def hexdigest(self) -> str:
        """sha256 hex of the whole file (reads what the decoder did not, once)."""
        if self._digest is None:
            with self._open() as f:
                f.seek(self._hashed)
                while block := f.read(CHUNK_BYTES):
                    self._h.update(block)
                    self._hashed += len(block)
                    self.reread_bytes += len(block)
            self._digest = self._h.hexdigest()
        return self._digest

    def close(self) -> None:
        self._f.close()

    @property
    def closed(self) -> bool:
        return self._f.closed

    def __enter__(self) -> "SeekableHashingReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MemoryFile:
    """A source held in anonymous memory (``os.memfd_create``, Linux), for tools that need a
    path (poppler): ``path`` is ``/proc/self/fd/N``, readable by this process and by children
    that inherit the fd (``operators.sandbox.run_limited`` passes it on). Nothing is written
    to a disk; the memory is freed on ``close()``. ``sha256`` is of the bytes as filled.

    ``fill`` copies ``chunks`` in, refusing more than ``max_bytes`` (``OverflowError``)."""

    def __init__(self, name: str = "modalign-source") -> None:
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        self.size = 0
        self._h = hashlib.sha256()

    @property
    def path(self) -> Path:
        return Path(f"/proc/self/fd/{self.fd}")

    def fill(self, chunks: Iterable[bytes], max_bytes: int) -> "MemoryFile":
        for block in chunks:
            if self.size + len(block) > max_bytes:
                raise OverflowError(f"more than {max_bytes} bytes")
            view = memoryview(block)
            while view:
                n = os.write(self.fd, view)
                view = view[n:]
            self._h.update(block)
            self.size += len(block)
        os.lseek(self.fd, 0, os.SEEK_SET)
        return self

    def hexdigest(self) -> str:
        return self._h.hexdigest()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "MemoryFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
