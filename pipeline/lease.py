"""One writer per output folder: a lease with a holder id, a heartbeat and stale takeover.

The lease is a sequence of generation records, ``OUT/_modalign/lease/NAME/g<generation>.json``,
each created with write-if-absent (``LocalStore.create``; ``If-None-Match: *`` on an object
store), so of two writers racing for the next generation exactly one wins::

    acquire:   read the newest record; if it is live (heartbeat younger than its ttl, and on
               this host its process still runs), refuse with OutputLockedError naming it;
               otherwise (none, released or stale) create generation + 1.
    heartbeat: every ttl / 3 the holder rewrites its own record, after checking that it is
               still the newest: a holder that was taken over learns it and stops.
    release:   mark the record released (generations never repeat, so a paused old holder
               can never mistake a new holder's record for its own).

``check()`` is the fence a writer calls right before it commits. Staleness is judged on
the heartbeat's wall-clock time, so the machines sharing a folder need roughly synchronised
clocks (well within the ttl). On a local folder (``Store.local``) a holder on this host that
died is taken over at once; on object storage there is no shared pid space (a pod's pid 1 is
every pod's), so staleness comes from the heartbeat's age alone. The store's ``create`` is the
only arbiter either way (``S3Store`` refuses a server that ignores ``If-None-Match``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace

from modalign.pipeline.store import Sequence, Store
from modalign.schemas.errors import EnvironmentFaultError, OutputLockedError

log = logging.getLogger(__name__)

LEASE_PREFIX = "_modalign/lease"
DEFAULT_TTL_S = 30.0


@dataclass(frozen=True)
class LeaseRecord:
    generation: int
    run_id: str
    host: str
    pid: int
    acquired_at: float
    heartbeat_at: float
    ttl_s: float
    released: bool = False
    writer: str = "run"  # what holds it: run, watch, erasure, cache gc (for the messages)
    swept: bool = False  # released by a writer that left OUT holding exactly the files of its commit

    @property
    def holder(self) -> str:
        return f"{self.writer} {self.run_id[:12]} (pid {self.pid} on {self.host})"

    def stale(self, now: float, *, check_pid: bool = True) -> bool:
        """Released, or its heartbeat older than its ttl; with ``check_pid`` (a local folder),
        also a holder on this host whose process is gone."""
        if self.released or now - self.heartbeat_at > self.ttl_s:
            return True
        return check_pid and self.host == socket.gethostname() and not _pid_alive(self.pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


class Lease:
    """The lease ``name`` of the folder ``store`` serves; use as a context manager."""

    def __init__(self, store: Store, run_id: str, *, ttl_s: float = DEFAULT_TTL_S, name: str = "out",
                 on_lost: Callable[[OutputLockedError], None] | None = None, writer: str = "run",
                 wait_s: float = 0.0, on_wait: Callable[[OutputLockedError], None] | None = None,
                 cancel: threading.Event | None = None) -> None:
        """``wait_s``: how long ``acquire`` waits for a held lease to be released or to go stale
        (``on_wait`` is told each time it finds it held; ``cancel`` set ends the wait), instead
        of raising at once: a watch restarted after a kill outlives its own dead lease."""
        self.store = store
        self.wait_s, self.on_wait, self.cancel = wait_s, on_wait, cancel
        self.run_id = run_id
        self.writer = writer
        self.ttl_s = ttl_s
        self.records = Sequence(store, f"{LEASE_PREFIX}/{name}", "g")
        self.name = name
        self.on_lost = on_lost
        self.record: LeaseRecord | None = None
        self.took_over: LeaseRecord | None = None  # the stale record this lease replaced
        # Whether OUT holds exactly the files of its latest commit, as far as this holder knows:
        # at first, whether the previous holder said so when it released; a writer sets it False
        # before it writes and True once its own sweep is done. True: the holder may skip the
        # walk of OUT for what a crashed writer left.
        self.swept = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- records ---------------------------------------------------------------------------
    def _key(self, generation: int) -> str:
        return self.records.key(generation)

    def current(self) -> LeaseRecord | None:
        """The newest record (None: the folder never had a writer)."""
        for generation in reversed(self.records.numbers()):
            data = self.store.get(self._key(generation))
            if data is not None:
                raw = json.loads(data)  # fields a later version adds are left out
                return LeaseRecord(**{f.name: raw[f.name] for f in fields(LeaseRecord) if f.name in raw})
        return None

    # -- life cycle ------------------------------------------------------------------------
    def acquire(self) -> "Lease":
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                return self._acquire_once()
            except OutputLockedError as exc:
                left = deadline - time.monotonic()
                if left <= 0 or (self.cancel is not None and self.cancel.is_set()):
                    raise
                if self.on_wait is not None:
                    self.on_wait(exc)
                (self.cancel or threading.Event()).wait(min(left, 2.0))

    def _acquire_once(self) -> "Lease":
        for _ in range(5):  # lose a race for a generation a few times at most
            now = time.time()
            cur = self.current()
            if cur is not None and not cur.stale(now, check_pid=self.store.local):
                raise OutputLockedError(
                    f"{self.store.root} is being written by {cur.holder}, its heartbeat "
                    f"{max(0.0, now - cur.heartbeat_at):.0f} s ago: wait for it to finish; a dead holder's lease "
                    f"is taken over once its heartbeat is {cur.ttl_s:.0f} s old")
            rec = LeaseRecord(generation=(cur.generation if cur else 0) + 1, run_id=self.run_id,
                              host=socket.gethostname(), pid=os.getpid(), acquired_at=now, heartbeat_at=now,
                              ttl_s=self.ttl_s, writer=self.writer)
            if self.store.create(self._key(rec.generation), json.dumps(asdict(rec)).encode()):
                self.record, self.took_over = rec, (cur if cur is not None and not cur.released else None)
                self.swept = cur is not None and cur.released and cur.swept
                for old in self.records.numbers():
                    if old < rec.generation:
                        self.store.delete(self._key(old))
                return self
        raise OutputLockedError(f"{self.store.root}: other writers keep taking its lease; try again")

    def check(self) -> None:
        """Raise OutputLockedError unless this lease is still the folder's newest, live record."""
        cur = self.current()
        if self.record is None or cur is None or cur.generation != self.record.generation \
                or cur.run_id != self.run_id:
            holder = cur.holder if cur is not None else "nobody"
            raise OutputLockedError(f"this run lost the lease of {self.store.root} to {holder} (its heartbeat "
                                    "stopped for longer than the lease ttl); nothing more was committed")

    def heartbeat(self) -> None:
        self.check()
        assert self.record is not None
        self.record = replace(self.record, heartbeat_at=time.time())
        self.store.put(self._key(self.record.generation), json.dumps(asdict(self.record)).encode())

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.record is None:
            return
        try:
            self.check()
        except OutputLockedError:
            return  # taken over: the record is someone else's now
        try:
            self.store.put(self._key(self.record.generation),
                           json.dumps(asdict(replace(self.record, released=True, swept=self.swept))).encode())
        except OSError as exc:  # OUT full, read-only or failing: the record stays live until its ttl
            raise EnvironmentFaultError(
                f"cannot release the lease of {self.name!r} ({exc}); it expires {self.ttl_s:g} s after its last "
                "heartbeat, then another writer may take OUT") from exc
        self.record = None

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.heartbeat()
            except OutputLockedError as exc:
                log.error("%s", exc)
                if self.on_lost is not None:
                    self.on_lost(exc)
                return
            except (OSError, EnvironmentFaultError) as exc:  # the store failed: the next beat retries
                log.warning("lease heartbeat failed: %s", exc)

    def __enter__(self) -> "Lease":
        self.acquire()
        self._thread = threading.Thread(target=self._beat, name="modalign-lease", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.release()
            return
        try:  # the error that ended the work is the one to report, not a release it made impossible
            self.release()
        except (OSError, EnvironmentFaultError) as err:
            log.warning("%s", getattr(err, "message", err))
