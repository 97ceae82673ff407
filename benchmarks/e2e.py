"""End to end, side by side: ``python benchmarks/e2e.py [--duration S] [--only default,same,naive] [--repeat N] [--long S] [--keep DIR]``.

Issue 14's benchmark. Generates a sample meeting (``modalign.pipeline.sample.generate_sample``:
25 fps 640x360 video with its sound, a lapel recorder, slides) and runs on it, one after
another on this machine, each in a fresh subprocess (start-up included) with a fresh output:

- ``default``: ``modalign run`` with the default policy (a config that only moves the key vault
  into the work folder);
- ``same``: ``modalign run`` with the "same work" config (``same_work_config``): faces on every
  frame, no text in frames (``policy.frame_text.action: keep``), MFCCs kept
  (``policy.voice.action: keep_mfcc``), PDF text + personal data, video embedded at 1 fps;
- ``naive``: ``benchmarks/naive_pipeline.py``, the single-process script a user would write
  for that same work (its docstring says what it does and leaves out).

For each: wall time, processing rate as a multiple of real time (duration / wall), peak RSS of
the whole process tree (driver, raylet, every Ray worker: ``/proc`` sampled every 0.2 s, VmRSS
summed over the subprocess and all its descendants; also without shared memory, RssShmem,
which the object store's pages add to every process that maps them), and the ``timing`` block
of ``run.json`` when the runner writes one. Then the ratios against the issue's targets:
default >= 2x real time; same work >= 1.8x the naive script's rate; with ``--long S``, the
default policy on an S-second session too, and peak RSS long / short <= 1.3.

``--repeat N`` runs the set N times, each round in another order (a rotation), and reports each
run's fastest round, with every round's wall beside: a shared machine's speed drifts by 10-15 %
over minutes, which one sequential round reads as a difference between the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = ("default", "same", "naive")
SAMPLE_EVERY_S = 0.2


def compile_bytecode() -> None:
    """Byte-compile modalign's own modules, as ``pip install`` does for a package it installs.

    An editable install compiles a module at its first import and caches the bytecode; where
    ``PYTHONDONTWRITEBYTECODE`` is set (this project's sandboxes set it), nothing is cached and
    every process compiles what it imports again: ~0.2 CPU s in each Ray worker of a run, and in
    the naive script once. Both runs then measure the code as an installed package runs it."""
    import compileall

    for folder in ("pipeline", "operators", "schemas"):
        compileall.compile_dir(REPO / folder, quiet=1)
    compileall.compile_file(REPO / "__init__.py", quiet=1)


# -- process-tree memory --------------------------------------------------------------------

def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (``/proc/<pid>/task/*/children``); [] once it is gone."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants alive now."""
    seen, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.append(pid)
            todo += children(pid)
    return seen


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, RssShmem) of ``pid`` in KiB; (0, 0) for a process gone or a zombie."""
    vals = {"VmRSS": 0, "RssShmem": 0}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in vals:
                    vals[key] = int(line.split()[1])
    except OSError:
        pass
    return vals["VmRSS"], vals["RssShmem"]


def cpu_ticks(pid: int) -> int:
    """User + system CPU of ``pid`` so far, in clock ticks (``/proc/<pid>/stat``); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))


