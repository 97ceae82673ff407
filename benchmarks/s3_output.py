"""``modalign run`` into an s3:// OUT against the same run into a local folder, and the write path alone.

A SeaweedFS server is started on loopback (``tests/s3server.py``), and a clip with its sound
track (``--seconds``, 320x240, 25 fps) plus a tone WAV become the input. The first run starts
the local Ray in this process, so its workers inherit the server's credentials. Then come
``--repeat`` alternating runs into a fresh local folder and into a fresh S3 prefix. Each row
gives the best wall time, the files the commit lists and their bytes. Below them, every
committed Parquet file of the local OUT is rewritten through ``OutputLayout.write_table`` into
a folder (atomic rename + fsync) and into the store (pyarrow S3 multipart upload), which
measures the write path alone. Loopback has no network latency, so a remote store costs more
per object.

    .venv/bin/python benchmarks/s3_output.py [--seconds 10] [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _write_clip(path: Path, seconds: float) -> None:
    import av
    import numpy as np

    rate = 16_000
    with av.open(str(path), "w") as c:
        v = c.add_stream("libx264", rate=25)
        v.width, v.height, v.pix_fmt = 320, 240, "yuv420p"
        a = c.add_stream("aac", rate=rate)
        a.layout = "mono"
        rng = np.random.default_rng(0)
        for i in range(int(seconds * 25)):
            img = rng.integers(0, 255, (240, 320, 3), dtype=np.uint8) // 4 + (i * 5) % 192
            for p in v.encode(av.VideoFrame.from_ndarray(img.astype(np.uint8), format="rgb24")):
                c.mux(p)
        from fractions import Fraction

        t = np.arange(int(seconds * rate)) / rate
        x = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
        for k in range(0, len(x), 1024):
            fr = av.AudioFrame.from_ndarray(x[None, k:k + 1024], format="fltp", layout="mono")
            fr.sample_rate, fr.pts, fr.time_base = rate, k, Fraction(1, rate)
            for p in a.encode(fr):
                c.mux(p)
        for s in (a, v):
            for p in s.encode():
                c.mux(p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="length of the clip (s)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per target (the best is shown)")
    args = ap.parse_args()

    from clips import write_tone
    from s3server import s3_server

    with tempfile.TemporaryDirectory(prefix="modalign-s3-out-") as tmp, s3_server(Path(tmp) / "s3") as s3:
        os.environ.update(s3.env())
        os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="mso", dir="/tmp"))
        import pyarrow.parquet as pq

        import modalign
        from modalign.pipeline.commits import CommitLog
        from modalign.pipeline.layout import OutputLayout
        from modalign.pipeline.runner import Runner
        from modalign.schemas.config import RunConfig

        inp = Path(tmp) / "in"
        inp.mkdir()
        _write_clip(inp / "clip.mp4", args.seconds)
        write_tone(inp / "tone.wav", seconds=args.seconds)
        cfg = RunConfig(key_store=Path(tmp) / "keys")
        best: dict[str, float] = {}
        outs: dict[str, str] = {}
        for rep in range(args.repeat + 1):  # the first pair warms Ray, the models and the server up
            for target in ("local", "s3"):
                out = str(Path(tmp) / f"out-{rep}") if target == "local" else f"s3://{s3.bucket}/b/{uuid.uuid4().hex[:8]}"
                t = time.perf_counter()
                Runner(cfg, out, progress=lambda _m: None).run(inp)
                wall = time.perf_counter() - t
                if rep:
                    best[target] = min(best.get(target, wall), wall)
                outs[target] = out

        print(f"input: {args.seconds:.0f} s clip 320x240 with sound + {args.seconds:.0f} s tone; best of "
              f"{args.repeat}, after one warm-up run each\n")
        print(f"{'OUT':<8} {'run wall s':>10} {'files':>6} {'MiB':>8}")
        for target in ("local", "s3"):
            layout = OutputLayout.of(outs[target])
            files = CommitLog.of(outs[target]).latest().files()
            size = sum(layout.size(layout.path(f)) or 0 for f in files)
            print(f"{target:<8} {best[target]:>10.2f} {len(files):>6} {size / 2**20:>8.2f}")

        local = modalign.open(outs["local"])
        tables = [pq.read_table(p) for name in local.tables() for p in local.files(name)]
        nbytes = sum(p.stat().st_size for name in local.tables() for p in local.files(name))
        print(f"\nwrite path alone: {len(tables)} Parquet files, {nbytes / 2**20:.2f} MiB "
              "(the local run's committed tables), best of 3")
        print(f"{'target':<34} {'s':>7} {'files/s':>8} {'MiB/s':>7}")
        for name, out in (("folder (atomic rename + fsync)", str(Path(tmp) / "rewrite")),
                          ("s3 (pyarrow multipart upload)", f"s3://{s3.bucket}/rewrite")):
            layout = OutputLayout.of(out)
            times = []
            for k in range(3):
                t = time.perf_counter()
                for i, table in enumerate(tables):
                    layout.write_table(layout.path(f"records/r{k}/{i:05d}.parquet"), table)
                times.append(time.perf_counter() - t)
            s = min(times)
            print(f"{name:<34} {s:>7.3f} {len(tables) / s:>8.1f} {nbytes / 2**20 / s:>7.1f}")


if __name__ == "__main__":
    main()
