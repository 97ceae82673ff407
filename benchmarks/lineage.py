"""Lineage query latencies at 1,000 sessions: ``python benchmarks/lineage.py [--sessions N] [--out DIR]``.

Generates a synthetic but structurally real committed output folder (``generate``): per
session the four sources of a meeting (room video, its own audio track, a lapel recorder
whose clock was estimated, a slide PDF), 2 s each, written through the project's own writers
(``OutputLayout`` paths, ``write_table`` over the row models' Arrow schemas, ``write_jsonl``,
the ``FeatureCache``, ``build_indexes`` for FAISS) and committed under the output's lease by
``CommitLog.commit``, so the lineage store reads it exactly as it reads a real run. Media
is not decoded: frames are one tiny JPEG, MFCCs and vectors are seeded random numbers,
ids and cache keys are the real functions of their inputs.

Subjects: session ``bench-NNNN`` lists ``subject-{NNNN // 3}`` (each in three sessions),
and its lapel source alone lists ``speaker-{NNNN % 50}`` (the lapel of every 50th session).

Then it times, each in a fresh ``LineageStore`` (one DuckDB connection, as one CLI call):
``trace`` of an event id, a feature id, a timeline row, an output file, and ``access`` of a
session-level and of a source-level subject; best and worst of ``--repeat`` runs in this
process, and one ``modalign lineage ... --json`` command per query (wall time, with Python's
start and imports), printed as a markdown table. The target (issue 12) is under 2 s per query
at 1,000 sessions. Last (unless ``--no-erase``), on a copy of the OUT per subject, the CLI calls
``lineage erase --dry-run``, ``erase`` and ``verify`` of a session-level and of a source-level
subject, with the report's own ``elapsed_s``.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from modalign.operators.cache.keys import cache_key, feature_id
from modalign.operators.cache.store import FeatureCache
from modalign.pipeline.commits import CommitLog
from modalign.pipeline.layout import OutputLayout, attempt_of, write_jsonl, write_table
from modalign.pipeline.lease import Lease
from modalign.pipeline.runner import build_indexes
from modalign.pipeline.store import LocalStore
from modalign.schemas.arrow import rows_to_table
from modalign.schemas.config import RunConfig
from modalign.schemas.tables import (CtalRow, CtalSummaryRow, FeatureRow, MfccRow, RecordRow, SourceLineageRow,
                                     TextBlockRow, VideoFrameRow)

MS = 1_000_000
TICK_NS = 40 * MS
DURATION_NS = 2_000 * MS
LAPEL_OFFSET_NS = 730 * MS
IMAGE_MODEL, TEXT_MODEL, AUDIO_MODEL = "efficientnet-lite0@579344248a93", "all-minilm-l6-v2@53aa51172d14", "mfcc-stats@1"
DIMS = {IMAGE_MODEL: 1280, TEXT_MODEL: 384, AUDIO_MODEL: 80}
FACE_DETECTOR = "mediapipe-face-detection@0.10.21/full-range/tiles2+short-range"
TEXT_DETECTOR = "spacy-en_core_web_sm@3.8.0+regex@4+names=35280,words=64005"
VOICE_METHOD = "voiceanon@3/seg=4s/alpha=0.80..1.00/warp=-0.20..+0.20/f0=80..250Hz"
OPERATORS = {"video": "video_frames@0.2.0;face_blur@0.6.0;frame_text@0.2.0",
             "audio": "audio_mfcc@0.2.0;voice_policy@0.3.0", "pdf": "pdf_text@0.2.0;text_pii@0.2.0"}


def session_id(i: int) -> str:
    return f"bench-{i:04d}"


def session_subjects(i: int) -> list[str]:
    return [f"subject-{i // 3:04d}"]


def lapel_subjects(i: int) -> list[str]:
    return [f"speaker-{i % 50:02d}"]


def _jpeg() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 9), (90, 90, 90)).save(buf, format="JPEG", quality=50)
    return buf.getvalue()


def _unit(rng: np.random.Generator, dim: int) -> np.ndarray:
    v = rng.standard_normal(dim).astype(np.float32)
    return v / np.linalg.norm(v)


def _header(policy: str, method: str, detector: str, count: int, threshold: float = 0.5) -> dict:
    return {"policy": policy, "method": method, "detector": detector, "count": count, "threshold": threshold}


def generate(out: Path, sessions: int = 1000, *, seed: int = 0, config: RunConfig | None = None) -> dict:
    """Write and commit a synthetic OUT of ``sessions`` sessions; returns what it planted."""
    config = config or RunConfig()
    tag = config.policy.tag
    out = Path(out).absolute()
    layout = OutputLayout(out)
    run_id = uuid.uuid4().hex
    attempt = attempt_of(run_id)
    rng = np.random.default_rng(seed)
    jpeg = _jpeg()
    cache = FeatureCache(layout.cache_dir)
    committed: dict[str, dict] = {}
    planted: dict[str, Any] = {"policy": tag, "sessions": [], "features": {}, "sources": {}}
    out.mkdir(parents=True, exist_ok=True)
    with Lease(LocalStore(out), run_id) as lease:
        for i in range(sessions):
            sid = session_id(i)
            files = _session(layout, attempt, run_id, sid, i, tag, rng, jpeg, cache, planted)
            committed[sid] = {"run_id": run_id, "files": sorted(layout.relative(p) for p in files)}
            planted["sessions"].append(sid)
        cache.flush()
        features = sorted(f for s in committed.values() for f in s["files"] if f.startswith("features/"))
        indexes = build_indexes(layout, features, attempt)
        summary = {"run_id": run_id, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "elapsed_s": 0.0, "counts": {"sessions": sessions}, "indexes": indexes,
                   "versions": {"policy": tag}, "config": config.model_dump(mode="json"), "exit_code": 0}
        lease.check()
        snap = CommitLog(lease.store).commit(None, run_id=run_id, sessions=committed,
                                             shared=[ix["path"] for ix in indexes], summary=summary)
        lease.swept = True  # it wrote only what it committed, as a run leaves OUT after its sweep
    planted["commit"] = snap.version
    planted["run_id"] = run_id
    return planted


def _session(layout: OutputLayout, attempt: str, run_id: str, sid: str, i: int, tag: str,
             rng: np.random.Generator, jpeg: bytes, cache: FeatureCache, planted: dict) -> list[Path]:
    """Write one session's tables; returns the files written."""
    srcs = {  # source id -> (modality, uri, clock offset, clock method, reference, track_of)
        "room_video": ("video", f"file:///rec/{sid}/room.mp4", 0, "manifest", None, None),
        "room_video.audio": ("audio", f"file:///rec/{sid}/room.mp4", 0, "manifest", None, "room_video"),
        "lapel": ("audio", f"file:///rec/{sid}/lapel.wav", LAPEL_OFFSET_NS, "estimated", "room_video", None),
        "slides": ("pdf", f"file:///rec/{sid}/slides.pdf", 0, "manifest", None, None),
    }
    lin = {s: {"session_id": sid, "source_id": s, "source_uri": uri, "source_version": f"local:{1000 + i}:{i}",
               "operators": OPERATORS[mod], "policy": tag, "model_id": None}
           for s, (mod, uri, *_rest) in srcs.items()}
    planted["sources"][sid] = {s: lin[s]["source_uri"] for s in srcs}
    written: list[Path] = []
    feats: dict[tuple[str, str, str], list[dict]] = {}

    def feature(src: str, model: str, gran: str, modality: str, ev: str, t_ns: int, box: dict | None) -> None:
        vec = _unit(rng, DIMS[model])
        key = cache_key(vec.tobytes(), model_id=model, granularity=gran, resolution=None,
                        crop_box=None if box is None else (box["x0"], box["y0"], box["x1"], box["y1"]),
                        normalisation="bench")
        fid = feature_id(key, ev, gran, None if box is None else (box["x0"], box["y0"], box["x1"], box["y1"]))
        cache.put(key, gran, vec, model_id=model)
        feats.setdefault((src, model, gran), []).append(
            {**lin[src], "model_id": model, "feature_id": fid, "cache_key": key, "granularity": gran,
             "modality": modality, "event_id": ev, "t_ns": t_ns, "box": box, "dim": DIMS[model],
             "vector": vec.tolist()})
        planted["features"][fid] = {"session_id": sid, "source_id": src, "model_id": model, "event_id": ev}

    # video: 25 fps, a face box on every frame, two frame-text regions; frames and faces embedded at 1 fps
    video, deid_v = [], _header(tag, "blur_permute", FACE_DETECTOR, 1)
    for f in range(DURATION_NS // TICK_NS):
        t = f * TICK_NS
        face = {"x0": 400 + f, "y0": 20, "x1": 540 + f, "y1": 170, "score": 0.92}
        ev = f"{sid}/room_video/frame/{f}"
        video.append({**lin["room_video"], "event_id": ev, "t_ns": t, "pts": f * 512, "time_base": "1/12800",
                      "frame_index": f, "width": 640, "height": 360, "frame_jpeg": jpeg, "face_boxes": [face],
                      "deid": deid_v, "text_boxes": [{"x0": 80, "y0": 126, "x1": 267, "y1": 146, "score": 0.95}],
                      "text_deid": _header(tag, "blur_permute", "tesseract@5.3.0+" + TEXT_DETECTOR, 1)})
        if f % 25 == 0:
            feature("room_video", IMAGE_MODEL, "frame", "video", ev, t, None)
            feature("room_video", IMAGE_MODEL, "roi", "video", ev, t, face)
    written.append(write_table(layout.events(VideoFrameRow, sid, "room_video", attempt, 0),
                               rows_to_table(VideoFrameRow, video)))
    # audio: 100 MFCC frames/s per source (the lapel starts 730 ms late), embedded once a second
    deid_a = _header(tag, VOICE_METHOD, "none", 0, 0.0)
    for src in ("room_video.audio", "lapel"):
        offset = srcs[src][2]
        rows = []
        for k in range((DURATION_NS - offset) // (10 * MS)):
            t = offset + k * 10 * MS
            ev = f"{sid}/{src}/mfcc/{k}"
            rows.append({**lin[src], "event_id": ev, "t_ns": t, "frame_index": k,
                         "mfcc": rng.standard_normal(40).astype(np.float32).tolist(), "voiced": k % 3 != 0,
                         "deid": deid_a})
            if k % 100 == 0:
                feature(src, AUDIO_MODEL, "frame", "audio", ev, t, None)
        written.append(write_table(layout.events(MfccRow, sid, src, attempt, 0), rows_to_table(MfccRow, rows)))
    # slides: 2 pages x 2 blocks, a pseudonymised name on every first block
    blocks, deid_t = [], _header(tag, "pseudonymise", TEXT_DETECTOR, 1)
    for page in range(2):
        for b in range(2):
            ev = f"{sid}/slides/block/{page * 1000 + b}"
            box = {"x0": 166, "y0": 142 + 300 * b, "x1": 1575, "y1": 246 + 300 * b, "score": 1.0}
            token = f"<PERSON_{(i * 31 + page) % 2**32:08x}>"
            words = [{"text": "Presented", "x0": 222, "y0": 471, "x1": 577, "y1": 544, "conf": 100.0, "entity": None}]
            if b == 0:
                words.append({"text": token, "x0": 702, "y0": 471, "x1": 888, "y1": 544, "conf": 100.0,
                              "entity": "person"})
            blocks.append({**lin["slides"], "event_id": ev, "t_ns": page * 1000 * MS,
                           "end_t_ns": (page + 1) * 1000 * MS if page == 0 else None, "page_index": page,
                           "block_index": b, "text": " ".join(w["text"] for w in words), "words": words, "box": box,
                           "extraction": "text_layer", "dpi": 200, "timing": "schedule",
                           "pii_counts": [{"kind": "person", "count": 1}] if b == 0 else [],
                           "deid": dict(deid_t, count=1 if b == 0 else 0)})
            feature("slides", TEXT_MODEL, "roi", "pdf", ev, page * 1000 * MS, box)
    written.append(write_table(layout.events(TextBlockRow, sid, "slides", attempt, 0),
                               rows_to_table(TextBlockRow, blocks)))
    # features, one file per (source, model, granularity)
    for (src, model, gran), rows in feats.items():
        written.append(write_table(layout.features(model, gran, sid, src, attempt, 0), rows_to_table(FeatureRow, rows)))
    # the aligned timeline, CTAL log (the lapel's gaps) and summary
    records, ctal = [], []
    ticks = DURATION_NS // TICK_NS
    for k in range(ticks):
        t = k * TICK_NS
        for src, (mod, *_r) in srcs.items():
            if src == "lapel" and t < LAPEL_OFFSET_NS:
                ev, et = None, None
            elif mod == "video":
                ev, et = f"{sid}/room_video/frame/{k}", t
            elif mod == "audio":
                j = (t - srcs[src][2]) // (10 * MS)
                ev, et = f"{sid}/{src}/mfcc/{j}", srcs[src][2] + j * 10 * MS
            else:
                page = t // (1000 * MS)
                ev, et = f"{sid}/slides/block/{page * 1000}", page * 1000 * MS
            records.append({**lin[src], "tick_index": k, "t_ns": t, "modality": mod, "event_id": ev,
                            "event_t_ns": et, "residual_ns": None if et is None else et - t,
                            "decision": "gap" if ev is None else "matched"})
        if t < LAPEL_OFFSET_NS:
            ctal.append({"event_id": f"{sid}/ctal/{k}", "trace_id": uuid.UUID(int=i).hex, "session_id": sid,
                         "stage": "align", "tick_index": k, "aligned_t_ns": t,
                         "modalities": [f"{m}:{s}" for s, (m, *_r) in srcs.items()],
                         "observed_offsets_ns": [None if s == "lapel" else 0 for s in srcs], "decision": "gap",
                         "reason": "no event within tolerance: lapel", "latency_ms": [1.0] * len(srcs)})
    written.append(write_table(layout.records(sid, attempt), rows_to_table(RecordRow, records)))
    written.append(write_table(layout.ctal(sid, attempt), rows_to_table(CtalRow, ctal)))
    written.append(write_jsonl(layout.ctal_jsonl(sid, attempt), ctal))
    summary = []
    for src, (mod, _uri, offset, method, _ref, _t) in srcs.items():
        gaps = sum(1 for r in records if r["source_id"] == src and r["decision"] == "gap")
        summary.append({"session_id": sid, "source_id": src, "modality": mod, "ticks": ticks, "matched": ticks - gaps,
                        "gaps": gaps, "late": 0, "residual_p50_ms": 0.0, "residual_p95_ms": 0.0,
                        "residual_max_ms": 10.0 if src == "lapel" else 0.0, "offset_ns": offset, "skew_ppm": 0.0,
                        "offset_method": method, "offset_confidence": 0.97 if method == "estimated" else None})
    written.append(write_table(layout.ctal_summary(sid, attempt), rows_to_table(CtalSummaryRow, summary)))
    # per source lineage, with the subjects (the session's, and the lapel's own)
    deid = {"video": [deid_v | {"count": len(video)}, _header(tag, "blur_permute", "tesseract@5.3.0+" + TEXT_DETECTOR,
                                                              len(video))],
            "audio": [deid_a], "pdf": [deid_t | {"count": 2}]}
    counts = {"room_video": len(video), "slides": len(blocks), "room_video.audio": 200,
              "lapel": (DURATION_NS - LAPEL_OFFSET_NS) // (10 * MS)}
    lineage = []
    for src, (mod, uri, offset, method, ref, track_of) in srcs.items():
        subjects = session_subjects(i) + (lapel_subjects(i) if src == "lapel" else [])
        lineage.append({"run_id": run_id, "session_id": sid, "source_id": src, "source_uri": uri,
                        "source_version": lin[src]["source_version"], "modality": mod, "status": "ingested",
                        "events": counts[src], "operators": OPERATORS[mod], "policy": tag, "deid": deid[mod],
                        "subjects": subjects, "clock_offset_ns": offset, "clock_skew_ppm": 0.0,
                        "clock_method": method, "clock_reference": ref, "track_of": track_of,
                        "source_sha256": "sha256:" + f"{i:064x}"})
    written.append(write_table(layout.lineage_sources(sid, attempt), rows_to_table(SourceLineageRow, lineage)))
    return written


def _time(fn, repeat: int) -> tuple[float, float, Any]:
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), max(times), result


def _erasure_times(out: Path, subject: str, scratch: Path) -> dict:
    """``lineage erase --dry-run``, ``erase`` and ``verify`` of ``subject`` as CLI calls, on a copy of
    ``out`` (synced to disk first, so the copy's writeback is not timed) with a fresh key store."""
    import os

    work, keys = scratch / f"erase-{subject}", scratch / f"keys-{subject}"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(out, work)
    os.sync()
    env = {**os.environ, "MODALIGN_KEY_STORE": str(keys)}
    cli = [sys.executable, "-m", "modalign.pipeline.cli", "lineage"]
    times = {}
    try:
        for name, extra in (("dry_run_s", ["--dry-run"]), ("erase_s", [])):
            t0 = time.perf_counter()
            done = subprocess.run([*cli, "erase", str(work), "--subject", subject, "--json", *extra], env=env,
                                  check=True, capture_output=True, text=True)
            times[name] = round(time.perf_counter() - t0, 3)
        report = json.loads(done.stdout)
        t0 = time.perf_counter()
        subprocess.run([*cli, "verify", report["report_path"], "--subject", subject], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        times["verify_s"] = round(time.perf_counter() - t0, 3)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(keys, ignore_errors=True)
    n = report["counts"]
    return {"subject": subject, **times, "elapsed_s": report["elapsed_s"],
            "erased": f"{len(report['sources'])} sources, {sum(v for k, v in n.items() if k != 'cache_entries')} "
                      f"rows, {len(report['removed_files'])} files"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", help="write (or reuse, if it holds a commit) the generated OUT here; default: a temp dir")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-erase", action="store_true", help="time the queries only (the erasures copy the OUT)")
    args = ap.parse_args()

    from modalign.pipeline.lineage import LineageStore, access, trace

    tmp = None
    if args.out:
        out = Path(args.out)
    else:
        tmp = tempfile.mkdtemp(prefix="modalign-lineage-bench-")
        out = Path(tmp) / "out"
    try:
        t0 = time.perf_counter()
        if CommitLog.of(out).latest() is None:
            generate(out, args.sessions)
            gen_s = time.perf_counter() - t0
        else:
            gen_s = None
        with LineageStore(out) as store:
            n_sessions = len(store.snapshot.sessions)
            n_files = len(store.snapshot.files())
            mid_session = [session_id(n_sessions // 2)]
            fid = store.query(f"SELECT feature_id FROM ({store.source('features', mid_session)}) WHERE "
                              "granularity = 'roi' AND modality = 'video' LIMIT 1")[0]["feature_id"]
            evfile = store.files("events_pdf", [session_id(n_sessions - 1)])[0]
        mid = n_sessions // 2
        queries = [  # (name, the argument, the query in-process, the same on the command line)
            ("trace event id", f"{session_id(mid)}/slides/block/0", "trace"),
            ("trace feature id", str(fid), "trace"),
            ("trace timeline row", f"{session_id(mid)}:30", "trace"),
            ("trace output file", evfile, "trace"),
            ("access, session-level subject", session_subjects(mid)[0], "access"),
            ("access, source-level subject", lapel_subjects(mid)[0], "access"),
        ]
        rows = []
        for name, arg, kind in queries:
            fn = (lambda a=arg: trace(out, a)) if kind == "trace" else (lambda a=arg: access(out, a))
            best, worst, res = _time(fn, args.repeat)
            size = (f"{len(res['origins'])} source(s)" if "origins" in res else
                    f"{res['counts']['sessions']} sessions, {res['counts']['events']} events, "
                    f"{res['counts']['features']} features")
            cli = [sys.executable, "-m", "modalign.pipeline.cli", "lineage", kind, str(out)]
            cli += [arg, "--json"] if kind == "trace" else ["--subject", arg, "--json"]
            t0 = time.perf_counter()
            subprocess.run(cli, check=True, stdout=subprocess.DEVNULL)
            rows.append({"query": name, "id": arg, "best_s": round(best, 3), "worst_s": round(worst, 3),
                         "cli_s": round(time.perf_counter() - t0, 3), "answer": size})
        erasures = [] if args.no_erase else [
            _erasure_times(out, subject, Path(tmp or tempfile.mkdtemp(prefix="modalign-erase-bench-")))
            for subject in (session_subjects(mid)[0], lapel_subjects(mid + 1)[0])]
        if args.json:
            print(json.dumps({"sessions": n_sessions, "files": n_files, "generate_s": gen_s, "rows": rows,
                              "erasures": erasures}, indent=2))
            return 0
        gen = f", generated in {gen_s:.0f} s" if gen_s is not None else ""
        print(f"lineage queries, {n_sessions} sessions, {n_files} committed files{gen}; "
              f"each query opens a fresh store (best / worst of {args.repeat}); target < 2 s\n")
        print("| query | id | best (s) | worst (s) | CLI call, wall (s) | answer |")
        print("| --- | --- | ---: | ---: | ---: | --- |")
        for r in rows:
            print(f"| {r['query']} | `{r['id']}` | {r['best_s']:.3f} | {r['worst_s']:.3f} | {r['cli_s']:.3f} | "
                  f"{r['answer']} |")
        print(f"\nmedian of the best: {statistics.median(r['best_s'] for r in rows):.3f} s")
        if erasures:
            print("\nerasure on a copy of the OUT (CLI calls, wall; `elapsed_s`: the erasure's own work up to its "
                  "commit)\n")
            print("| subject | erased | dry run (s) | erase (s) | elapsed_s | verify (s) |")
            print("| --- | --- | ---: | ---: | ---: | ---: |")
            for e in erasures:
                print(f"| `{e['subject']}` | {e['erased']} | {e['dry_run_s']:.2f} | {e['erase_s']:.2f} | "
                      f"{e['elapsed_s']:.2f} | {e['verify_s']:.2f} |")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