def process_name(pid: int) -> str:
    """A short name: a Ray worker's actor or task (``ray::IngestActor``), a script's or binary's file name."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "?"
    if not argv:
        return "?"
    if argv[0].startswith("ray::"):
        return argv[0].split(".", 1)[0].split(" ", 1)[0]
    binary = os.path.basename(argv[0])
    if not binary.startswith("python"):  # raylet, gcs_server, ...: their own name, whatever the flags
        return binary
    for i, a in enumerate(argv[1:], 1):  # the interpreter's options, then a script, -m module or -c
        if a == "-m" and i + 1 < len(argv):
            return argv[i + 1]
        if a == "-c":
            return binary
        if not a.startswith("-"):  # a script, with or without .py (.venv/bin/pytest)
            return os.path.basename(a)
    return binary


class TreeRss:
    """Samples the summed RSS of a process tree every ``every`` seconds on a thread, keeping peaks,
    and each process's CPU time as last seen (``cpu_s``: their sum; a process's last < 0.2 s is missed)."""

    def __init__(self, root: int, every: float = SAMPLE_EVERY_S) -> None:
        self.root, self.every = root, every
        self.peak_kib = self.peak_private_kib = self.peak_procs = self.samples = 0
        self._cpu: dict[int, int] = {}
        self._names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def sample(self) -> None:
        pids = process_tree(self.root)
        rss = [rss_kib(p) for p in pids]
        total = sum(r for r, _ in rss)
        self.peak_kib = max(self.peak_kib, total)
        self.peak_private_kib = max(self.peak_private_kib, total - sum(s for _, s in rss))
        self.peak_procs = max(self.peak_procs, sum(1 for r, _ in rss if r))
        for p in pids:
            self._cpu[p] = max(self._cpu.get(p, 0), cpu_ticks(p))
            name = process_name(p)
            if name != "?":
                self._names[p] = name  # a Ray worker takes its actor's name after it starts
        self.samples += 1

    @property
    def cpu_s(self) -> float:
        return sum(self._cpu.values()) / os.sysconf("SC_CLK_TCK")

    def cpu_by_name(self) -> dict[str, float]:
        """CPU seconds per process name, largest first."""
        out: dict[str, float] = {}
        for p, ticks in self._cpu.items():
            name = self._names.get(p, "?")
            out[name] = out.get(name, 0.0) + ticks / os.sysconf("SC_CLK_TCK")
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every)

    def __enter__(self) -> "TreeRss":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def measure(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> dict:
    """Run ``cmd`` (stdout and stderr into ``log``); wall seconds, exit code and tree memory peaks."""
    with open(log, "wb") as out:
        start = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        with TreeRss(proc.pid) as mem:
            rc = proc.wait()
        wall = time.monotonic() - start
    return {"wall_s": wall, "rc": rc, "cpu_s": mem.cpu_s, "cpu_by_process": mem.cpu_by_name(),
            "peak_rss_mib": mem.peak_kib / 1024,
            "peak_private_mib": mem.peak_private_kib / 1024, "procs": mem.peak_procs, "samples": mem.samples}


# -- configs and runs -----------------------------------------------------------------------

def default_config(key_store: Path) -> dict:
    """The default policy; only the key vault is kept inside the benchmark's folder."""
    return {"key_store": str(key_store)}


def same_work_config(key_store: Path) -> dict:
    """What ``naive_pipeline.py`` does: faces on, frame text off, MFCCs kept, PDF PII, 1 fps embeddings."""
    return {
        "key_store": str(key_store),
        "policy": {"frame_text": {"action": "keep"}, "voice": {"action": "keep_mfcc"}},
        "embed": {"image_fps": 1.0},
    }


def write_config(path: Path, data: dict) -> Path:
    """Validate ``data`` as a ``RunConfig`` (a typo fails here, not in the subprocess) and write it."""
    from modalign.schemas.config import RunConfig

    RunConfig.model_validate(data)
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")
    return path


def modalign_cmd(manifest: Path, out: Path, config: Path) -> list[str]:
    return [sys.executable, "-m", "modalign.pipeline.cli", "run", str(manifest), "--out", str(out),
            "--config", str(config)]


def naive_cmd(manifest: Path, out: Path) -> list[str]:
    return [sys.executable, str(REPO / "benchmarks" / "naive_pipeline.py"), str(manifest), "--out", str(out)]


def modalign_counts(out: Path) -> dict:
    """What a modalign run produced (run.json ``counts``) and its ``timing`` block ({} when absent)."""
    try:
        run = json.loads((out / "run.json").read_text())
    except (OSError, ValueError):
        return {}
    c = run.get("counts", {})
    return {"timing": run.get("timing") or {}, "events": c.get("events", {}), "faces_blurred": c.get("faces_blurred"),
            "frame_text_blurred": c.get("frame_text_blurred"), "pii_replaced": c.get("pii_replaced"),
            "features": c.get("features", {}), "ticks": c.get("ticks"), "gaps": c.get("gaps"),
            "quarantined": c.get("quarantined")}


