"""``modalign watch INPUT --out OUT``: continuous processing of the sessions that land in INPUT.

Where it sits: in front of the batch runner. The watch holds OUT's lease for its whole life
(heartbeat: a ``modalign run`` or a second watch into OUT meanwhile is refused), polls INPUT's
listing every ``interval_s`` (``modalign.pipeline.listing``), and hands the sessions that are
ready to ``Runner.run_sessions``: the same pipeline and the same commit protocol as ``run``,
one commit per batch of at most ``max_in_flight`` sessions (backpressure).

Ready: a session is ready when its manifest and every source it names exist and none of
their versions changed for ``settle_s`` (a file's settle time counts from its mtime, so
files older than that are ready at the first poll); a media file no manifest names is a
session of its own once it and the manifests beside or above it have settled.

Exactly once: pending = discovered - committed, recomputed after every commit. A session's
version is the set of (source URI, source version) pairs its run records; "committed" is
read from OUT's latest commit (its ``lineage_sources`` and ``quarantine`` rows), never from a
side file. So a restart after a crash redoes exactly the sessions whose commit is missing
(the runner sweeps what the dead attempt left: nothing of it was listed), and a source with
new bytes (a new stat version, an ETag for an object) makes its session pending again: the
next commit replaces the session whole. What stays of the old version: the OpenLineage
events in ``OUT/lineage/openlineage/`` (its run and session events with source versions and
sha256, append-only) and the last commit records, which list its files and run id.

Stopping: the first SIGTERM or SIGINT stops discovery and lets the batch in flight commit,
then exits 0; a second one abandons it (nothing of it is committed, its files are swept; the
next watch redoes it). SIGKILL loses nothing committed and duplicates nothing: see above.

Figures: lag (a session's commit time minus the time it became ready, or this watch
started, whichever is later; time waiting behind other sessions counts) and throughput, printed after each commit, every
``report_every_s`` and at exit, and kept in ``OUT/watch.json`` (a status file for people and
monitors; nothing reads it back).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
import uuid
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from modalign.pipeline.layout import OutputLayout
from modalign.pipeline.lease import Lease
from modalign.pipeline.listing import Candidate, Entry, Found, Listing, LocalListing, S3Listing, SourceVersion
from modalign.pipeline.metrics import Metrics
from modalign.pipeline.objstore import Location
from modalign.pipeline.progress import Display
from modalign.pipeline.runner import EXIT_FAILED, EXIT_OK, EXIT_QUARANTINED, Runner, init_ray
from modalign.schemas.config import RunConfig
from modalign.schemas.errors import ConfigError, ModalignError, OutputLockedError, QuarantineReason

log = logging.getLogger("modalign")

STATUS_FILE = "watch.json"  # in OUT, beside run.json
MAX_ATTEMPTS = 3  # tries of one session version before it is left (failed) until its version changes
RECENT = 200  # commits of sessions kept in the status file

Version = frozenset[SourceVersion]


def committed_versions(out: Path | str, storage: Any = None) -> dict[str, Version]:
    """Session id -> the (source URI, source version) pairs OUT's latest commit holds for it,
    from its lineage and quarantine rows (a source refused before reading has only the latter).
    OUT is a folder or ``s3://bucket/prefix`` (``storage``: the config's endpoint and retries)."""
    from modalign.pipeline.outputs import Output

    try:
        output = Output(out, storage)
    except ConfigError:  # no commit yet (or no folder)
        return {}
    pairs: dict[str, set[SourceVersion]] = defaultdict(set)
    cut_short: set[str] = set()  # a ``worker_failed`` row: the machine failed, not the input (see below)
    for name in ("lineage_sources", "quarantine"):
        columns = ["session_id", "source_uri", "source_version"] + (["reason_code"] if name == "quarantine" else [])
        t = output.table(name).to_table(columns=columns)
        for sid, uri, version, *reason in zip(*(t.column(c).to_pylist() for c in t.column_names)):
            pairs[sid].add((uri, version))
            if reason == [QuarantineReason.WORKER_FAILED.value]:
                cut_short.add(sid)
    # A session cut short by a dying worker is not committed: the watch redoes it (at most
    # MAX_ATTEMPTS times per version; then its partial commit stays, reported).
    return {sid: frozenset(p) for sid, p in pairs.items() if sid not in cut_short}


