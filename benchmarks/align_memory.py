"""Aligner memory for a 10- vs a 120-minute session: ``python benchmarks/align_memory.py [--quick]``.

What the aligner actor does (``pipeline.timeline.TimelineWriter``: the streaming ``TickAligner``,
timeline parts written to a temporary OUT every ``align.part_s`` = 60 s, a checkpoint after each),
fed synthetic event metadata at the default rates, in the batches ingest sends: video 25 fps
(+-2 ms jitter) in 32-frame batches, MFCC frames 100/s in 10 s chunks, one slide page a minute
(all pages first, as a document is read fast). Each length runs in a fresh process; its peak
RSS (VmHWM) is the figure, beside the RSS before the session, the Arrow pool's peak and the
largest checkpoint. For comparison, ``--one-shot`` also runs what the actor did before this
change (``retain=True``, every table written once at the end). Target (issue 13): flat, ratio ~1.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MS = 1_000_000
NS = 1_000_000_000


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _lineage(sid: str) -> dict:
    return dict(session_id="bench", source_id=sid, source_uri=f"file:///bench/{sid}", source_version="sha256:0",
                operators="bench@0", policy="p@1", model_id=None)


def _events(minutes: float):
    """(source, table) batches in arrival order: the deck, then video and audio interleaved by time."""
    import numpy as np
    import pyarrow as pa

    end = int(minutes * 60 * NS)
    pages = np.arange(0, end, 60 * NS, dtype=np.int64)
    yield "deck", pa.table({"event_id": [f"bench/deck/{i}" for i in range(len(pages))], "t_ns": pages,
                            "end_t_ns": pa.array(list(pages[1:]) + [None], pa.int64())})
    rng = np.random.default_rng(0)
    v_batch, a_batch = 32 * 40 * MS, 10 * NS
    v_next, a_next, vk, ak = 0, 0, 0, 0
    while v_next < end or a_next < end:
        if v_next <= a_next and v_next < end:
            k = np.arange(vk, vk + 32)
            t = k * 40 * MS + rng.integers(-2 * MS, 2 * MS, len(k))
            t = t[k * 40 * MS < end]
            yield "cam", pa.table({"event_id": [f"bench/cam/{i}" for i in k[:len(t)]], "t_ns": pa.array(t, pa.int64())})
            vk, v_next = vk + 32, v_next + v_batch
        else:
            k = np.arange(ak, ak + 1000)
            t = (k * 10 * MS)[k * 10 * MS < end]
            yield "mic", pa.table({"event_id": [f"bench/mic/{i}" for i in k[:len(t)]], "t_ns": pa.array(t, pa.int64())})
            ak, a_next = ak + 1000, a_next + a_batch


def _child(minutes: float, mode: str) -> dict:
    """One session in this (fresh) process; returns its figures."""
    import pyarrow as pa

    from modalign.operators.align.aligner import TickAligner
    from modalign.pipeline.layout import OutputLayout
    from modalign.pipeline.timeline import TimelineWriter
    from modalign.schemas.config import RunConfig
    from modalign.schemas.manifest import ClockMapping

    config = RunConfig()
    mods = {"cam": "video", "mic": "audio", "deck": "pdf"}
    with tempfile.TemporaryDirectory() as d:
        layout = OutputLayout(Path(d))
        rss0 = _status_kb("VmRSS")
        t0 = time.perf_counter()
        n = ckpt = 0
        if mode == "parts":
            w = TimelineWriter("bench", config, layout, "0123456789ab", list(mods))
            for sid, mod in mods.items():
                w.register(sid, mod, _lineage(sid), ClockMapping())
            seq = dict.fromkeys(mods, 0)
            for sid, table in _events(minutes):
                w.add(sid, table, 0.0, seq[sid])
                seq[sid] += 1
                n += table.num_rows
                if sid == "deck":
                    w.finish_source("deck")
                    continue
                size = layout.size(w.checkpoint_path)
                ckpt = max(ckpt, size or 0)
            for sid in ("cam", "mic"):
                w.finish_source(sid)
            res = w.finish()
            parts, ticks = res["parts"], res["ticks"]
        else:  # before: the whole session kept, every table written once at the end
            al = TickAligner("bench", config.align, expected_sources=list(mods))
            for sid, mod in mods.items():
                al.register(sid, mod, _lineage(sid), ClockMapping())
            for sid, table in _events(minutes):
                al.add(sid, table)
                n += table.num_rows
                al.poll()
            res = al.finish()
            for path, table in ((layout.records("bench", "a"), res.records), (layout.ctal("bench", "a"), res.ctal)):
                layout.write_table(path, table)
            parts, ticks = 1, res.ticks
        wall = time.perf_counter() - t0
        return dict(minutes=minutes, mode=mode, events=n, ticks=ticks, parts=parts, rss0_mb=rss0 / 1024,
                    peak_mb=_status_kb("VmHWM") / 1024, arrow_peak_mb=pa.default_memory_pool().max_memory() / 2**20,
                    checkpoint_kb=ckpt / 1024, wall_s=wall)


def _run(minutes: float, mode: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", str(minutes), mode], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if "--child" in sys.argv:
        i = sys.argv.index("--child")
        print(json.dumps(_child(float(sys.argv[i + 1]), sys.argv[i + 2])))
        return
    lengths = (2.0, 12.0) if "--quick" in sys.argv else (10.0, 120.0)
    modes = ["parts"] + (["one-shot"] if "--one-shot" in sys.argv else [])
    rows = [_run(m, mode) for mode in modes for m in lengths]
    print("| aligner work | session | events | ticks | parts | RSS before | peak RSS | Arrow pool peak "
          "| checkpoint | wall |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['mode']} | {r['minutes']:.0f} min | {r['events']:,} | {r['ticks']:,} | {r['parts']} "
              f"| {r['rss0_mb']:.0f} MB | {r['peak_mb']:.0f} MB | {r['arrow_peak_mb']:.1f} MB "
              f"| {r['checkpoint_kb']:.0f} KB | {r['wall_s']:.1f} s |")
    for mode in modes:
        a, b = (next(r for r in rows if r["mode"] == mode and r["minutes"] == m) for m in lengths)
        print(f"\n{mode}: peak RSS {b['minutes']:.0f} min / {a['minutes']:.0f} min = {b['peak_mb'] / a['peak_mb']:.2f} "
              f"(above the pre-session RSS: {(b['peak_mb'] - b['rss0_mb']) / max(a['peak_mb'] - a['rss0_mb'], 1e-9):.2f})")


if __name__ == "__main__":
    main()
