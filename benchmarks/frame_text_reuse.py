"""OCR reuse in frame-text de-identification: ``python benchmarks/frame_text_reuse.py [--quick] [--duration S] [--engines library,cli]``.

Runs ``FrameTextOperator`` at its defaults with ``reuse_threshold`` 24 (on) and 0 (off), with each
OCR engine (``library``: libtesseract in process, the default; ``cli``: a tesseract process per
sample), over:
- the sample meeting (``modalign sample``: room.mp4 decoded, 640x360, four slides evenly over
  ``--duration`` s, a real face photo gliding across the room the whole time), at 360p and
  upscaled 2x to 720p (cubic);
- the static-slide clips of ``benchmarks/frame_text.py`` (no motion, one page change half-way).
One stream per clip in tables of 2 s (flushed at its end), pinned to one core (tesseract with
``OMP_THREAD_LIMIT=1``, OpenCV one thread). Figures: tesseract calls (counted by wrapping the
operator's ``_ocr``), CPU ms per frame (this process + tesseract children) and wall ms per
frame, and the de-identification figure: planted values tesseract still reads in the output
slide panel (every 10th frame, read at 2x for 360p, 1x for 720p; not timed). Reuse must not
read more planted values than off (exit 1 if it does). A change away from the text already
read (the face moving through the room) is OCRed as a crop around it; a change over read text
(the face crossing the slide, a new page) is a whole-frame OCR.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from frame_text import FPS, PLANTED, TABLE_S, clip, cpu_s  # the sibling benchmark (the script's folder is on sys.path)

from modalign.operators.deid.frame_text import FrameTextConfig, FrameTextOperator, encode_pgm, parse_tsv

ON = FrameTextConfig().reuse_threshold


def meeting(duration_s: float) -> tuple[list[np.ndarray], list[int], list[list[str]]]:
    """Decoded room.mp4 frames (RGB), their t_ns, and per frame the planted values on screen."""
    import av

    from modalign.pipeline import sample
    from modalign.schemas.load import load_model
    from modalign.schemas.manifest import Manifest

    d = Path(tempfile.mkdtemp(prefix="frame_text_reuse_"))
    manifest = load_model(Manifest, sample.generate_sample(d, duration_s=duration_s))
    schedule = sample.page_schedule_ns(manifest.ground_truth.duration_ns)
    frames, ts = [], []
    with av.open(str(d / sample.VIDEO_FILE)) as c:
        for f in c.decode(video=0):
            frames.append(f.to_ndarray(format="rgb24"))
            ts.append(int(f.pts * f.time_base * 1_000_000_000))
    planted = manifest.ground_truth.planted_pii
    shown = [[p.value for p in planted if p.page_index == sample.page_at(t, schedule)] for t in ts]
    return frames, ts, shown


def tables_of(frames: list[np.ndarray], ts: list[int], k: int) -> list[pa.Table]:
    import cv2

    per, out = FPS * TABLE_S, []
    for lo in range(0, len(frames), per):
        part = frames[lo : lo + per]
        if k != 1:
            part = [cv2.resize(f, None, fx=k, fy=k, interpolation=cv2.INTER_CUBIC) for f in part]
        out.append(pa.table({
            "event_id": [f"bench/room_video/video/{i}" for i in range(lo, lo + len(part))],
            "t_ns": pa.array(ts[lo : lo + len(part)], pa.int64()),
            "frame": pa.FixedShapeTensorArray.from_numpy_ndarray(np.stack(part)),
        }))
    return out


def run(tables: list[pa.Table], reuse: int, engine: str) -> tuple[list[pa.Table], str, float, float]:
    """(output tables, tesseract calls "whole frame + crops", CPU s, wall s) of one stream."""
    op = FrameTextOperator(FrameTextConfig(secret=b"b" * 32, reuse_threshold=reuse, engine=engine))
    op.setup()
    op.process(tables[0].slice(0, 2))  # warm-up: spaCy's first call
    op.reset()
    calls = [0, 0]
    inner = op._ocr
    shape = tables[0].column("frame").type.shape[:2]

    def ocr(rgb, event_id, table, **kw):
        calls[list(rgb.shape[:2]) != list(shape)] += 1
        return inner(rgb, event_id, table, **kw)

    op._ocr = ocr  # type: ignore[method-assign]
    c0, w0 = cpu_s(), time.perf_counter()
    outs = [op.process(t) for t in tables] + op.flush()
    return outs, f"{calls[0]} + {calls[1]}", cpu_s() - c0, time.perf_counter() - w0


def still_read(outs: list[pa.Table], shown: list[list[str]], k: int, stride: int = 10) -> tuple[int, int]:
    """(planted values tesseract reads in the output's slide panel, values shown), every ``stride``-th frame."""
    import subprocess

    from modalign.pipeline.sample import PANEL_BOX

    frames = np.concatenate([t.column("frame").combine_chunks().to_numpy_ndarray() for t in outs if t.num_rows])
    x0, y0, x1, y1 = (v * k for v in PANEL_BOX)
    read = total = 0
    for i in range(0, len(frames), stride):
        proc = subprocess.run(["tesseract", "stdin", "stdout", "--psm", "11", "tsv"],
                              input=encode_pgm(frames[i][y0:y1, x0:x1], 2.0 if k == 1 else 1.0),
                              capture_output=True, check=True)
        text = "".join(w.text for _, w in parse_tsv(proc.stdout, 1.0, 0.0)).casefold()
        for v in shown[i]:
            total += 1
            read += "".join(v.split()).casefold() in text
    return read, total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="12 s meeting, 2 s static clips")
    ap.add_argument("--duration", type=float, default=None, help="meeting length in s (default 24; quick 12)")
    ap.add_argument("--engines", default="library,cli", help="OCR engines to compare (FrameTextConfig.engine)")
    args = ap.parse_args()
    engines = args.engines.split(",")
    duration = args.duration or (12.0 if args.quick else 24.0)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # children inherit it
    import cv2

    cv2.setNumThreads(1)
    frames, ts, shown = meeting(duration)
    n_static = FPS * (2 if args.quick else 4)
    static_shown = [list(PLANTED[0 if i < n_static // 2 else 1]) for i in range(n_static)]
    cases = [
        (f"sample meeting {duration:g} s, 640x360", lambda: tables_of(frames, ts, 1), shown, 1),
        (f"sample meeting {duration:g} s, 1280x720 (2x)", lambda: tables_of(frames, ts, 2), shown, 2),
        ("static slides, 640x360", lambda: clip(1, True, n_static), static_shown, 1),
        ("static slides, 1280x720", lambda: clip(2, True, n_static), static_shown, 2),
    ]
    rows = []
    for label, make, truth, k in cases:
        tables = make()
        n = sum(t.num_rows for t in tables)
        for engine in engines:
            for reuse in (0, ON):
                outs, calls, cpu, wall = run(tables, reuse, engine)
                # the static clips' panel sits where the meeting's does; their planted values are PLANTED
                leak, total = still_read(outs, truth, k, stride=10 if n > 100 else 5)
                rows.append((label, engine, reuse, calls, 1000 * cpu / n, 1000 * wall / n, leak, total))
        del tables

    print(f"FrameTextOperator, ocr_fps 4, {FPS} fps, tables of {TABLE_S} s, one core; reuse_threshold 0 (off) vs {ON}\n")
    print("| clip | engine | reuse | tesseract calls (whole frame + crop) | CPU ms/frame | wall ms/frame | planted values still read |")
    print("|---|---|---|---|---|---|---|")
    for label, engine, reuse, calls, c, w, leak, total in rows:
        print(f"| {label} | {engine} | {'on (' + str(reuse) + ')' if reuse else 'off'} | {calls} | {c:.1f} | {w:.1f} | "
              f"{leak}/{total} |")
    worse = [f"{r[0]} ({r[1]})" for off, on in zip(rows[::2], rows[1::2]) for r in (on,) if on[6] > off[6]]
    if worse:
        print("\nREUSE READS MORE PLANTED VALUES THAN OFF: " + ", ".join(worse))
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