def _percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (None: no values)."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))]


def _iso(t: float | None) -> str | None:
    if t is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


class Watch:
    """One watch of ``listing`` into ``out``; ``run()`` until stopped (or, ``once``, until nothing is ready)."""

    def __init__(self, config: RunConfig, listing: Listing, out: Path, *, interval_s: float = 5.0,
                 settle_s: float = 10.0, max_in_flight: int = 1, once: bool = False,
                 progress: Callable[[str], None] | None = None, report_every_s: float = 60.0,
                 metrics: Metrics | None = None, lease_wait_s: float = 0.0, display: Display | None = None) -> None:
        """``display``: what shows each batch's progress (``pipeline.progress``; default none)."""
        if interval_s <= 0 or settle_s < 0 or max_in_flight < 1:
            raise ConfigError(f"watch: --interval must be > 0 (got {interval_s}), --settle >= 0 (got {settle_s}), "
                              f"--max-in-flight >= 1 (got {max_in_flight})")
        self.config = config
        self.listing = listing
        self.out: Path | str = OutputLayout.of(out, config.storage).where  # a folder or s3://bucket/prefix
        self.layout = OutputLayout.of(self.out, config.storage)
        self.interval_s, self.settle_s, self.max_in_flight, self.once = interval_s, settle_s, max_in_flight, once
        self.lease_wait_s = lease_wait_s  # a held lease: wait this long for it (a restarted watch), then refuse
        self.progress = progress or (lambda msg: log.info(msg))
        self.report_every_s = report_every_s
        self.metrics = metrics or Metrics()  # the CLI serves it (``--metrics-port``)
        self.display = display
        self.watch_id = uuid.uuid4().hex
        self.started_at = time.time()  # wall clock: compared with mtimes
        self._t0 = time.monotonic()  # durations
        self._wake = threading.Event()
        self._handle_signals = False
        self._signals = 0  # stop requests so far: 1 drains, 2 abandons
        self._said_waiting = False  # for OUT's lease
        self._runner: Runner | None = None
        self.pool: Any = None  # the ingest and embed actors, warm across batches (``actors.ActorPool``)
        self._lost: OutputLockedError | None = None
        self.seen: dict[str, tuple[str, float]] = {}  # key -> (version, stable since)
        self.failures: dict[tuple[str, Version], tuple[int, str]] = {}  # -> (attempts, last error)
        self.committed: dict[str, Version] = {}
        self.in_flight: list[str] = []
        self.max_seen_in_flight = 0
        self.lags: list[float] = []
        self.recent: deque[dict] = deque(maxlen=RECENT)
        self.totals: Counter = Counter()
        self.busy_s = 0.0
        self.recorded_s = 0.0
        self.exit_code = EXIT_OK
        self.quarantined: dict[str, bool] = {}  # session -> its latest accepted commit has quarantine rows
        self.view: dict[str, Any] = {}  # the last poll, as the status file shows it
        self._last_report = time.monotonic()

    # -- stopping ----------------------------------------------------------------------
    def stop(self, abandon: bool = False) -> None:
        """Stop after the batch in flight commits; with ``abandon`` (or a second call), without it."""
        self._signals = max(self._signals + 1, 2 if abandon else 1)
        self._wake.set()
        if self._signals >= 2 and self._runner is not None:
            self._runner._halt(KeyboardInterrupt())  # streams stop; nothing of the batch is committed

    def _on_signal(self, signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        msg = (f"modalign: {name}: stopping after the {len(self.in_flight)} session(s) in flight commit "
               f"(again to abandon them)\n" if self._signals == 0 else
               f"modalign: {name}: abandoning the session(s) in flight; the next watch redoes them\n")
        os.write(2, msg.encode())  # not print(): a signal handler may interrupt a print
        self.stop()

    def _waiting_for_lease(self, exc: OutputLockedError) -> None:
        if not self._said_waiting:
            self._said_waiting = True
            self.progress(f"watch: waiting up to {self.lease_wait_s:g} s for the lease: {exc.message}")

    def _lease_lost(self, exc: OutputLockedError) -> None:
        self._lost = exc
        if self._runner is not None:
            self._runner._halt(exc)
        self._wake.set()

    # -- the loop ----------------------------------------------------------------------
    def run(self, handle_signals: bool = False) -> dict:
        """Watch until stopped; returns the final status (``exit_code`` in it)."""
        Runner(self.config, self.out, self.progress)  # ConfigError (a key store inside OUT) before work
        self.layout.check_writable(self.config.runtime.min_free_mb * 2**20)
        saved = {}
        if handle_signals:
            saved = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        self._handle_signals = handle_signals
        try:
            with Lease(self.layout.store, self.watch_id, ttl_s=self.config.runtime.lease_ttl_s,
                       on_lost=self._lease_lost, writer="watch", wait_s=self.lease_wait_s,
                       on_wait=self._waiting_for_lease, cancel=self._wake) as lease:
                if lease.took_over is not None:
                    self.progress(f"took over the lease of OUT from {lease.took_over.holder}, which stopped")
                self.committed = committed_versions(self.out, self.config.storage)
                self.progress(f"watch {self.watch_id[:8]}: {self.listing.root} -> {self.out}, every "
                              f"{self.interval_s:g} s, settle {self.settle_s:g} s, at most {self.max_in_flight} "
                              f"session(s) in flight; {len(self.committed)} session(s) committed")
                self._loop(lease)
        finally:
            self._close_pool()
            for s, handler in saved.items():
                signal.signal(s, handler)
            self._write_status("stopped")
            self.progress(self._report_line("stopped"))
        if self._lost is not None:
            raise self._lost
        return self.status("stopped")

    def _close_pool(self) -> None:
        if self.pool is not None:
            try:
                self.pool.close()
            except Exception as exc:  # noqa: BLE001 - Ray already gone (a second signal): nothing to kill
                log.debug("closing the actor pool: %s", exc)
            self.pool = None

    def _loop(self, lease: Lease) -> None:
        while self._signals == 0 and self._lost is None:
            batch = self._next_batch(self._poll())
            self._write_status("processing" if batch else "watching")
            if batch:
                if self._process(lease, batch) or self.once:
                    continue  # more may be ready (a failed batch waits one interval before its retry)
                self._wake.wait(self.interval_s)
                continue
            if self.once:
                return
            if time.monotonic() - self._last_report >= self.report_every_s:
                self.progress(self._report_line("watching"))
                self._last_report = time.monotonic()
            self._wake.wait(self.interval_s)

    def _poll(self) -> list[tuple[Candidate, float]]:
        """List INPUT; returns the ready, pending sessions with the time each became ready."""
        found: Found = self.listing.sessions(self.listing.list(), tuple(self.config.ingest.allowed_roots))
        now = time.time()
        by_id: dict[str, list[Candidate]] = defaultdict(list)
        for c in found.candidates:
            by_id[c.session_id].append(c)
        problems = dict(found.problems)
        counts: Counter = Counter()
        ready: list[tuple[Candidate, float]] = []
        for sid, same in by_id.items():
            if len(same) > 1:
                where = ", ".join(c.origin for c in same)
                problems.update({c.origin: f"duplicate session id {sid} ({where})" for c in same})
                counts["duplicate"] += len(same)
                continue
            (c,) = same
            since = max((self._observe(k, e, now) for k, e in c.keys.items()), default=now)
            if self.committed.get(sid) == c.version:
                counts["committed"] += 1
                continue
            attempts, _error = self.failures.get((sid, c.version), (0, ""))
            if attempts >= MAX_ATTEMPTS:
                counts["failed"] += 1
            elif c.waiting_for:
                counts["waiting"] += 1
                problems.setdefault(c.origin, "waiting for " + ", ".join(c.waiting_for))
            elif now - since < self.settle_s:
                counts["settling"] += 1
            else:
                ready.append((c, max(self.started_at, since + self.settle_s)))
        counts["ready"] = len(ready)
        self.view = {"discovered": len(found.candidates), **{k: counts[k] for k in (
            "committed", "ready", "settling", "waiting", "failed", "duplicate")}, "problems": problems}
        live = {k for c in found.candidates for k in c.keys}
        for k in [k for k in self.seen if k not in live]:  # forget what is gone (memory stays bounded)
            del self.seen[k]
        self.metrics.listing(len(live), self.view)
        return ready

    def _observe(self, key: str, entry: Entry, now: float) -> float:
        """Since when ``key`` has had its current version."""
        seen = self.seen.get(key)
        if seen is None or seen[0] != entry.version:
            seen = (entry.version, min(now, entry.modified_at) if entry.modified_at is not None else now)
            self.seen[key] = seen
            self.metrics.objects_seen.inc()
        return seen[1]

    def _next_batch(self, ready: list[tuple[Candidate, float]]) -> list[tuple[Candidate, float]]:
        """The oldest ready sessions, at most ``max_in_flight``; a session that failed before runs alone."""
        ready.sort(key=lambda r: (r[1], r[0].session_id))
        retry = [r for r in ready if (r[0].session_id, r[0].version) in self.failures]
        return retry[:1] if retry else ready[:self.max_in_flight]

    def _ensure_ray(self) -> None:
        """Start (or join) Ray at the first batch: a watch with nothing to do never starts it."""
        import ray

        if ray.is_initialized():
            return
        init_ray(self.config.runtime)
        if self._handle_signals:  # Ray's init installed its own SIGTERM handler: ours again
            signal.signal(signal.SIGTERM, self._on_signal)

    def _process(self, lease: Lease, batch: list[tuple[Candidate, float]]) -> bool:
        """Run and commit one batch; False when it did not commit."""
        self._ensure_ray()
        if self.pool is None:
            from modalign.pipeline.actors import ActorPool

            self.pool = ActorPool()
        runner = Runner(self.config, self.out, self.progress, metrics=self.metrics, display=self.display,
                        pool=self.pool)
        self._runner = runner
        self.in_flight = [c.session_id for c, _ in batch]
        self.metrics.in_flight.set(len(batch))
        self.max_seen_in_flight = max(self.max_seen_in_flight, len(batch))
        started, t = time.time(), time.monotonic()
        self._write_status("processing")
        self.progress(f"watch: processing {', '.join(self.in_flight)}")
        try:
            summary = runner.run_sessions(lease, [c.session for c, _ in batch])
        except OutputLockedError as exc:
            self._lost = exc
            return False
        except KeyboardInterrupt:
            if self._signals < 2:
                raise  # not ours: an interrupt of a library caller
            self.totals["abandoned"] += len(batch)
            self.metrics.processed.labels("abandoned").inc(len(batch))
            self.progress(f"watch: abandoned {', '.join(self.in_flight)} (nothing of them committed)")
            self.exit_code = EXIT_FAILED
            return False
        except Exception as exc:  # noqa: BLE001 - one bad batch must not end the watch
            self._close_pool()  # its actors may still be busy with what failed: fresh ones for the next batch
            if self._lost is not None:
                return False
            message = exc.message if isinstance(exc, ModalignError) else f"{type(exc).__name__}: {exc}"
            log.debug("watch batch failed:\n%s", traceback.format_exc())
            for c, _ in batch:
                attempts = self.failures.get((c.session_id, c.version), (0, ""))[0] + 1
                self.failures[(c.session_id, c.version)] = (attempts, message)
                left = ("; left until one of its sources changes" if attempts >= MAX_ATTEMPTS
                        else "; it is retried alone")
                self.progress(f"watch: session {c.session_id} failed (attempt {attempts} of {MAX_ATTEMPTS}): "
                              f"{message}{left}")
            self.totals["failed_attempts"] += len(batch)
            self.metrics.processed.labels("failed").inc(len(batch))
            if self.once and all(self.failures[(c.session_id, c.version)][0] >= MAX_ATTEMPTS for c, _ in batch):
                self.exit_code = EXIT_FAILED
            return False
        finally:
            self._runner = None
            self.in_flight = []
            self.metrics.in_flight.set(0)
            self.busy_s += time.monotonic() - t
            self.metrics.batch_seconds.observe(time.monotonic() - t)
        committed_at = time.time()
        self.committed = committed_versions(self.out, self.config.storage)
        version = runner.committed.version if runner.committed else None
        self.totals["batches"] += 1
        self.recorded_s += summary["counts"]["ticks"] / self.config.align.tick_hz
        with_rows = {st.session.manifest.session_id: bool(st.quarantine) for st in runner.states}
        if self.view:  # the last poll's counts, as they are now
            self.view["ready"] -= len(batch)
            self.view["committed"] += sum(self.committed.get(c.session_id) == c.version for c, _ in batch)
        for c, ready_at in batch:
            if c.session_id in self.committed:
                self.failures.pop((c.session_id, c.version), None)
            elif not self._cut_short(c):  # redone: not committed yet
                continue
            self.quarantined[c.session_id] = with_rows.get(c.session_id, False)
            lag = committed_at - ready_at
            self.lags.append(lag)
            self.metrics.lag.observe(lag)
            self.metrics.processed.labels("committed").inc()
            self.totals["sessions"] += 1
            changed = self.committed.get(c.session_id) != c.version  # a source changed during the run
            self.recent.append({"session_id": c.session_id, "commit": version, "batch": self.totals["batches"],
                                "run_id": runner.run_id, "ready_at": _iso(ready_at), "started_at": _iso(started),
                                "committed_at": _iso(committed_at), "lag_s": round(lag, 3),
                                "sources": len(c.session.manifest.sources), "changed_meanwhile": changed})
        if self.exit_code != EXIT_FAILED:  # 3 while a session's accepted commit holds quarantine rows: a
            # session cut short by a dying worker and then redone whole no longer counts
            self.exit_code = EXIT_QUARANTINED if any(self.quarantined.values()) else EXIT_OK
        self.progress(f"watch: commit {version}: {', '.join(c.session_id for c, _ in batch)} "
                      f"(lag {', '.join(f'{committed_at - r:.1f} s' for _, r in batch)}); " + self._figures_text())
        self._last_report = time.monotonic()
        return True

    def _cut_short(self, c: Candidate) -> bool:
        """After a commit that left ``c`` cut short by a dying worker: count an attempt; True
        when it was its last (the partial commit stays; the watch does not redo it)."""
        key = (c.session_id, c.version)
        attempts = self.failures.get(key, (0, ""))[0] + 1
        last = attempts >= MAX_ATTEMPTS
        message = "an ingest worker died while processing it (worker_failed)"
        self.failures[key] = (attempts, message)
        self.progress(f"watch: session {c.session_id} was cut short by a dying worker (attempt {attempts} of "
                      f"{MAX_ATTEMPTS}); " + ("its partial commit stays: see its quarantine rows" if last
                                              else "it is redone"))
        return last

    # -- figures -----------------------------------------------------------------------
    def figures(self) -> dict:
        uptime = time.monotonic() - self._t0
        n = self.totals["sessions"]
        return {
            "sessions_committed": n,
            "batches": self.totals["batches"],
            "failed_attempts": self.totals["failed_attempts"],
            "abandoned": self.totals["abandoned"],
            "lag_s": {"last": round(self.lags[-1], 3) if self.lags else None,
                      **{f"p{q}": (round(v, 3) if (v := _percentile(self.lags, q)) is not None else None)
                         for q in (50, 95)},
                      "max": round(max(self.lags), 3) if self.lags else None},
            "throughput": {"sessions_per_min": round(n / uptime * 60, 3) if uptime > 0 else None,
                           "sessions_per_busy_min": round(n / self.busy_s * 60, 3) if self.busy_s > 0 else None,
                           "recorded_s_per_busy_s": round(self.recorded_s / self.busy_s, 3) if self.busy_s else None,
                           "busy_share": round(self.busy_s / uptime, 3) if uptime > 0 else None},
            "uptime_s": round(uptime, 1),
            "busy_s": round(self.busy_s, 1),
            "recorded_s": round(self.recorded_s, 1),
        }

    def _figures_text(self) -> str:
        f = self.figures()
        lag, tp = f["lag_s"], f["throughput"]
        text = f"{f['sessions_committed']} session(s) committed in {f['uptime_s']:.0f} s"
        if lag["p50"] is not None:
            text += (f", lag p50 {lag['p50']:.1f} s p95 {lag['p95']:.1f} s max {lag['max']:.1f} s, "
                     f"{tp['sessions_per_busy_min']:.2f} sessions/min busy "
                     f"({tp['recorded_s_per_busy_s']:.2f} s recorded per s)")
        return text

    def _report_line(self, state: str) -> str:
        v = self.view
        waiting = ", ".join(f"{v[k]} {k}" for k in ("ready", "settling", "waiting", "failed", "duplicate")
                            if v.get(k))
        return (f"watch {state}: {v.get('discovered', 0)} session(s) in {self.listing.root}"
                f"{' (' + waiting + ')' if waiting else ''}; " + self._figures_text())

    def status(self, state: str) -> dict:
        return {
            "watch_id": self.watch_id, "pid": os.getpid(), "state": state, "input": self.listing.root,
            "out": str(self.out), "started_at": _iso(self.started_at), "updated_at": _iso(time.time()),
            "options": {"interval_s": self.interval_s, "settle_s": self.settle_s,
                        "max_in_flight": self.max_in_flight, "once": self.once},
            "sessions": {k: v for k, v in self.view.items() if k != "problems"},
            "problems": self.view.get("problems", {}),
            "in_flight": list(self.in_flight),
            "max_seen_in_flight": self.max_seen_in_flight,
            "failed": [{"session_id": sid, "attempts": a, "error": e} for (sid, _v), (a, e) in self.failures.items()],
            **self.figures(),
            "recent": list(self.recent),
            "exit_code": self.exit_code,
        }

    def _write_status(self, state: str) -> None:
        path = self.layout.path(STATUS_FILE)
        try:
            self.layout.write_json(path, self.status(state))
        except (OSError, ModalignError) as exc:  # a status file must never stop the watch (S3: EnvironmentFaultError)
            log.warning("could not write %s: %s", self.layout.uri_of(path), exc)


def watch(input_path: str | os.PathLike, out: str | os.PathLike, config: Any = None, **options: Any) -> dict:
    """``modalign watch`` over a local folder or ``s3://bucket/prefix`` (see ``Watch``); returns the final status."""
    from modalign.pipeline.runner import resolve_config

    cfg = resolve_config(config)
    out = out if isinstance(out, str) else Path(out)  # a folder, or s3://bucket/prefix
    return Watch(cfg, listing_for(input_path, out, cfg), out, **options).run()


def listing_for(input_path: str | os.PathLike, out: Path | str, config: RunConfig) -> Listing:
    """The listing a watch polls: ``S3Listing`` for ``s3://bucket/prefix`` (the config's
    ``storage`` endpoint and retries), else ``local_listing``."""
    from modalign.pipeline.objstore import S3Options

    location = Location.parse(input_path if isinstance(input_path, str) else Path(input_path))
    if not location.is_s3:
        return local_listing(Path(input_path), out)
    out_location = Location.parse(out if isinstance(out, str) else Path(out))
    if out_location.is_s3 and out_location.bucket == location.bucket and (
            not location.prefix or out_location.prefix == location.prefix
            or out_location.prefix.startswith(location.prefix + "/")):
        raise ConfigError(f"watch: OUT {out_location.uri} is inside the watched prefix {location.uri}; the watch "
                          "would read its own outputs: put OUT elsewhere")
    return S3Listing(location, S3Options.from_config(config.storage))


def local_listing(input_path: Path, out: Path | str) -> LocalListing:
    """The listing of a local INPUT folder; ConfigError for anything else."""
    input_path = Path(input_path).absolute()
    if not input_path.is_dir():
        raise ConfigError(f"watch: input {input_path} is not a folder (watch a folder; `modalign run` takes a "
                          "manifest or a file)")
    if not Location.parse(out if isinstance(out, str) else Path(out)).is_s3 and \
            Path(out).absolute().resolve().is_relative_to(input_path.resolve()):
        raise ConfigError(f"watch: the output folder {out} is inside the watched folder {input_path}; "
                          "the watch would read its own outputs: put OUT elsewhere")
    return LocalListing(input_path)