def naive_counts(log: Path) -> dict:
    """The ``counts: {json}`` line the naive script prints last."""
    found = re.findall(r"^counts: (\{.*\})$", log.read_text(errors="replace"), re.M)
    return json.loads(found[-1]) if found else {}


def with_settings(data: dict, settings: list[str]) -> dict:
    """``data`` with each ``dotted.key=JSON`` of ``settings`` set (``ingest.video.range_s=null``)."""
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep or not key:
            raise ValueError(f"--set takes dotted.key=JSON, not {setting!r}")
        *path, last = key.split(".")
        node = data
        for part in path:
            node = node.setdefault(part, {})
        try:
            node[last] = json.loads(value)
        except ValueError:
            node[last] = value  # a bare string
    return data


def run_one(name: str, manifest: Path, work: Path, tag: str = "", settings: list[str] = ()) -> dict:
    out = work / f"out-{name}{tag}"
    shutil.rmtree(out, ignore_errors=True)
    log = work / f"{name}{tag}.log"
    if name == "naive":
        res = measure(naive_cmd(manifest, out), log)
        res["produced"] = naive_counts(log)
    else:
        data = (default_config if name == "default" else same_work_config)(work / "keys")
        cfg = write_config(work / f"{name}.json", with_settings(data, list(settings)))
        res = measure(modalign_cmd(manifest, out, cfg), log)
        res["produced"] = modalign_counts(out)
    res["log"] = str(log)
    return res


# -- report ---------------------------------------------------------------------------------

def _timing(res: dict) -> str:
    from modalign.pipeline.inspect import timing_text

    return timing_text(res["produced"]).strip(" ()") or "-"


