"""What a person watching a run sees: rich progress bars on a terminal, plain lines otherwise.

Where it sits: on the driver, beside ``pipeline.metrics``. The runner feeds it from the items it
routes (``pipeline.items``: a ``SourceItem`` opens a stream, each ``MetaItem`` advances it, a
``DoneItem`` or a dead worker ends it) and from the embedder's and aligners' results, so the
workers' progress arrives through the item stream that carries their work; no file is polled.

Three renderings of one ``RunProgress`` state, chosen by ``make_display``:

- ``RichDisplay``, when the stream it draws on (stderr) is a terminal: bars for the sources
  (discovered, done, quarantined), the media seconds with an ETA, the embedding batches, the
  sessions aligned, and one bar per source stream in flight (frames, seconds of audio, pages);
  messages print above the bars.
- ``PlainDisplay``, otherwise (a pipe, a log file, CI): a ``progress:`` line at most every
  ``every_s`` seconds and one when the run ends, messages as ``modalign: ...`` lines; no
  terminal control codes.
- ``JsonDisplay`` (``--log-format json``): every message and progress line as one JSON object
  per line (``ts``, ``level``, ``event``: ``message`` | ``progress``, and the fields).

``Display`` itself shows nothing (``--quiet``): messages below ``warning`` are dropped.

Nothing personal is shown: source ids, modalities, counts and times; never a file's content.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import IO, Any

MEDIA = ("video", "audio")  # modalities whose progress is measured in seconds of the recording
LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}


@dataclass
class StreamProgress:
    """One source, or one range of a video, as it streams from its worker."""

    key: str
    modality: str
    end_ns: int | None = None  # where the recording (or range) ends on the session clock, if known
    start_ns: int | None = None  # the first event's session time
    reached_ns: int | None = None  # the latest event's session time
    events: int = 0
    pages: set[int] = field(default_factory=set)  # documents: distinct page start times
    done: bool = False
    planned_s: float | None = None  # its length as planned before it started (a video's range)
    opened: bool = False  # its worker has started it (a planned range has not, yet)

    @property
    def total_s(self) -> float | None:
        if self.modality not in MEDIA:
            return None
        if self.end_ns is None or self.start_ns is None:
            return self.planned_s
        return max(0.0, (self.end_ns - self.start_ns) / 1e9)

    @property
    def done_s(self) -> float:
        if self.start_ns is None or self.reached_ns is None:
            return 0.0
        done = (self.reached_ns - self.start_ns) / 1e9
        total = self.total_s
        return total if self.done and total is not None else max(0.0, min(done, total if total is not None else done))

    def amount(self) -> str:
        """What has arrived, in the modality's unit: frames, seconds of audio, pages."""
        if self.modality == "video":
            return f"{self.events} frames"
        if self.modality == "audio":
            return f"{self.done_s:.1f} s audio"
        if self.modality == "pdf":
            return f"{len(self.pages)} pages"
        return f"{self.events} events"


