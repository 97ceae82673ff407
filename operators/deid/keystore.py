"""Pseudonym key vault: one secret per tenant, kept outside every output folder.

Text pseudonyms (``modalign.operators.deid.text``) are ``HMAC-SHA256(tenant key, entity)``: the same
person maps to the same token within a tenant and to unrelated tokens across tenants.
Deleting a tenant's key (``modalign lineage erase`` -> ``KeyStore.delete``) is
crypto-shredding: pseudonyms already written can no longer be linked to anyone, nor to
new pseudonyms, which are derived from a fresh key.

Layout: ``<root>/<tenant>.key`` holds 32 raw random bytes, file mode 0600, root dir 0700.
The root defaults to ``~/.modalign/keys`` (``$MODALIGN_KEY_STORE`` or the ``root``
argument override it) and must never sit inside an output folder.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from pathlib import Path

from modalign.schemas.environment import key_store_dir
from modalign.schemas.errors import ComplianceError, ConfigError

KEY_BYTES = 32
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def validate_tenant(tenant: str) -> str:
    """A tenant name is a plain file stem: letters, digits, ``_ . -``, no path parts."""
    if not isinstance(tenant, str) or not _TENANT.fullmatch(tenant) or ".." in tenant:
        raise ConfigError(
            "invalid tenant name: use 1-128 letters, digits, '_', '.', '-' (starting with a letter "
            "or digit, no '..')"
        )
    return tenant


class KeyStore:
    """File-backed vault of 32-byte tenant secrets.

    Creation is race-free across processes (write a private temp file, then ``os.link`` it
    into place, which fails if another process won): every caller sees the same key.
    """

    def __init__(self, root: Path | str | None = None) -> None:
        self.root = key_store_dir(root)

    def _path(self, tenant: str) -> Path:
        return self.root / f"{validate_tenant(tenant)}.key"

    def _ensure_root(self) -> None:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        # mkdir's mode is filtered by the umask, and exist_ok keeps an older mode: enforce it.
        if stat.S_IMODE(self.root.stat().st_mode) != 0o700:
            os.chmod(self.root, 0o700)

    def exists(self, tenant: str) -> bool:
        return self._path(tenant).is_file()

    def key(self, tenant: str) -> bytes:
        """The tenant's secret, created (os.urandom, 0600) on first use."""
        path = self._path(tenant)
        try:
            return self._read(path, tenant)
        except FileNotFoundError:
            pass
        self._ensure_root()
        fd, tmp = _private_tempfile(self.root, tenant)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(KEY_BYTES))
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # atomic create-if-absent
            except FileExistsError:
                pass  # another process created it first: use theirs
            except OSError:
                # filesystems without hard links: rename (atomic, but last writer wins a race)
                if not path.exists():
                    os.replace(tmp, path)
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        _fsync_dir(self.root)
        return self._read(path, tenant)

    def delete(self, tenant: str) -> bool:
        """Remove the tenant's key (crypto-shredding); True if a key was removed."""
        path = self._path(tenant)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        _fsync_dir(self.root)
        return True

    def tenants(self) -> list[str]:
        """Tenants that currently hold a key, sorted."""
        if not self.root.is_dir():
            return []
        return sorted(p.stem for p in self.root.glob("*.key") if _TENANT.fullmatch(p.stem))

    @staticmethod
    def _read(path: Path, tenant: str) -> bytes:
        data = path.read_bytes()
        if len(data) != KEY_BYTES:
            raise ComplianceError(
                f"pseudonym key of tenant {tenant!r} at {path} is corrupt ({len(data)} bytes, expected "
                f"{KEY_BYTES}); restore it from backup, or delete it to start new pseudonyms",
                stage="keystore",
            )
        return data


def _private_tempfile(root: Path, tenant: str) -> tuple[int, str]:
    name = root / f".{tenant}.{secrets.token_hex(8)}.tmp"
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    return fd, str(name)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