def table(results: dict[str, dict], durations: dict[str, float]) -> str:
    lines = ["| run | input (s) | wall (s) | x real time | CPU, tree (s) | peak RSS, tree (MiB) | less shared (MiB) | "
             "processes | run.json timing | exit |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for name, r in results.items():
        d = durations[name]
        lines.append(f"| {name} | {d:g} | {r['wall_s']:.1f} | {d / r['wall_s']:.2f} | {r['cpu_s']:.1f} | "
                     f"{r['peak_rss_mib']:.0f} | "
                     f"{r['peak_private_mib']:.0f} | {r['procs']} | {_timing(r)} | {r['rc']} |")
    return "\n".join(lines)


def ratios(results: dict[str, dict], durations: dict[str, float]) -> list[str]:
    rate = {k: durations[k] / r["wall_s"] for k, r in results.items()}
    out = []
    if "default" in rate:
        out.append(f"- default policy: {rate['default']:.2f}x real time (target >= 2x; "
                   f"{results['default']['wall_s']:.1f} s wall for {durations['default']:g} s, target <= "
                   f"{durations['default'] / 2:g} s)")
    if "same" in rate and "naive" in rate:
        out.append(f"- same work vs naive script: {rate['same'] / rate['naive']:.2f}x its rate (target >= 1.8x); "
                   f"peak RSS {results['same']['peak_rss_mib'] / results['naive']['peak_rss_mib']:.2f}x; CPU "
                   f"{results['same']['cpu_s']:.0f} s vs {results['naive']['cpu_s']:.0f} s (on a shared machine "
                   "the CPU seconds move less than the wall)")
    if "default" in rate and "same" in rate:
        out.append(f"- default vs same work: {rate['default'] / rate['same']:.2f}x the rate")
    if "default" in results and "long" in results:
        out.append(f"- peak RSS, {durations['long']:g} s vs {durations['default']:g} s session (default policy): "
                   f"{results['long']['peak_rss_mib'] / results['default']['peak_rss_mib']:.2f}x (target <= 1.3x); "
                   f"less shared memory {results['long']['peak_private_mib'] / results['default']['peak_private_mib']:.2f}x")
    return out


def cpu_lines(results: dict[str, dict]) -> list[str]:
    """Where each run's CPU went, per process (seconds; the top 6)."""
    return [f"- {name}: " + ", ".join(f"{p} {s:.1f}" for p, s in list(r.get("cpu_by_process", {}).items())[:6])
            for name, r in results.items()]


def produced(results: dict[str, dict]) -> list[str]:
    return [f"- {name}: {json.dumps(r['produced'], sort_keys=True)}" for name, r in results.items()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of the sample session")
    ap.add_argument("--only", default=",".join(RUNS), help="comma-separated subset of default,same,naive")
    ap.add_argument("--long", type=float, default=None, metavar="S",
                    help="also run the default policy on an S-second session; print peak RSS long / short")
    ap.add_argument("--keep", type=Path, default=None, metavar="DIR",
                    help="work in DIR (inputs, outputs, logs) and keep it; default: a temp folder, removed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="run the set N times in rotated orders and keep each run's fastest round")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON", dest="settings",
                    help="set a config field in both modalign runs, e.g. ingest.video.range_s=null (repeatable)")
    args = ap.parse_args(argv)
    only = [r.strip() for r in args.only.split(",") if r.strip()]
    if not only or set(only) - set(RUNS):
        ap.error(f"--only takes a comma-separated subset of {','.join(RUNS)}")

    from modalign.pipeline.sample import generate_sample

    compile_bytecode()
    work = args.keep or Path(tempfile.mkdtemp(prefix="modalign-e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        manifest = generate_sample(work / f"sample-{args.duration:g}s", duration_s=args.duration, seed=args.seed)
        results: dict[str, dict] = {}
        durations = {name: args.duration for name in RUNS}
        walls: dict[str, list[float]] = {name: [] for name in only}
        for round_ in range(max(1, args.repeat)):
            shift = round_ % len(only)
            for name in only[shift:] + only[:shift]:
                print(f"running {name} (round {round_ + 1}) ...", file=sys.stderr, flush=True)
                r = run_one(name, manifest, work, settings=args.settings)
                walls[name].append(r["wall_s"])
                if name not in results or r["wall_s"] < results[name]["wall_s"]:
                    results[name] = r
        if args.long:
            if "default" not in results:
                results["default"] = run_one("default", manifest, work, settings=args.settings)
            long_manifest = generate_sample(work / f"sample-{args.long:g}s", duration_s=args.long, seed=args.seed)
            print("running long ...", file=sys.stderr, flush=True)
            r = run_one("default", long_manifest, work, tag="-long", settings=args.settings)
            results["long"], durations["long"] = r, args.long
        load = os.getloadavg()
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.splitlines()
        print(f"modalign end to end: sample meeting of {args.duration:g} s (25 fps 640x360 video with sound, lapel "
              f"audio, slides); {os.cpu_count()} cores; load average after the runs {load[0]:.2f} / {load[1]:.2f} / "
              f"{load[2]:.2f}; RSS sampled every {SAMPLE_EVERY_S} s over each run's process tree; modalign "
              "byte-compiled first, as pip installs it; code at "
              f"{head.stdout.strip() or '?'}" + (f" with {len(dirty)} tracked file(s) changed" if dirty else "")
              + (f"; config set: {', '.join(args.settings)}" if args.settings else "") + "\n")
        print(table(results, durations))
        if args.repeat > 1:
            print(f"\nfastest of {args.repeat} rounds; every round's wall (s): "
                  + "; ".join(f"{n} {', '.join(f'{w:.1f}' for w in ws)}" for n, ws in walls.items()))
        print()
        print("\n".join(ratios(results, durations)))
        print("\nCPU seconds by process:")
        print("\n".join(cpu_lines(results)))
        print("\nproduced:")
        print("\n".join(produced(results)))
        failed = [n for n, r in results.items() if r["rc"] not in (0, 3)]
        if failed:
            print(f"\nfailed: {', '.join(failed)} (see {', '.join(results[n]['log'] for n in failed)})")
        return 1 if failed else 0
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
