"""The embedding drift monitor on real embeddings with planted shifts: ``python benchmarks/monitors.py [--duration S] [--fps F]``.

Issue 15's validation. Frames of the sample meeting's room video (``generate_sample``, 640x360;
``--video FILE`` for another) sampled at ``--fps`` go through the product's image encoder
(EfficientNet-Lite0, its packaged weights, on the CPU) to frame vectors, and through
``DriftMonitor`` with the default ``EmbeddingMonitorConfig`` (windows of 32, the first 8 the
reference). From window ``--shift-at`` (default 20) on, one of:

- ``stationary``: nothing changes (the false-alarm rate is counted over every scored window);
- ``lighting``: the frames darkened to 89/142 of their brightness (the field's bright-RGB model
  fed dark frames: brightness mean 142 in training, 89 in production);
- ``noise``: uniform random frames instead of the video;
- ``swapped encoder``: the same frames through an EfficientNet-Lite0 of other weights (seeded
  random initialisation) under the same stream, as when a checkpoint file is replaced.

Prints per run: scored windows, false alarms before the shift, the delay of the first alarm in
windows after the shift, the share of shifted windows that alarmed, and the monitor's cost per
window; then the false-alarm rate over all unshifted scored windows.
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


def monitored(vectors: np.ndarray, window: int) -> tuple[list, float]:
    from modalign.operators.monitor.embedding_drift import DriftMonitor, split_windows
    from modalign.schemas.config import EmbeddingMonitorConfig

    m = DriftMonitor(EmbeddingMonitorConfig(window=window), vectors.shape[1])
    t = time.perf_counter()
    res = [m.observe(vectors[w]) for w in split_windows(len(vectors), window)]
    return res, (time.perf_counter() - t) / max(1, len(res))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of the generated sample (default 300)")
    ap.add_argument("--fps", type=float, default=4.0, help="frames sampled per second of video (default 4)")
    ap.add_argument("--video", type=Path, help="monitor this video instead of a generated sample")
    ap.add_argument("--shift-at", type=int, default=20, help="first shifted window (default 20)")
    ap.add_argument("--window", type=int, default=32)
    args = ap.parse_args(argv)

    from modalign.operators.monitor.embedding_drift import split_windows
    from modalign.pipeline.sample import generate_sample

    with tempfile.TemporaryDirectory(prefix="modalign-monitors-") as tmp:
        work = Path(tmp)
        if args.video is None:
            print(f"generating a {args.duration:g} s sample ...", file=sys.stderr, flush=True)
            generate_sample(work / "sample", duration_s=args.duration)
            video = work / "sample" / "room.mp4"
        else:
            video = args.video
        frames = sampled_frames(video, args.fps)
        windows = split_windows(len(frames), args.window)
        if len(windows) <= args.shift_at:
            ap.error(f"{len(frames)} frames make {len(windows)} windows: need more than --shift-at {args.shift_at}")
        cut = windows[args.shift_at].start  # the first shifted frame
        print(f"{len(frames)} frames, {len(windows)} windows; embedding ...", file=sys.stderr, flush=True)
        enc = encoder()
        t = time.perf_counter()
        base = embed(enc, frames)
        per_frame = (time.perf_counter() - t) / len(frames)
        rng = np.random.default_rng(0)
        shifted = {
            "stationary": base,
            "lighting": np.concatenate([base[:cut], embed(enc, (frames[cut:] * LIGHTING).round().astype(np.uint8))]),
            "noise": np.concatenate([base[:cut], embed(enc, rng.integers(0, 256, frames[cut:].shape, np.uint8))]),
            "swapped encoder": np.concatenate([base[:cut], embed(encoder(other_weights(work)), frames[cut:])]),
        }
        print(f"\nembedding drift monitor, {video.name if args.video else f'sample meeting {args.duration:g} s'} at "
              f"{args.fps:g} fps ({len(frames)} frames, EfficientNet-Lite0 {per_frame * 1000:.0f} ms per frame on "
              f"the CPU), windows of {args.window}, reference 8 windows, shift from window {args.shift_at}\n")
        print("| run | scored windows | false alarms before the shift | first alarm after the shift (windows) | "
              "shifted windows alarmed | norm alarms | monitor ms per window |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        unshifted = false = 0
        for name, vecs in shifted.items():
            res, cost = monitored(vecs, args.window)
            scored = [r for r in res if not r.reference]
            before = [r for r in scored if r.index < args.shift_at]
            after = [r for r in scored if r.index >= args.shift_at]
            if name == "stationary":
                before, after = scored, []
            unshifted += len(before)
            false += sum(r.drift_alarm for r in before)
            first = next((r.index - args.shift_at for r in after if r.drift_alarm), None)
            print(f"| {name} | {len(scored)} | {sum(r.drift_alarm for r in before)} of {len(before)} | "
                  f"{'-' if name == 'stationary' else ('none' if first is None else first)} | "
                  f"{'-' if not after else f'{sum(r.drift_alarm for r in after)} of {len(after)}'} | "
                  f"{sum(r.norm_alarm for r in res)} | {cost * 1000:.2f} |")
        print(f"\n- false-alarm rate over the unshifted scored windows: {false} of {unshifted} "
              f"({false / max(1, unshifted):.1%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
