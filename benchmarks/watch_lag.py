"""Watch lag over object storage: ``python benchmarks/watch_lag.py [--sessions N] [--every S] [--fast]``.

Starts a SeaweedFS on loopback (``tests/s3server.py``) and a local Ray, runs ``Watch`` over
``s3://BUCKET/incoming`` into ``s3://BUCKET/out`` in this process, and uploads N copies of a
generated sample meeting (video with its sound, a lapel recorder, slides; renamed sessions)
every S seconds, media first and the manifest last, as a recorder would. When every session
is committed the watch is stopped (drained) and a markdown table is printed per session:

- lag from upload: the commit time minus the end of the session's last upload, what a user
  waits for, bounded by poll interval + settle time + waiting behind other sessions +
  processing;
- the watch's own lag (commit minus the moment it was ready, as ``watch.json`` keeps it);
- the batch's processing time (run + commit).

Then p50 and p95 of both lags, and the bound. ``--fast`` keeps faces and text in frames
(not detected), the two slowest stages; without it the default policy runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _at(iso: str) -> float:
    return datetime.strptime(iso, "%Y-%m-%dT%H:%M:%S.%f%z").timestamp()


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--every", type=float, default=15.0, help="seconds between two sessions' uploads")
    ap.add_argument("--duration", type=float, default=4.5, help="seconds of each sample session")
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--settle", type=float, default=2.0)
    ap.add_argument("--max-in-flight", type=int, default=2)
    ap.add_argument("--fast", action="store_true", help="faces and frame text kept (not detected)")
    args = ap.parse_args()

    from s3server import s3_server

    from modalign.pipeline.sample import generate_sample
    from modalign.pipeline.watch import Watch, listing_for
    from modalign.schemas.config import RunConfig

    work = Path(tempfile.mkdtemp(prefix="watch-lag-"))
    sample = work / "sample"
    generate_sample(sample, duration_s=args.duration, seed=0)
    files = sorted(sample.iterdir(), key=lambda p: p.name == "manifest.yaml")
    with s3_server(work / "s3") as s3:
        os.environ.update(s3.env())  # before Ray starts: its workers read the bucket too
        client = s3.client()
        cfg = {"key_store": str(work / "keys"), "storage": {"endpoint_url": s3.endpoint}}
        if args.fast:
            cfg["policy"] = {"face": {"action": "keep"}, "frame_text": {"action": "keep"}}
        config = RunConfig.model_validate(cfg)
        inp, out = f"s3://{s3.bucket}/incoming", f"s3://{s3.bucket}/out"
        watch = Watch(config, listing_for(inp, out, config), out, interval_s=args.interval, settle_s=args.settle,
                      max_in_flight=args.max_in_flight, progress=lambda _m: None, metrics=None)
        uploaded: dict[str, float] = {}

        def upload() -> None:
            for i in range(args.sessions):
                sid = f"meeting-{i:02d}"
                for f in files:
                    body = f.read_bytes()
                    if f.name == "manifest.yaml":
                        body = body.replace(b"session_id: sample-meeting", f"session_id: {sid}".encode())
                    client.put_object(Bucket=s3.bucket, Key=f"incoming/{sid}/{f.name}", Body=body)
                uploaded[sid] = time.time()
                time.sleep(args.every)

        started = time.monotonic()
        watcher = threading.Thread(target=watch.run)
        watcher.start()
        uploader = threading.Thread(target=upload)
        uploader.start()
        while watch.totals["sessions"] < args.sessions and watcher.is_alive():
            time.sleep(0.5)
        uploader.join()
        watch.stop()
        watcher.join()
        elapsed = time.monotonic() - started

    rows = sorted(watch.recent, key=lambda r: r["session_id"])
    from_upload = [_at(r["committed_at"]) - uploaded[r["session_id"]] for r in rows]
    own = [r["lag_s"] for r in rows]
    batch = [_at(r["committed_at"]) - _at(r["started_at"]) for r in rows]
    print(f"watch over SeaweedFS (s3:// INPUT and OUT), {args.sessions} sessions of {args.duration:g} s uploaded "
          f"every {args.every:g} s; --interval {args.interval:g} --settle {args.settle:g} --max-in-flight "
          f"{args.max_in_flight}; policy {'fast (faces, frame text kept)' if args.fast else 'default'}; "
          f"{os.cpu_count()} cores; {elapsed:.0f} s in all\n")
    print("| session | commit | lag from upload (s) | watch lag (s) | its batch: run + commit (s) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r, a, b, c in zip(rows, from_upload, own, batch):
        print(f"| {r['session_id']} | {r['commit']} | {a:.1f} | {b:.1f} | {c:.1f} |")
    bound = args.interval + args.settle + max(batch)
    print(f"\nlag from upload: p50 {statistics.median(from_upload):.1f} s, p95 {_pct(from_upload, 0.95):.1f} s; "
          f"watch lag: p50 {statistics.median(own):.1f} s, p95 {_pct(own, 0.95):.1f} s; interval + settle + the "
          f"longest batch = {bound:.1f} s (a session that waits behind another adds that one's batch)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
