"""The few storage operations the commit log and the lease need (``Store``), on a local folder.

Each maps to one object-store call, so ``S3Store`` (``pipeline/objstore.py``: conditional
writes with ``If-None-Match``) is a drop-in for object storage:

| here | S3 |
| --- | --- |
| ``create(key, data)``: write only if absent, all or nothing | ``PUT`` with ``If-None-Match: *`` (412 when it exists) |
| ``put(key, data)``: replace atomically | ``PUT`` |
| ``get(key)`` | ``GET`` (None on 404) |
| ``list(prefix)`` | ``ListObjectsV2`` |
| ``delete(key)`` | ``DELETE`` |

On a local folder ``create`` writes a fsynced temporary file and hard-links it to the key
(``link`` fails when the name exists, atomically on every POSIX file system), then fsyncs
the folder, so a created key survives a crash and is never seen half-written.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path
from typing import Protocol

from modalign.schemas.files import atomic_write, fsync_dir, sha256_file


class Store(Protocol):
    """What the commit log, the lease and ``Sequence`` use of a store; keys are ``/``-separated
    and relative to the store's root."""

    @property
    def root(self) -> Path | str:
        """What messages name the store by (a folder, or ``s3://bucket/prefix``)."""
        ...

    @property
    def local(self) -> bool:
        """True for a folder of this machine: a lease holder's pid on this host can be checked."""
        ...

    def create(self, key: str, data: bytes) -> bool: ...

    def put(self, key: str, data: bytes) -> None: ...

    def get(self, key: str) -> bytes | None: ...

    def list(self, prefix: str) -> list[str]: ...

    def delete(self, key: str) -> None: ...

    def digest(self, key: str) -> str | None:
        """``sha256:<hex>`` of ``key``'s bytes (None: absent, or the store cannot tell without a download)."""
        ...


class LocalStore:
    """Keys are ``/``-separated paths relative to ``root``."""

    local = True

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    def path(self, key: str) -> Path:
        return self.root / key

    def create(self, key: str, data: bytes) -> bool:
        """Write ``key`` only if it does not exist; False (nothing written) when it does."""
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(path.parent)
        return True

    def put(self, key: str, data: bytes) -> None:
        """Replace ``key`` atomically (readers see the old or the new bytes)."""
        path = atomic_write(self.path(key), lambda tmp: Path(tmp).write_bytes(data))
        fsync_dir(path.parent)

    def get(self, key: str) -> bytes | None:
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            return None

    def list(self, prefix: str) -> list[str]:
        """Keys of the files directly under the folder ``prefix``, sorted (temporary files left out)."""
        folder = self.path(prefix)
        if not folder.is_dir():
            return []
        return sorted(f"{prefix}/{p.name}" for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def digest(self, key: str) -> str | None:
        try:
            return "sha256:" + sha256_file(self.path(key))
        except FileNotFoundError:
            return None


class Sequence:
    """Numbered records under one prefix of a store, ``PREFIX/<letter><n:020d>.json``: the commit
    log's versions and the lease's generations. A record is created write-if-absent, so of two
    writers that both want number ``n`` exactly one gets it."""

    def __init__(self, store: Store, prefix: str, letter: str) -> None:
        self.store, self.prefix, self.letter = store, prefix, letter
        self._name = re.compile(rf"{re.escape(letter)}([0-9]{{20}})\.json")

    def key(self, n: int) -> str:
        return f"{self.prefix}/{self.letter}{n:020d}.json"

    def numbers(self) -> list[int]:
        """The numbers present, ascending."""
        return sorted(int(m.group(1)) for k in self.store.list(self.prefix)
                      if (m := self._name.fullmatch(k.rsplit("/", 1)[-1])))
