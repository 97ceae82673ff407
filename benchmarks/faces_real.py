"""Faces on real footage: ``python benchmarks/faces_real.py [--quick] [--no-videos]``.

Prints a markdown table per dataset (``modalign.pipeline.deid_eval.faces.eval_face_clips``):
frames where an independent detector (OpenCV Haar, dlib HOG) still finds a face inside a
face region after anonymisation (target 0), frames a dlib descriptor links to the original
(distance < 0.6, target 0), frames whose face is not covered, false boxes (touching no face
region) against faces per frame. Datasets: real faces composed over real video frames
(astronaut and an LFW face, with motion, scale change, an occluder, motion blur), skimage's
LFW subset as stills (faces; non-faces: every box is false), and Debian opencv-doc's
``Megamind.avi`` and ``vtest.avi`` (pedestrians, faces of ~15 px), whose face regions are the
union of dlib HOG and Haar detections on the original frames.

Then the cost per 1280x720 frame of ``FaceBlurOperator`` (default policy, tables of 16
frames) beside a bare mediapipe full-range call on the same frames, both in this process
pinned to one core (target <= 30 ms); the machine may be shared, so read the ratio.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

os.environ.setdefault("OMP_NUM_THREADS", "1")

TARGET_MS = 30.0


def cost_720p(frames: list[np.ndarray], repeat: int = 3, face=None) -> tuple[float, float]:
    """(operator ms per frame, bare mediapipe full-range ms per frame), best of ``repeat``
    (``face``: the FacePolicy, default the default policy's)."""
    import mediapipe as mp
    import pyarrow as pa

    from modalign.operators.deid.faces import FaceBlurConfig, FaceBlurOperator

    op = FaceBlurOperator(FaceBlurConfig(secret=b"bench" * 8, **({"face": face} if face is not None else {})))
    op.setup()
    bare = mp.solutions.face_detection.FaceDetection(model_selection=1, min_detection_confidence=0.5)
    tables = []
    for s in range(0, len(frames), 16):
        part = frames[s:s + 16]
        tables.append(pa.table({"event_id": [f"bench/video/{s + i}" for i in range(len(part))],
                                "t_ns": pa.array([(s + i) * 40_000_000 for i in range(len(part))], pa.int64()),
                                "frame": pa.FixedShapeTensorArray.from_numpy_ndarray(np.stack(part))}))
    best_op = best_bare = float("inf")
    for _ in range(repeat):
        op.reset()
        t0 = time.process_time()
        for t in tables:
            op.process(t)
        op.flush()  # the rows held back for look-ahead
        best_op = min(best_op, time.process_time() - t0)
        t0 = time.process_time()
        for f in frames:
            bare.process(f)
        best_bare = min(best_bare, time.process_time() - t0)
    return 1e3 * best_op / len(frames), 1e3 * best_bare / len(frames)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the composed clip only (run_eval's quick slice)")
    ap.add_argument("--no-videos", action="store_true", help="skip the opencv-doc videos")
    ap.add_argument("--full-every", type=int, default=None,
                    help="FacePolicy.full_every to measure (default: the default policy's)")
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    from modalign.pipeline.deid_eval.faces import compose_clip, eval_face_clips, render_face_clips
    from modalign.schemas.policy import DeidPolicy, FacePolicy

    policy = DeidPolicy()
    if args.full_every is not None:
        policy = policy.model_copy(update={"face": FacePolicy(**{**policy.face.model_dump(), "full_every": args.full_every})})
    t0 = time.perf_counter()
    report = eval_face_clips(quick=args.quick, policy=policy, videos=not args.no_videos)
    print("\n".join(render_face_clips(report)))
    print("| dataset | re-detected (Haar or HOG) | Haar / HOG after | linked (dlib < 0.6) (floor) | min distance "
          "| uncovered | false boxes / boxes |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in report["clips"]:
        print(f"| {r['dataset']} | {r['redetected_frames']} of {r['face_frames']} | {r['haar_after']} / "
              f"{r['hog_after']} | {r['linked_frames']} ({r['linked_floor_frames']}) | {r['dist_after_min']:.3f} | {r['uncovered_frames']} | "
              f"{r['false_boxes']} / {r['boxes']} |")
    clip = compose_clip(n=48)
    ms_op, ms_bare = cost_720p(clip.frames, face=policy.face)
    print()
    print("| cost per 1280x720 frame, one core (CPU time) | ms | x bare call | target |")
    print("| --- | --- | --- | --- |")
    print(f"| FaceBlurOperator, full_every {policy.face.full_every} | {ms_op:.1f} | {ms_op / ms_bare:.2f} | <= {TARGET_MS:.0f} ms |")
    print(f"| bare mediapipe full-range call | {ms_bare:.1f} | 1.00 | |")
    print(f"\n{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
