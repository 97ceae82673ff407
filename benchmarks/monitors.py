"""The embedding drift monitor on real embeddings with planted shifts: ``python benchmarks/monitors.py [--duration S] [--fps F]``.

Issue 15's validation. Sample meetings (``generate_sample``: 640x360, a slide panel whose page
changes every quarter of the session, people moving) are sampled at ``--fps`` (1, as the
pipeline embeds video) and go through the product's image encoder (EfficientNet-Lite0, its
packaged weights, on the CPU) to frame vectors, then through ``DriftMonitor`` with the default
``EmbeddingMonitorConfig`` (windows of 32). As with ``--reference OUT0``, the reference is every
window of another session of the same kind (seed 1, half as long: every slide in it). The
monitored streams are sessions of seeds 0 and 2; from window ``--shift-at`` (default 9) of
seed 0's, one of:

- ``stationary``: nothing changes (false alarms counted over every window of both streams);
- ``lighting``: the frames darkened to 89/142 of their brightness (the field's bright-RGB model
  fed dark frames: brightness mean 142 in training, 89 in production);
- ``noise``: uniform random frames instead of the video;
- ``swapped encoder``: the same frames through an EfficientNet-Lite0 of other weights (seeded
  random initialisation) under the same stream, as when a checkpoint file is replaced.

A last row monitors the stationary stream with the default reference instead (its own first 8
windows): a slide the reference never showed is a change to it.

Prints per run: scored windows, false alarms before the shift, the delay of the first alarm in
windows after the shift, the share of shifted windows that alarmed, and the monitor's cost per
window; then the false-alarm rate over the unshifted scored windows.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
LIGHTING = 89 / 142


def sampled_frames(video: Path, fps: float) -> np.ndarray:
    """(n, H, W, 3) uint8 RGB frames of ``video``, one every 1/fps seconds."""
    import av

    out, next_t = [], 0.0
    with av.open(str(video)) as c:
        for frame in c.decode(video=0):
            t = float(frame.pts * frame.time_base)
            if t + 1e-9 >= next_t:
                out.append(frame.to_ndarray(format="rgb24"))
                next_t += 1.0 / fps
    return np.stack(out)


def encoder(weights: Path | None = None):
    from modalign.operators.embed.image import ImageEmbedConfig, ImageEncoder

    enc = ImageEncoder(ImageEmbedConfig(weights_path=weights, device="cpu"))
    enc.load()
    return enc


def other_weights(folder: Path, seed: int = 7) -> Path:
    """An EfficientNet-Lite0 state dict of seeded random weights (the swapped checkpoint)."""
    import torch
    from efficientnet_lite_pytorch import EfficientNet

    torch.manual_seed(seed)
    path = folder / "swapped-lite0.pth"
    torch.save(EfficientNet.from_name("efficientnet-lite0", num_classes=1000).state_dict(), path)
    return path


def embed(enc, frames: np.ndarray, batch: int = 32) -> np.ndarray:
    return np.concatenate([enc.embed_frames(frames[i:i + batch])["frame"] for i in range(0, len(frames), batch)])


def monitored(vectors: np.ndarray, window: int, reference: np.ndarray | None) -> tuple[list, float]:
    from modalign.operators.monitor.embedding_drift import DriftMonitor, split_windows
    from modalign.schemas.config import EmbeddingMonitorConfig

    m = DriftMonitor(EmbeddingMonitorConfig(window=window), vectors.shape[1])
    if reference is not None:
        m.seed_reference([reference[w] for w in split_windows(len(reference), window)])
    t = time.perf_counter()
    res = [m.observe(vectors[w]) for w in split_windows(len(vectors), window)]
    return res, (time.perf_counter() - t) / max(1, len(res))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of each monitored session (default 600)")
    ap.add_argument("--fps", type=float, default=1.0, help="frames sampled per second of video (default 1)")
    ap.add_argument("--shift-at", type=int, default=9, help="first shifted window (default 9)")
    ap.add_argument("--window", type=int, default=32)
    args = ap.parse_args(argv)

    from modalign.operators.monitor.embedding_drift import split_windows
    from modalign.pipeline.sample import generate_sample

    with tempfile.TemporaryDirectory(prefix="modalign-monitors-") as tmp:
        work = Path(tmp)
        enc = encoder()
        frames, vecs = {}, {}
        t = time.perf_counter()
        for seed, duration in ((0, args.duration), (2, args.duration), (1, args.duration / 2)):
            print(f"sample seed {seed}, {duration:g} s: generating, embedding ...", file=sys.stderr, flush=True)
            generate_sample(work / f"s{seed}", duration_s=duration, seed=seed)
            frames[seed] = sampled_frames(work / f"s{seed}" / "room.mp4", args.fps)
            vecs[seed] = embed(enc, frames[seed])
        per_frame = (time.perf_counter() - t) / sum(len(f) for f in frames.values())
        windows = split_windows(len(frames[0]), args.window)
        if len(windows) <= args.shift_at:
            ap.error(f"{len(frames[0])} frames make {len(windows)} windows: need more than --shift-at {args.shift_at}")
        cut = windows[args.shift_at].start  # the first shifted frame
        rest = frames[0][cut:]
        rng = np.random.default_rng(0)
        runs = {
            "stationary (seed 0)": (vecs[0], vecs[1]),
            "stationary (seed 2)": (vecs[2], vecs[1]),
            "lighting": (np.concatenate([vecs[0][:cut], embed(enc, (rest * LIGHTING).round().astype(np.uint8))]),
                         vecs[1]),
            "noise": (np.concatenate([vecs[0][:cut], embed(enc, rng.integers(0, 256, rest.shape, np.uint8))]), vecs[1]),
            "swapped encoder": (np.concatenate([vecs[0][:cut], embed(encoder(other_weights(work)), rest)]), vecs[1]),
            "stationary (seed 0), reference: its own first 8 windows": (vecs[0], None),
        }
        print(f"\nembedding drift monitor on sample meetings of {args.duration:g} s at {args.fps:g} fps "
              f"({len(frames[0])} frames each; time per frame, generation included: {per_frame * 1000:.0f} ms), "
              f"EfficientNet-Lite0 frame vectors, windows of {args.window}, reference: the {len(frames[1])} frames "
              f"of a session of seed 1; shift from window {args.shift_at}\n")
        print("| run | scored windows | false alarms before the shift | first alarm after the shift (windows) | "
              "shifted windows alarmed | norm alarms | monitor ms per window |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        unshifted = false = 0
        for name, (stream, reference) in runs.items():
            res, cost = monitored(stream, args.window, reference)
            scored = [r for r in res if not r.reference]
            planted = not name.startswith("stationary")
            before = [r for r in scored if r.index < args.shift_at] if planted else scored
            after = [r for r in scored if r.index >= args.shift_at] if planted else []
            if reference is not None and not planted:
                unshifted += len(before)
                false += sum(r.drift_alarm for r in before)
            first = next((r.index - args.shift_at for r in after if r.drift_alarm), None)
            print(f"| {name} | {len(scored)} | {sum(r.drift_alarm for r in before)} of {len(before)} | "
                  f"{'none' if planted and first is None else (first if planted else '-')} | "
                  f"{f'{sum(r.drift_alarm for r in after)} of {len(after)}' if planted else '-'} | "
                  f"{sum(r.norm_alarm for r in res)} | {cost * 1000:.2f} |")
        print(f"\n- false-alarm rate, stationary streams against the other session's reference: {false} of "
              f"{unshifted} windows ({false / max(1, unshifted):.1%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
