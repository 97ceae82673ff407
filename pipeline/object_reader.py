"""How an ingest worker reads a source that lives on object storage (``s3://bucket/key``).

Where it sits: under ``pipeline.worker``, which calls it for a ``SourceJob`` whose path is a
``discovery.ObjectPath``. The worker reads the object itself (nothing passes through the
driver) and never writes its bytes to a disk (raw media is personal data):

- audio and video (PyAV reads a file object): ``ObjectOpener`` opens a seekable reader over
  ``pyarrow.fs.S3FileSystem.open_input_file``, buffered in ``block_bytes`` ranged GETs (a
  decoder's small reads and short seeks are served from the buffer); the worker hashes it
  on the way (``schemas.files.SeekableHashingReader``). Memory: one block per open source.
- documents (poppler opens a path): ``in_memory`` copies the object into a
  ``schemas.files.MemoryFile`` (``memfd``, ``/proc/self/fd/N``), hashing it as it is filled,
  and refuses an object over ``ingest.max_object_memory_bytes`` (``limit_exceeded``). Memory:
  the whole object, for as long as the document is processed.

Errors: a key that is gone (404), or whose ETag is no longer the one discovery listed, is the
input's problem (``file_missing``: that version is gone); anything else the store does after
the retries of ``storage`` (``AwsStandardS3RetryStrategy``: throttling, 5xx, resets) is an
``EnvironmentFaultError`` naming bucket and endpoint, never a credential.
"""

from __future__ import annotations

import io
import re
from typing import Any

from modalign.pipeline.discovery import ObjectPath
from modalign.pipeline.objstore import Location, S3Options, s3_filesystem
from modalign.schemas.errors import EnvironmentFaultError, InputError, LimitExceededError, QuarantineReason
from modalign.schemas.files import MemoryFile

BLOCK_BYTES = 8 * 2**20  # one ranged GET: large enough for S3 throughput, small enough to keep per source
_AWS_ERROR = re.compile(r"AWS Error ([A-Z_]+)")


class _ArrowRaw(io.RawIOBase):
    """``io.RawIOBase`` over a pyarrow ``RandomAccessFile`` (each read one ranged GET); store
    failures mid-read become ``EnvironmentFaultError`` (PyAV re-raises what its read callback raised)."""

    def __init__(self, f: Any, fault: Any) -> None:
        self._f, self._fault = f, fault
        self._size = f.size()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        try:
            return self._f.readinto(b)
        except FileNotFoundError as exc:
            raise self._fault(exc, missing=True) from None
        except OSError as exc:
            raise self._fault(exc) from None

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def close(self) -> None:
        if not self.closed:
            self._f.close()
        super().close()


class ObjectOpener:
    """Opens the objects of one bucket for reading, with the run's ``storage`` options; one
    pyarrow filesystem per opener (an ingest actor keeps one per bucket)."""

    def __init__(self, bucket: str, options: S3Options | None = None, *, block_bytes: int = BLOCK_BYTES) -> None:
        self.options = options or S3Options()
        self.bucket = bucket
        self.block_bytes = block_bytes
        self.fs = s3_filesystem(Location(bucket=bucket), self.options)
        self.endpoint = self.options.resolved_endpoint() or "the AWS S3 endpoint"

    def _fault(self, path: ObjectPath, exc: OSError, missing: bool = False) -> Exception:
        if missing or isinstance(exc, FileNotFoundError):
            return InputError("the object is gone (404); check the key, or re-upload it", source_uri=path.as_uri(),
                              stage="read", code=QuarantineReason.FILE_MISSING)
        m = _AWS_ERROR.search(str(exc))
        what = m.group(1) if m else type(exc).__name__
        if what in ("ACCESS_DENIED", "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH"):
            hint = "the credentials were refused; check the AWS credentials and that they may read this bucket"
        elif what in ("NETWORK_CONNECTION", "INTERNAL_FAILURE", "SERVICE_UNAVAILABLE"):
            hint = "cannot reach the object store; is the endpoint right and up?"
        else:
            hint = "the read failed after the retries"
        return EnvironmentFaultError(f"read {path.key} on {self.endpoint} (bucket {self.bucket}): {hint} ({what})")

    def open(self, path: ObjectPath, etag: str | None = None, *, block_bytes: int | None = None) -> io.BufferedReader:
        """A seekable, buffered binary reader of the object. ``etag``: the version discovery
        listed; another one now means that version is gone (``file_missing``)."""
        try:
            f = self.fs.open_input_file(f"{path.bucket}/{path.key}")
        except OSError as exc:
            raise self._fault(path, exc) from None
        if etag is not None:
            now = (f.metadata() or {}).get("ETag", b"").decode("ascii", "replace").strip('"')
            if now and now != etag.strip('"'):
                f.close()
                raise InputError("the object changed since it was listed (a new ETag); that version is gone, the "
                                 "new one is read by the next run or watch poll", source_uri=path.as_uri(),
                                 stage="read", code=QuarantineReason.FILE_MISSING)
        raw = _ArrowRaw(f, lambda exc, missing=False: self._fault(path, exc, missing))
        return io.BufferedReader(raw, buffer_size=block_bytes or self.block_bytes)

    def in_memory(self, path: ObjectPath, max_bytes: int, etag: str | None = None) -> MemoryFile:
        """The object copied into anonymous memory, hashed on the way; ``limit_exceeded`` over ``max_bytes``."""
        mem = MemoryFile("modalign-source")
        try:
            with self.open(path, etag) as f:
                mem.fill(iter(lambda: f.read(self.block_bytes), b""), max_bytes)
        except OverflowError:
            mem.close()
            raise LimitExceededError(
                f"the object is larger than ingest.max_object_memory_bytes={max_bytes}: a document on object "
                "storage is held in memory (never on disk) while its tools read it; raise the limit or split it",
                source_uri=path.as_uri(), stage="read", code=QuarantineReason.LIMIT_EXCEEDED) from None
        except BaseException:
            mem.close()
            raise
        return mem


def etag_of(version: str | None) -> str | None:
    """The ETag inside a version ``etag:<ETag>:<size>`` (None for other versions)."""
    if not version or not version.startswith("etag:"):
        return None
    return version[5:].rsplit(":", 1)[0]