class RunProgress:
    """The state of one run (or one watch batch) as the driver learns it; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset(0, 0)

    def reset(self, sessions: int, sources: int, quarantined: int = 0) -> None:
        with self._lock:
            self.started = time.monotonic()
            self.sessions, self.aligned = sessions, 0
            self.sources = sources
            self.statuses: Counter = Counter(quarantined=quarantined)  # sources done, by lineage status
            self.quarantine_rows = quarantined
            self.streams: dict[str, StreamProgress] = {}
            self.embed_submitted = self.embed_done = 0
            self.stage = "starting"  # the actors and their models; then ingest, align, commit
            self.first_media_at: float | None = None

    # -- fed by the runner ------------------------------------------------------------------
    def plan(self, key: str, modality: str, seconds: float) -> StreamProgress:
        """A stream known before it starts (the ranges of a cut video), so the total counts it."""
        with self._lock:
            s = self.streams.setdefault(key, StreamProgress(key, modality))
            s.planned_s = seconds
            return s

    def open(self, key: str, modality: str, end_ns: int | None) -> StreamProgress:
        with self._lock:
            s = self.streams.setdefault(key, StreamProgress(key, modality))
            s.end_ns = end_ns
            s.opened = True
            return s

    def advance(self, key: str, modality: str, events: int, t_min_ns: int | None, t_max_ns: int | None,
                starts: list[int] | None = None) -> StreamProgress:
        with self._lock:
            s = self.streams.setdefault(key, StreamProgress(key, modality))
            s.opened = True
            s.events += events
            if t_min_ns is not None:
                s.start_ns = t_min_ns if s.start_ns is None else min(s.start_ns, t_min_ns)
                s.reached_ns = t_max_ns if s.reached_ns is None else max(s.reached_ns, t_max_ns)
                if modality in MEDIA and self.first_media_at is None:
                    self.first_media_at = time.monotonic()
            if starts:
                s.pages.update(starts)
            return s

    def close_stream(self, key: str) -> StreamProgress | None:
        with self._lock:
            s = self.streams.get(key)
            if s is not None:
                s.done = True
            return s

    def source_done(self, status: str) -> None:
        with self._lock:
            self.statuses[status] += 1

    def quarantine(self) -> None:
        with self._lock:
            self.quarantine_rows += 1

    def embed(self, submitted: int = 0, done: int = 0) -> None:
        with self._lock:
            self.embed_submitted += submitted
            self.embed_done += done

    def session_aligned(self) -> None:
        with self._lock:
            self.aligned += 1

    def at_stage(self, stage: str) -> None:
        with self._lock:
            self.stage = stage

    # -- read by the displays ---------------------------------------------------------------
    def media(self) -> tuple[float, float]:
        """(seconds of recordings ingested, of those whose length is known)."""
        done = total = 0.0
        for s in list(self.streams.values()):
            if s.total_s is not None:
                done, total = done + s.done_s, total + s.total_s
        return done, total

    def eta_s(self) -> float | None:
        """Seconds left for the recordings, at the rate so far (None until it can be estimated)."""
        done, total = self.media()
        if self.first_media_at is None or done <= 0 or total <= done:
            return 0.0 if total and done >= total else None
        return (time.monotonic() - self.first_media_at) * (total - done) / done

    def snapshot(self) -> dict[str, Any]:
        """Every figure of the run so far (what the plain and JSON lines print)."""
        with self._lock:
            done, total = self.media()
            units: dict[str, float] = {"frames": 0, "audio_s": 0.0, "pages": 0}
            for s in self.streams.values():
                if s.modality == "video":
                    units["frames"] += s.events
                elif s.modality == "audio":
                    units["audio_s"] += s.done_s
                elif s.modality == "pdf":
                    units["pages"] += len(s.pages)
            eta = self.eta_s()
            return {"stage": self.stage, "elapsed_s": round(time.monotonic() - self.started, 1),
                    "sources": self.sources, "sources_done": sum(self.statuses.values()),
                    "ingested": self.statuses["ingested"] + self.statuses["no_stream"],
                    "partial": self.statuses["partial"], "quarantined": self.statuses["quarantined"],
                    "quarantine_rows": self.quarantine_rows,
                    "media_s": round(done, 1), "media_total_s": round(total, 1),
                    "frames": int(units["frames"]), "audio_s": round(units["audio_s"], 1),
                    "pages": int(units["pages"]), "embed_batches": self.embed_submitted,
                    "embed_done": self.embed_done, "sessions": self.sessions, "sessions_aligned": self.aligned,
                    "eta_s": None if eta is None else round(eta, 1),
                    "streams": sorted(k for k, s in self.streams.items() if s.opened and not s.done)}


class Display:
    """The quiet display: shows no progress and no message below ``warning``.

    The runner calls the methods below; subclasses draw the state they keep in ``self.state``."""

    def __init__(self) -> None:
        self.state = RunProgress()

    # messages (what the runner and the watch say as they go)
    def message(self, msg: str, level: str = "info") -> None:
        if LEVELS.get(level, 20) >= LEVELS["warning"]:
            print(f"modalign: {msg}", file=sys.stderr, flush=True)

    # progress
    def run_started(self, sessions: int, sources: int, quarantined: int = 0) -> None:
        self.state.reset(sessions, sources, quarantined)
        self._changed(force=True)

    def stream_planned(self, key: str, modality: str, seconds: float) -> None:
        self.state.plan(key, modality, seconds)
        self._changed()

    def stream_started(self, key: str, modality: str, end_ns: int | None) -> None:
        self.state.open(key, modality, end_ns)
        self._changed()

    def stream_advanced(self, key: str, modality: str, events: int, t_min_ns: int | None, t_max_ns: int | None,
                        starts: list[int] | None = None) -> None:
        self.state.advance(key, modality, events, t_min_ns, t_max_ns, starts)
        self._changed()

    def stream_done(self, key: str) -> None:
        self.state.close_stream(key)
        self._changed()

    def source_done(self, status: str) -> None:
        """A source ended (all its ranges), with its lineage status (ingested, partial, ...)."""
        self.state.source_done(status)
        self._changed()

    def quarantined(self) -> None:
        """A quarantine row (a rejected source, or a range of one)."""
        self.state.quarantine()
        self._changed()

    def embed_submitted(self, n: int = 1) -> None:
        self.state.embed(submitted=n)
        self._changed()

    def embed_done(self, n: int = 1) -> None:
        self.state.embed(done=n)
        self._changed()

    def session_aligned(self) -> None:
        self.state.session_aligned()
        self._changed()

    def stage(self, stage: str) -> None:
        self.state.at_stage(stage)
        self._changed(force=True)

    def run_ended(self) -> None:
        """The run (or watch batch) committed or stopped: a last line, bars left as they ended."""
        self._changed(force=True, final=True)

    def close(self) -> None:
        """Restore the terminal (the rich display); idempotent."""

    def _changed(self, force: bool = False, final: bool = False) -> None:
        """The state changed: redraw, or print a line when one is due."""


def progress_line(snap: dict[str, Any]) -> str:
    """One plain line of a run's progress (no control codes)."""
    parts = [f"{snap['sources_done']}/{snap['sources']} sources done ({snap['ingested']} ingested, "
             f"{snap['partial']} partial, {snap['quarantined']} quarantined; {snap['quarantine_rows']} quarantine rows)"]
    if snap["media_total_s"]:
        pct = 100 * snap["media_s"] / snap["media_total_s"]
        parts.append(f"media {snap['media_s']:.1f}/{snap['media_total_s']:.1f} s ({pct:.0f}%)")
    parts.append(f"{snap['frames']} frames, {snap['audio_s']:.1f} s audio, {snap['pages']} pages")
    parts.append(f"embed {snap['embed_done']}/{snap['embed_batches']} batches")
    parts.append(f"aligned {snap['sessions_aligned']}/{snap['sessions']} sessions")
    parts.append(f"eta {snap['eta_s']:.0f} s" if snap["eta_s"] is not None else "eta -")
    return f"progress [{snap['stage']}, {snap['elapsed_s']:.0f} s]: " + " | ".join(parts)


