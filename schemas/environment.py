"""The environment variables modalign reads, read in this one place.

| variable | meaning | overridden by |
| --- | --- | --- |
| ``MODALIGN_KEY_STORE`` | pseudonym key vault folder (default ``~/.modalign/keys``) | ``key_store`` in the run config |
| ``RAY_TMPDIR`` | local Ray's session, log and spill folder (default ``<tmp>/modalign-ray-<uid>``, mode 0700) | ``runtime.ray_temp_dir`` |

Paths from either source get ``~`` expanded the same way, so a guard that checks a path
and the code that writes to it always mean the same folder.
"""

from __future__ import annotations

import os
from pathlib import Path

KEY_STORE_VAR = "MODALIGN_KEY_STORE"
RAY_TMPDIR_VAR = "RAY_TMPDIR"
DEFAULT_KEY_STORE = Path("~/.modalign/keys")


def _path(configured: Path | str | None, var: str, default: Path | None = None) -> Path | None:
    raw = configured if configured not in (None, "") else os.environ.get(var) or default
    return Path(raw).expanduser() if raw is not None else None


def key_store_dir(configured: Path | str | None = None) -> Path:
    """The key vault: the configured folder, else ``$MODALIGN_KEY_STORE``, else ``~/.modalign/keys``."""
    path = _path(configured, KEY_STORE_VAR, DEFAULT_KEY_STORE)
    assert path is not None
    return path


def ray_temp_dir(configured: Path | str | None = None) -> Path:
    """Local Ray's temp folder: the configured one, else ``$RAY_TMPDIR``, else a folder of this
    user's (``<tmp>/modalign-ray-<uid>``), created private (0700) so that no other user of the
    machine can read its session, logs, sockets or spilled objects (Ray's ``/tmp/ray`` is shared)."""
    import tempfile

    path = _path(configured, RAY_TMPDIR_VAR) or Path(tempfile.gettempdir()) / f"modalign-ray-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_uid == os.getuid():
        path.chmod(0o700)  # mkdir's mode is masked, and an older folder keeps its mode
    return path
