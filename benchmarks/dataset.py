"""Training samples through PyTorch, side by side: ``python benchmarks/dataset.py OUT [OUT ...] [--only MODES]``.

Issue 16's benchmark. For each committed OUT (``modalign sample DIR --duration S`` then ``modalign
run``; pass e.g. a 60 s and a 300 s one) it iterates every tick sample (frame decoded to uint8 HWC,
MFCC window with its mask, the slide blocks shown, per-modality gaps and residuals), batched by 32
with ``modalign.pipeline.readers.collate``, each mode in a fresh subprocess:

- ``loader0`` / ``loader2``: ``modalign.open(OUT).torch_dataset()`` through a ``DataLoader`` with 0 and 2
  workers;
- ``hand``: the loop a user would write with pyarrow for the same joins (``hand_samples``: each
  session's tables read whole, a dict from event id to row, per tick the records of its sources,
  ``PIL`` decode of the matched JPEG, ``np.searchsorted`` for the 10 ms MFCC slots, the page's
  blocks), no DataLoader.

For each: samples/s (of the iteration, after imports), time to first sample (from opening OUT),
peak RSS of the process tree (``e2e.TreeRss``: the subprocess and its DataLoader workers) and a
checksum of what came out (frame pixels, MFCC values, masks, gaps, blocks), which must be equal
across modes. Then the ratios against the issue's targets: loader >= 1.5x the hand loop, peak RSS
of the longest OUT over the shortest's about flat, first sample < 2 s.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import time
from pathlib import Path

from e2e import REPO, measure

MODES = ("loader0", "loader2", "hand")
BATCH = 32


def hand_samples(out_path: str):
    """The hand-written pyarrow loop: the same samples as ``torch_dataset()`` (tick unit, every modality)."""
    import numpy as np
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    import torch
    from PIL import Image

    import modalign

    out = modalign.open(out_path)
    hop = int(out.run["config"]["ingest"]["audio"]["hop_ms"] * 1e6)
    tick_ns = int(1e9 / out.run["config"]["align"]["tick_hz"])
    for sid in sorted(out.snapshot.sessions):
        files = out.snapshot.sessions[sid]["files"]

        def read(prefix, **kw):
            paths = [str(out.root / f) for f in files if f.startswith(prefix + "/") and f.endswith(".parquet")]
            return pq.read_table(paths, **kw) if paths else None

        recs = read("records", columns=["tick_index", "t_ns", "source_id", "modality", "event_id", "residual_ns",
                                         "decision"]).sort_by([("tick_index", "ascending"), ("source_id", "ascending")])
        chosen = {}
        for m, s in zip(recs.column("modality").to_pylist(), recs.column("source_id").to_pylist()):
            chosen[m] = min(chosen.get(m, s), s)
        by_tick: dict[int, dict[str, dict]] = {}
        for r in recs.to_pylist():
            if chosen.get(r["modality"]) == r["source_id"]:
                by_tick.setdefault(r["tick_index"], {})[r["modality"]] = r
        video = read("events/video", columns=["event_id", "frame_jpeg"])
        jpeg = dict(zip(video.column("event_id").to_pylist(), video.column("frame_jpeg").to_pylist())) if video else {}
        audio = read("events/audio", columns=["source_id", "event_id", "t_ns", "mfcc"])
        if audio is not None and "audio" in chosen:
            audio = audio.filter(pc.equal(audio.column("source_id"), chosen["audio"])).sort_by("t_ns")
            a_t = audio.column("t_ns").to_numpy()
            a_mfcc = np.array(audio.column("mfcc").to_pylist(), dtype=np.float32)
        else:
            a_t, a_mfcc = np.zeros(0, np.int64), np.zeros((0, 40), np.float32)
        pdf = read("events/pdf", columns=["source_id", "event_id", "t_ns", "block_index", "text", "words", "box"])
        pages: dict[int, list[dict]] = {}
        named: dict[str, int] = {}
        if pdf is not None and "pdf" in chosen:
            for b in sorted(pdf.filter(pc.equal(pdf.column("source_id"), chosen["pdf"])).to_pylist(),
                            key=lambda b: (b["t_ns"], b["block_index"], b["event_id"])):
                pages.setdefault(b["t_ns"], []).append(b)
                named[b["event_id"]] = b["t_ns"]
        size = None
        for k in sorted(by_tick):
            row = by_tick[k]
            start = k * tick_ns
            s = {"session_id": sid, "tick_index": k, "start_ns": start, "end_ns": start + tick_ns}
            v = row.get("video")
            if v and v["decision"] == "matched":
                frame = np.asarray(Image.open(io.BytesIO(jpeg[v["event_id"]])).convert("RGB"))
                size = frame.shape
            else:
                frame = np.zeros(size or (360, 640, 3), np.uint8)
            s["video_frame"] = torch.from_numpy(frame)
            lo = start + np.arange(4) * hop
            pos = np.searchsorted(a_t, lo)
            ok = (pos < len(a_t)) & (a_t[np.minimum(pos, len(a_t) - 1)] < lo + hop) if len(a_t) else np.zeros(4, bool)
            window = np.zeros((4, a_mfcc.shape[1]), np.float32)
            window[ok] = a_mfcc[pos[ok]]
            s["audio_mfcc"], s["audio_mask"] = torch.from_numpy(window), torch.from_numpy(ok)
            p = row.get("pdf")
            s["pdf_blocks"] = pages[named[p["event_id"]]] if p and p["decision"] == "matched" else []
            for m in ("video", "audio", "pdf"):
                r = row.get(m)
                s[f"{m}_gap"] = not r or r["decision"] == "gap"
                s[f"{m}_residual_ns"] = (r or {}).get("residual_ns") or 0
            yield s


def _batches(samples):
    from modalign.pipeline.readers import collate

    buf = []
    for s in samples:
        buf.append(s)
        if len(buf) == BATCH:
            yield collate(buf)
            buf = []
    if buf:
        yield collate(buf)


def child(mode: str, out_path: str) -> dict:
    """One measured iteration (runs in the subprocess)."""
    import torch
    from torch.utils.data import DataLoader

    import modalign
    from modalign.pipeline.readers import collate

    # One intra-op thread in every mode, as torch gives each DataLoader worker: torch.stack (the hand
    # loop's collate) with OpenMP threads on a busy 2-core machine spins, 10x slower than with one.
    torch.set_num_threads(1)
    t0 = time.monotonic()
    if mode == "hand":
        batches = _batches(hand_samples(out_path))
    else:
        ds = modalign.open(out_path).torch_dataset()
        batches = iter(DataLoader(ds, batch_size=BATCH, num_workers=int(mode[-1]), collate_fn=collate))
    n, first = 0, None
    check = {"pixels": 0, "mfcc": 0.0, "mask": 0, "gaps": 0, "blocks": 0, "residual_ns": 0}
    for b in batches:
        if first is None:
            first = time.monotonic() - t0
        n += len(b["tick_index"])
        check["pixels"] += int(b["video_frame"][:, ::30, ::40].sum(dtype=torch.int64))  # a pixel in 1,200
        check["mfcc"] += float(b["audio_mfcc"].double().sum())
        check["mask"] += int(b["audio_mask"].sum())
        check["gaps"] += sum(int(torch.as_tensor(b[f"{m}_gap"]).sum()) for m in ("video", "audio", "pdf"))
        check["blocks"] += sum(len(x) for x in b["pdf_blocks"])
        check["residual_ns"] += sum(int(torch.as_tensor(b[f"{m}_residual_ns"]).sum()) for m in ("video", "audio", "pdf"))
    wall = time.monotonic() - t0
    check["mfcc"] = round(check["mfcc"], 1)
    return {"samples": n, "first_s": first, "iter_s": wall, "check": check}


def run(mode: str, out_path: Path, work: Path, rep: int = 0) -> dict:
    log = work / f"{out_path.name}-{mode}-{rep}.log"
    res = measure([sys.executable, str(Path(__file__).resolve()), "--child", mode, str(out_path)], log)
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("{")]
    if res["rc"] != 0 or not lines:
        raise SystemExit(f"{mode} on {out_path} failed (exit {res['rc']}); see {log}")
    res.update(json.loads(lines[-1]))
    res["rate"] = res["samples"] / res["iter_s"]
    return res


def median_of(runs: list[dict]) -> dict:
    """The run of median rate, with the median first-sample time and the largest peak RSS of all."""
    import statistics

    mid = sorted(runs, key=lambda r: r["rate"])[len(runs) // 2]
    return {**mid, "first_s": statistics.median(r["first_s"] for r in runs),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in runs), "rates": [round(r["rate"], 1) for r in runs]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outs", nargs="*", help="committed output folders (e.g. of a 60 s and a 300 s sample)")
    ap.add_argument("--only", default=",".join(MODES), help=f"modes, comma-separated (default {','.join(MODES)})")
    ap.add_argument("--repeat", type=int, default=3, help="runs per mode and OUT, interleaved; the median is shown "
                    "(default 3: on a shared machine one run moves with the others' load)")
    ap.add_argument("--work", default=None, help="folder for the logs (default: a temp folder)")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)), flush=True)
        return 0
    import tempfile

    import modalign

    modes = [m for m in args.only.split(",") if m]
    work = Path(args.work or tempfile.mkdtemp(prefix="modalign-bench-dataset-"))
    work.mkdir(parents=True, exist_ok=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    print(f"modalign dataset benchmark  HEAD {head}  batch {BATCH}  tick samples, frames decoded, all modalities")
    results: dict[tuple[str, str], dict] = {}
    seconds = {}
    runs: dict[tuple[str, str], list[dict]] = {}
    for o in args.outs:
        p = Path(o).resolve()
        seconds[p.name] = modalign.open(p).run["counts"]["ticks"] / 25.0
        for rep in range(args.repeat):
            for m in modes:  # interleaved, so that a burst of load falls on every mode
                r = run(m, p, work, rep)
                runs.setdefault((p.name, m), []).append(r)
                print(f"  {p.name:<10} {m:<8} run {rep + 1}: {r['samples']:>6} samples  {r['rate']:8.1f}/s  "
                      f"first {r['first_s']:.2f} s  peak RSS {r['peak_rss_mib']:.0f} MiB  wall {r['wall_s']:.1f} s",
                      flush=True)
        for m in modes:
            results[(p.name, m)] = median_of(runs[(p.name, m)])
    print()
    print(f"| OUT | session | mode | samples | samples/s (median; runs) | first sample | peak RSS (tree) | CPU s |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for (name, m), r in results.items():
        print(f"| {name} | {seconds[name]:.0f} s | {m} | {r['samples']} | {r['rate']:.1f} ({', '.join(map(str, r['rates']))}) | "
              f"{r['first_s']:.2f} s | {r['peak_rss_mib']:.0f} MiB | {r['cpu_s']:.1f} |")
    print()
    for name in seconds:
        checks = {m: results[(name, m)]["check"] for m in modes if (name, m) in results}
        same = len({json.dumps(c, sort_keys=True) for c in checks.values()}) == 1
        print(f"{name}: checksums {'equal' if same else 'DIFFER'} across {', '.join(checks)}: {next(iter(checks.values()))}")
        if "hand" in modes:
            hand = results[(name, "hand")]
            for m in modes:
                if m != "hand":
                    r = results[(name, m)]
                    print(f"{name}: {m} / hand = {r['rate'] / hand['rate']:.2f}x "
                          f"(target >= 1.5x)")
        for m in modes:
            print(f"{name}: {m} first sample {results[(name, m)]['first_s']:.2f} s (target < 2 s)")
    names = list(seconds)
    if len(names) >= 2:
        short, long_ = min(names, key=seconds.get), max(names, key=seconds.get)
        for m in modes:
            a, b = results[(short, m)]["peak_rss_mib"], results[(long_, m)]["peak_rss_mib"]
            print(f"peak RSS {m}: {long_} / {short} ({seconds[long_]:.0f} s / {seconds[short]:.0f} s) = {b / a:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
