"""GPU check of the image encoder: images/s and peak GPU memory per batch size, bf16 autocast.

    python benchmarks/gpu_check.py [--frames 512] [--height 360 --width 640] [--repeat 3]

On a machine with CUDA: EfficientNet-Lite0 (``ImageEncoder``, device cuda: uint8 frames
copied from pinned memory, resized and normalised on the GPU, bf16 autocast, grids read
back as float32) over ``--frames`` synthetic frames, for batch sizes 32, 64, 128 and 256;
reports images/s (best of ``--repeat``, after a warm-up pass) and
``torch.cuda.max_memory_allocated`` per batch size, plus the agreement of bf16 frame
vectors with the CPU fp32 ones. Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


BATCH_SIZES = (32, 64, 128, 256)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frames", type=int, default=512)
    ap.add_argument("--height", type=int, default=360)
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("no GPU present (torch.cuda.is_available() is False): nothing measured")
        return 0

    from modalign.operators.embed.image import ImageEmbedConfig, ImageEncoder

    rng = np.random.default_rng(0)
    # smooth random images (a noise field upsampled) rather than white noise: closer to video content
    base = rng.integers(0, 256, (args.frames, args.height // 8, args.width // 8, 3), dtype=np.uint8)
    frames = np.ascontiguousarray(base.repeat(8, axis=1).repeat(8, axis=2))
    name = torch.cuda.get_device_name(0)
    print(f"# GPU check: {name}, torch {torch.__version__}, {args.frames} frames {args.width}x{args.height}, "
          f"EfficientNet-Lite0 at 224, bf16 autocast, best of {args.repeat}\n")
    print("| batch size | images/s | peak GPU memory (max_memory_allocated) | forward passes |")
    print("| --- | --- | --- | --- |")
    for bs in BATCH_SIZES:
        enc = ImageEncoder(ImageEmbedConfig(device="cuda", batch_size=bs))
        enc.patch_grids(frames[:bs])  # warm-up: load, cuDNN autotune, allocator
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        best = float("inf")
        calls = enc.forward_calls
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            enc.patch_grids(frames)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() / 2**20
        per_run = (enc.forward_calls - calls) // args.repeat
        print(f"| {bs} | {args.frames / best:.0f} | {peak:.0f} MiB | {per_run} |")
        del enc
        torch.cuda.empty_cache()

    cpu = ImageEncoder(ImageEmbedConfig(device="cpu"))
    gpu = ImageEncoder(ImageEmbedConfig(device="cuda"))
    sample = frames[:8]
    a = cpu.embed_frames(sample)["frame"]
    b = gpu.embed_frames(sample)["frame"]
    cos = (a * b).sum(axis=1)
    print(f"\nbf16 (GPU) vs fp32 (CPU) frame vectors, 8 frames: cosine min {cos.min():.4f}, mean {cos.mean():.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
