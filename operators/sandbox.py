"""A memory and time ceiling for the external tools operators run (poppler, tesseract).

Used by the PDF ingest (``modalign.operators.ingest.pdf``: pdfinfo, pdftoppm, pdftotext,
tesseract) and the frame-text de-identification (``modalign.operators.deid.frame_text``:
tesseract on video frames). A hostile input must not take the worker down: every tool runs
under an address-space ceiling (RLIMIT_AS) and a timeout, and a failure that looks like the
ceiling refusing an allocation is told apart from other failures (``out_of_memory``).

A source held in memory (``schemas.files.MemoryFile``, an object-store source) is named by
``/proc/self/fd/N``: that fd is passed to the tool (only it; every other fd stays closed), so
the tool's ``/proc/self/fd/N`` is the same in-memory file.
"""

from __future__ import annotations

import os
import re
import subprocess

_FD_PATH = re.compile(r"^/proc/self/fd/(\d+)$")

# What poppler / tesseract / the loader print when an allocation fails under RLIMIT_AS.
OOM_MARKERS = (b"out of memory", b"bad_alloc", b"cannot allocate memory", b"failed to map segment",
               b"memory exhausted", b"failed to allocate")


def run_limited(cmd: list[str], *, timeout: float, memory_mb: int, input: bytes | None = None,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` with stdout/stderr captured, under RLIMIT_AS = ``memory_mb`` and a timeout.

    The limit is set by ``sh -c 'ulimit -v'`` which then ``exec``s the tool (same pid, so a
    timeout kills the tool itself); unlike ``preexec_fn`` this is safe with threads. An
    argument ``/proc/self/fd/N`` passes fd N on (see the module docstring).
    Raises ``subprocess.TimeoutExpired``."""
    fds = tuple(int(m.group(1)) for a in cmd if (m := _FD_PATH.match(str(a))))
    if os.name == "posix" and os.path.exists("/bin/sh"):
        cmd = ["/bin/sh", "-c", 'ulimit -v "$1" 2>/dev/null; shift; exec "$@"', "sh",
               str(int(memory_mb) * 1024), *cmd]
    return subprocess.run(cmd, input=input, capture_output=True, timeout=timeout, env=env, pass_fds=fds)


def out_of_memory(proc: subprocess.CompletedProcess) -> bool:
    """Whether a tool's failure looks like an allocation refused by the memory ceiling."""
    err = (proc.stderr or b"").lower()
    return any(m in err for m in OOM_MARKERS)