class PlainDisplay(Display):
    """Plain lines for a pipe or a log: messages as they come, progress at most every ``every_s``."""

    def __init__(self, stream: IO[str] | None = None, every_s: float = 10.0) -> None:
        super().__init__()
        self.stream = stream or sys.stderr
        self.every_s = every_s
        self._last = -float("inf")
        self._out = threading.Lock()

    def message(self, msg: str, level: str = "info") -> None:
        self._write(f"modalign: {msg}")

    def _changed(self, force: bool = False, final: bool = False) -> None:
        now = time.monotonic()
        if not final and (now - self._last < self.every_s or (force and now - self._last < 1.0)):
            return
        if not final and not force and self.state.sources == 0:
            return
        self._last = now
        self._emit(self.state.snapshot(), final)

    def _emit(self, snap: dict[str, Any], final: bool) -> None:
        self._write(f"modalign: {progress_line(snap)}")

    def _write(self, line: str) -> None:
        with self._out:
            print(line, file=self.stream, flush=True)


class JsonDisplay(PlainDisplay):
    """Structured logs: one JSON object per line, for a log collector."""

    def message(self, msg: str, level: str = "info") -> None:
        self._write(json_line("message", level=level, message=msg))

    def _emit(self, snap: dict[str, Any], final: bool) -> None:
        self._write(json_line("progress", final=final, **snap))


