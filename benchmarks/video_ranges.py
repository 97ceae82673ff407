"""One long video on 1 and on 2 ingest actors: ``python benchmarks/video_ranges.py [--duration S] [--repeat N] [--keep DIR]``.

Issue 14's within-source parallelism figure. Generates a sample meeting of ``--duration``
seconds (default 600, the generator's longest; ``modalign.pipeline.sample.generate_sample``)
and runs ``modalign run`` on a manifest holding its room video only (25 fps 640x360 with its
sound track), with the default policy, one run after the other, each in a fresh subprocess
with a fresh output:

- ``1 actor``: ``runtime.ingest_actors: 1``; the video is still cut into ranges
  (``ingest.video.range_s``, 30 s) that the one actor decodes one after another;
- ``1 actor, whole``: the same with ``ingest.video.range_s: null`` (one decode of the file;
  ``--no-whole`` skips it);
- ``2 actors``: ``runtime.ingest_actors: 2``, the ranges shared between them.

Prints wall, rate (video seconds per wall second), CPU and peak RSS of the process tree (as
``benchmarks/e2e.py`` measures them), the run.json timing, and the rate of 2 actors over the
rate of 1 (the issue's target: >= 1.7x). Each run's committed video events are counted, so a
run that dropped frames shows it. ``--repeat N`` runs the set N times, each round in another
order, and keeps each run's fastest round, every round's wall printed beside (as ``e2e.py``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from e2e import (REPO, _timing, compile_bytecode, cpu_lines, default_config, measure, modalign_cmd, modalign_counts,
                 produced, with_settings, write_config)

RUNS = {
    "1 actor": ["runtime.ingest_actors=1"],
    "1 actor, whole": ["runtime.ingest_actors=1", "ingest.video.range_s=null"],
    "2 actors": ["runtime.ingest_actors=2"],
}


def video_only(manifest: Path) -> Path:
    """A manifest next to ``manifest`` with its video source alone (its sound track comes with it)."""
    data = yaml.safe_load(manifest.read_text(encoding="utf-8"))
    data["sources"] = [s for s in data["sources"] if s["modality"] == "video"]
    data.pop("ground_truth", None)
    out = manifest.with_name("video-only.yaml")
    out.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of video (the generator allows up to 1800)")
    ap.add_argument("--keep", type=Path, default=None, metavar="DIR",
                    help="work in DIR (input, outputs, logs) and keep it; default: a temp folder, removed")
    ap.add_argument("--no-whole", action="store_true", help="skip the 1-actor run without ranges")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="run the set N times, each round in another order, and keep each run's fastest round "
                         "(as e2e.py: a shared machine's load moves one run more than the other)")
    args = ap.parse_args(argv)

    from modalign.pipeline.sample import generate_sample

    compile_bytecode()
    work = args.keep or Path(tempfile.mkdtemp(prefix="modalign-ranges-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        print(f"generating a {args.duration:g} s sample ...", file=sys.stderr, flush=True)
        manifest = video_only(generate_sample(work / f"sample-{args.duration:g}s", duration_s=args.duration,
                                              seed=args.seed))
        results: dict[str, dict] = {}
        names = [n for n in RUNS if not (args.no_whole and "whole" in n)]
        walls: dict[str, list[float]] = {n: [] for n in names}
        for round_ in range(max(1, args.repeat)):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                settings = RUNS[name]
                print(f"running {name} (round {round_ + 1}) ...", file=sys.stderr, flush=True)
                tag = name.replace(" ", "").replace(",", "-")
                out = work / f"out-{tag}"
                shutil.rmtree(out, ignore_errors=True)
                cfg = write_config(work / f"{tag}.json", with_settings(default_config(work / "keys"), settings))
                res = measure(modalign_cmd(manifest, out, cfg), work / f"{tag}.log")
                res["produced"] = modalign_counts(out)
                res["settings"] = settings
                walls[name].append(res["wall_s"])
                if name not in results or res["wall_s"] < results[name]["wall_s"]:
                    results[name] = res

        load = os.getloadavg()
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        print(f"modalign, one {args.duration:g} s video (25 fps 640x360 with sound), default policy; "
              f"{os.cpu_count()} cores; load average after the runs {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}; "
              f"modalign byte-compiled first, as pip installs it; code at {head.stdout.strip() or '?'}\n")
        print("| run | config set | wall (s) | x real time | CPU, tree (s) | peak RSS, tree (MiB) | video events | "
              "run.json timing | exit |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
        for name, r in results.items():
            events = r["produced"].get("events", {})
            print(f"| {name} | {', '.join(r['settings'])} | {r['wall_s']:.1f} | {args.duration / r['wall_s']:.2f} | "
                  f"{r['cpu_s']:.1f} | {r['peak_rss_mib']:.0f} | {events.get('video', '-')} | {_timing(r)} | "
                  f"{r['rc']} |")
        if args.repeat > 1:
            print(f"\nfastest of {args.repeat} rounds; every round's wall (s): "
                  + "; ".join(f"{n} {', '.join(f'{w:.1f}' for w in ws)}" for n, ws in walls.items()))
        one, two = results["1 actor"], results["2 actors"]
        print(f"\n- 2 actors vs 1: {one['wall_s'] / two['wall_s']:.2f}x the rate (target >= 1.7x)")
        proc = [r["produced"].get("timing", {}).get("processing_s") for r in (one, two)]
        if all(proc):
            print(f"- processing only (run.json timing.processing_s): {proc[0] / proc[1]:.2f}x")
        if "1 actor, whole" in results:
            whole = results["1 actor, whole"]
            print(f"- 1 actor in ranges vs one whole decode: {whole['wall_s'] / one['wall_s']:.2f}x the rate "
                  "(the overlap each range decodes twice)")
        print("\nCPU seconds by process:")
        print("\n".join(cpu_lines(results)))
        print("\nproduced:")
        print("\n".join(produced(results)))
        failed = [n for n, r in results.items() if r["rc"] not in (0, 3)]
        if failed:
            print(f"\nfailed: {', '.join(failed)} (see the logs in {work})")
        return 1 if failed else 0
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