def json_line(event: str, level: str = "info", **fields: Any) -> str:
    """One structured log line: UTC time, level, event, then the fields."""
    ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{int(time.time() * 1000) % 1000:03d}Z"
    return json.dumps({"ts": ts, "level": level, "event": event, **fields}, default=str)


class RichDisplay(Display):
    """Rich progress bars on a terminal; messages print above them."""

    def __init__(self, console: Any = None, refresh_per_second: float = 4.0) -> None:
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TaskProgressColumn,
                                   TextColumn, TimeElapsedColumn, TimeRemainingColumn)

        super().__init__()
        self.console = console or Console(stderr=True)
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 TaskProgressColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                                 TimeElapsedColumn(), TimeRemainingColumn(), console=self.console,
                                 refresh_per_second=refresh_per_second, transient=False)
        self._tasks: dict[str, Any] = {}
        self._draw = threading.Lock()
        self._started = False

    def message(self, msg: str, level: str = "info") -> None:
        style = {"warning": "yellow", "error": "bold red"}.get(level)
        self.console.print(f"modalign: {msg}", style=style, markup=False, highlight=False)

    def _task(self, key: str, description: str, total: float | None) -> Any:
        if key not in self._tasks:
            self._tasks[key] = self.progress.add_task(description, total=total, info="")
        return self._tasks[key]

    def _changed(self, force: bool = False, final: bool = False) -> None:
        with self._draw:
            if not self._started:
                self.progress.start()
                self._started = True
            snap = self.state.snapshot()
            p = self.progress
            for key, description in (("sources", "sources"), ("media", "recordings (s)"), ("embed", "embed batches"),
                                     ("align", "sessions aligned")):  # the run's bars first, in this order
                self._task(key, description, None)
            p.update(self._task("sources", "sources", snap["sources"]), total=snap["sources"],
                     completed=snap["sources_done"],
                     info=f"{snap['sources']} discovered, {snap['ingested']} ingested, {snap['partial']} partial, "
                          f"{snap['quarantined']} quarantined")
            p.update(self._task("media", "recordings (s)", None), total=snap["media_total_s"] or None,
                     completed=snap["media_s"],
                     info=f"{snap['frames']} frames, {snap['audio_s']:.0f} s audio, {snap['pages']} pages")
            p.update(self._task("embed", "embed batches", None), total=snap["embed_batches"] or None,
                     completed=snap["embed_done"], info="")
            p.update(self._task("align", "sessions aligned", snap["sessions"]), total=snap["sessions"],
                     completed=snap["sessions_aligned"], info=snap["stage"])
            for key, s in list(self.state.streams.items()):
                task = self._task(f"stream:{key}", f"  {key} ({s.modality})", s.total_s)
                p.update(task, total=s.total_s, completed=s.done_s if s.total_s is not None else s.events,
                         info=s.amount(), visible=s.opened and not s.done)
            if final:
                self.progress.refresh()

    def run_started(self, sessions: int, sources: int, quarantined: int = 0) -> None:
        with self._draw:  # a watch's next batch: fresh bars
            for task in self._tasks.values():
                self.progress.remove_task(task)
            self._tasks.clear()
        super().run_started(sessions, sources, quarantined)

    def close(self) -> None:
        with self._draw:
            if self._started:
                self.progress.stop()
                self._started = False


def make_display(*, quiet: bool = False, log_format: str = "text", stream: IO[str] | None = None,
                 every_s: float = 10.0) -> Display:
    """The display a command shows on ``stream`` (default stderr): nothing with ``quiet``, JSON lines
    with ``log_format="json"``, bars when the stream is a terminal, plain lines otherwise."""
    stream = stream or sys.stderr
    if quiet:
        return Display()
    if log_format == "json":
        return JsonDisplay(stream, every_s)
    if stream.isatty():
        from rich.console import Console

        return RichDisplay(Console(file=stream))
    return PlainDisplay(stream, every_s)
