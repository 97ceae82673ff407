"""Modality quality gates: per-record properties with analytically known values, expectations that
warn, drop (one quarantine row per contiguous run, whatever the batching) and fail, and the shift
check that alarms on a darkened copy of a frame stream and not on an unchanged one."""

from __future__ import annotations

import math
import wave
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from modalign.operators.quality.audio import CLIP_LEVEL, AudioQualityMeter, clipping_ratio, loudness_dbfs
from modalign.operators.quality.gate import QualityGate
from modalign.operators.quality.shift import compare, psi, summarize
from modalign.operators.quality.text import ocr_confidence
from modalign.operators.quality.video import SHARPNESS_SIDE, frame_quality, pixel_channels, sharpness
from modalign.schemas.config import QualityConfig, QualityExpectation, QualityShiftConfig, RunConfig
from modalign.schemas.errors import QualityGateError, QuarantineReason
from modalign.schemas.tables import QuarantineRow

pytestmark = pytest.mark.unit

RATE, WIN, HOP = 16_000, 400, 160
MS = 1_000_000


# -- video properties ------------------------------------------------------------------------

def grey(v: int, h: int = 90, w: int = 160) -> np.ndarray:
    return np.full((h, w, 3), v, np.uint8)


@pytest.mark.parametrize("v", [0, 37, 142, 255])
def test_a_flat_grey_frame_has_its_level_as_brightness_and_no_contrast_or_sharpness(v):
    assert frame_quality(grey(v)) == (pytest.approx(v), 0.0, 0.0)


def test_brightness_is_bt601_luma():
    red, green, blue = (np.zeros((40, 60, 3), np.uint8) for _ in range(3))
    red[..., 0], green[..., 1], blue[..., 2] = 200, 200, 200
    for img, weight in ((red, 0.299), (green, 0.587), (blue, 0.114)):
        assert frame_quality(img)[0] == pytest.approx(200 * weight, abs=0.51)  # integer luma


def test_half_black_half_white_has_the_contrast_and_sharpness_of_one_step_edge():
    h, w = 90, 160
    img = np.zeros((h, w, 3), np.uint8)
    img[:, w // 2:] = 255
    brightness, contrast, sharp = frame_quality(img)
    assert brightness == pytest.approx(127.5) and contrast == pytest.approx(127.5)
    # interior Laplacian: -255 left of the edge, +255 right of it, 0 elsewhere (mean 0)
    assert sharp == pytest.approx(255 ** 2 * 2 / (w - 2), rel=1e-5)


def test_a_one_pixel_checkerboard_has_the_largest_laplacian_variance():
    cb = (np.indices((100, 200)).sum(0) % 2 * 255).astype(np.uint8)
    assert sharpness(cb) == pytest.approx((4 * 255) ** 2, rel=1e-6)
    assert frame_quality(np.repeat(cb[..., None], 3, axis=2))[1] == pytest.approx(127.5)


def test_sharpness_is_measured_downscaled_so_a_pixel_repeated_upscale_reads_the_same():
    small = np.random.default_rng(0).integers(0, 256, (180, SHARPNESS_SIDE), dtype=np.uint8)
    big = np.kron(small, np.ones((2, 2), np.uint8))  # 640x360: block means give `small` back
    assert sharpness(big) == pytest.approx(sharpness(small), rel=1e-5)
    blurred = (small[:, :-1].astype(np.uint16) + small[:, 1:]) // 2  # a blur lowers it a lot
    assert sharpness(blurred.astype(np.uint8)) < 0.5 * sharpness(small)


def _write_video(path: Path, frames: list[np.ndarray], *, codec: str = "libx264", pix_fmt: str = "yuv420p",
                 gop: int = 25) -> None:
    import av

    h, w = frames[0].shape[:2]
    with av.open(str(path), "w") as c:
        s = c.add_stream(codec, rate=25)
        s.width, s.height, s.pix_fmt = w, h, pix_fmt
        s.codec_context.time_base = Fraction(1, 25)
        if codec == "libx264":
            s.options = {"crf": "10", "g": str(gop), "keyint_min": str(gop), "sc_threshold": "0"}
            s.thread_count = 1
        for i, img in enumerate(frames):
            f = av.VideoFrame.from_ndarray(img, format="rgb24" if img.ndim == 3 else "gray")
            f.pts, f.time_base = i, Fraction(1, 25)
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode(None):
            c.mux(p)


def _read_video(path: Path) -> list[pa.Table]:
    from modalign.operators.ingest.base import SourceContext
    from modalign.operators.ingest.video import VideoFramesConfig, VideoFramesOperator
    from modalign.schemas.manifest import ClockMapping, SourceSpec

    spec = SourceSpec(id="cam", uri=path.name, modality="video", clock=ClockMapping(offset_ns=0))
    ctx = SourceContext(session_id="s", spec=spec, path=path, uri=path.as_uri(), version="v")
    return list(VideoFramesOperator(VideoFramesConfig()).read(ctx))


def test_decoded_frames_carry_their_properties_and_the_stream_s_channels(tmp_path):
    """A real decode: H.264 yuv420p frames of grey 100 and an FFV1 gray stream (one channel)."""
    _write_video(tmp_path / "rgb.mp4", [grey(100)] * 5)
    q = _read_video(tmp_path / "rgb.mp4")[0].column("quality").to_pylist()
    assert len(q) == 5 and all(r["pixel_format"] == "yuv420p" and r["channels"] == 3 for r in q)
    assert all(abs(r["brightness_mean"] - 100) <= 1.5 and r["contrast"] < 1.0 for r in q)
    _write_video(tmp_path / "ir.mkv", [np.full((90, 160), 60, np.uint8)] * 3, codec="ffv1", pix_fmt="gray")
    q = _read_video(tmp_path / "ir.mkv")[0].column("quality").to_pylist()
    assert [(r["pixel_format"], r["channels"], r["brightness_mean"]) for r in q] == [("gray", 1, 60.0)] * 3


def test_pixel_channels_of_pyav_formats():
    import av

    got = {n: pixel_channels(av.VideoFrame(16, 16, n).format) for n in ("gray", "yuv420p", "rgb24", "yuva420p", "pal8")}
    assert got == {"gray": 1, "yuv420p": 3, "rgb24": 3, "yuva420p": 4, "pal8": 3}


# -- audio properties --------------------------------------------------------------------------

def test_loudness_of_a_sine_and_a_full_scale_square_wave():
    t = np.arange(RATE) / RATE
    sine = 0.5 * np.sin(2 * np.pi * 400 * t)  # 40-sample period: 10 periods per 25 ms window
    n = (len(t) - WIN) // HOP + 1
    assert loudness_dbfs(sine, n, WIN, HOP) == pytest.approx(20 * math.log10(0.5 / math.sqrt(2)), abs=1e-6)
    square = np.where(np.sin(2 * np.pi * 400 * t + 0.1) >= 0, 1.0, -1.0)
    assert loudness_dbfs(square, n, WIN, HOP) == pytest.approx(0.0, abs=1e-9)
    assert clipping_ratio(square, n, WIN, HOP) == pytest.approx(1.0)
    assert loudness_dbfs(np.zeros(RATE), n, WIN, HOP) == pytest.approx(-120.0)


def test_clipping_counts_samples_at_or_within_one_lsb_of_full_scale():
    x = np.full(RATE, 0.1)
    x[::10] = 32767 / 32768  # positive full scale of 16-bit PCM
    x[5::20] = -1.0  # negative full scale
    x[7::40] = 32766 / 32768  # 1 LSB below: counts
    x[9::40] = 32765 / 32768  # 2 LSB below: does not
    assert CLIP_LEVEL == 32766 / 32768
    n = (len(x) - WIN) // HOP + 1
    # per 400-sample window (starts at multiples of 160): 40 + 20 + 10 clipped samples
    assert clipping_ratio(x, n, WIN, HOP) == pytest.approx(np.full(n, 70 / 400))


def _noise_then_tone(seconds_noise: float = 5.0, seconds_tone: float = 2.0) -> np.ndarray:
    rng = np.random.default_rng(7)
    noise = rng.normal(0.0, 0.001, int((seconds_noise + seconds_tone) * RATE))  # -60 dBFS
    t = np.arange(int(seconds_tone * RATE)) / RATE
    tone = 0.1 * math.sqrt(2) * np.sin(2 * np.pi * 400 * t)  # RMS 0.1: -20 dBFS
    x = noise.copy()
    x[int(seconds_noise * RATE):] += tone
    return x


def test_speech_to_noise_is_the_level_over_the_running_noise_floor():
    x = _noise_then_tone()
    n = (len(x) - WIN) // HOP + 1
    loud, clip, snr = AudioQualityMeter(WIN, HOP).measure(x, n)
    tone = slice(5 * 100 + 10, n)  # frames wholly inside the tone
    assert np.median(loud[tone]) == pytest.approx(-20.0, abs=0.1)
    assert np.all((snr[tone] > 38.5) & (snr[tone] < 41.5))  # -20 dB over a -60 dB floor
    assert np.all(np.abs(snr[150:450]) < 3.0)  # noise over its own floor: a dB or two
    assert not clip.any()


def test_the_audio_properties_do_not_depend_on_how_the_signal_is_chunked():
    x = _noise_then_tone(11.0, 3.0)  # longer than the floor's 10 s window
    n = (len(x) - WIN) // HOP + 1
    whole = AudioQualityMeter(WIN, HOP).measure(x, n)
    for sizes in ([37] * 60, [1] * 5 + [999, 150], [250, 250, 1]):
        meter, parts, k = AudioQualityMeter(WIN, HOP), [], 0
        for m in sizes + [n]:
            m = min(m, n - k)
            if m <= 0:
                break
            parts.append(meter.measure(x[k * HOP:], m))
            k += m
        assert k == n
        for got, want in zip(zip(*parts), whole):
            np.testing.assert_array_equal(np.concatenate(got), want)


def _write_wav(path: Path, x: np.ndarray) -> None:
    pcm = np.clip(np.round(x * 32768), -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm.tobytes())


def test_the_mfcc_rows_carry_quality_of_the_signal_before_the_voice_transform(tmp_path):
    from modalign.operators.ingest.audio import AudioMfccConfig, AudioMfccOperator
    from modalign.operators.ingest.base import SourceContext
    from modalign.schemas.manifest import ClockMapping, SourceSpec

    x = _noise_then_tone(3.0, 2.0)
    x[RATE * 4:RATE * 4 + 800] = 1.0  # 50 ms clipped at full scale
    _write_wav(tmp_path / "mic.wav", x)
    spec = SourceSpec(id="mic", uri="mic.wav", modality="audio", clock=ClockMapping(offset_ns=0))
    ctx = SourceContext(session_id="s", spec=spec, path=tmp_path / "mic.wav", uri="file:///mic.wav", version="v")
    halve = lambda samples: samples * 0.5  # a transform that changes the level: quality must not see it
    got = {}
    for chunk_s in (0.37, 10.0):
        op = AudioMfccOperator(AudioMfccConfig(chunk_s=chunk_s), waveform_transform=halve)
        got[chunk_s] = pa.concat_tables(op.read(ctx)).column("quality").to_pylist()
    assert got[0.37] == got[10.0]
    q = got[10.0]
    assert np.median([r["loudness_dbfs"] for r in q[330:390]]) == pytest.approx(-20.0, abs=0.2)  # not -26
    clipped = [r["clipping_ratio"] for r in q[398:402]]
    assert max(clipped) == 1.0 and q[300]["clipping_ratio"] == 0.0


def test_ocr_confidence_is_the_mean_of_the_words_and_none_for_a_text_layer():
    words = [{"conf": 90.0}, {"conf": 30.0}, {"conf": 60.0}]
    assert ocr_confidence(words, "ocr") == pytest.approx(60.0)
    assert ocr_confidence(words, "text_layer") is None and ocr_confidence([], "ocr") is None


# -- the shift check -------------------------------------------------------------------------

def _scene(n: int = 120, seed: int = 0) -> list[np.ndarray]:
    """A room at mean luma 142: a vertical gradient, a bright board and a person-sized block that
    moves, with sensor noise."""
    rng = np.random.default_rng(seed)
    h, w = 180, 320
    base = np.linspace(170, 110, h)[:, None, None] * np.ones((1, w, 3))
    frames = []
    for i in range(n):
        f = base.copy()
        f[20:80, 20:140] = 235
        x = 160 + int(60 * math.sin(i / 10))
        f[90:170, x:x + 50] = (70, 60, 50)
        f += rng.normal(0, 2.0, f.shape)
        frames.append(f)
    mean = np.mean([frame_quality(np.clip(f, 0, 255).astype(np.uint8))[0] for f in frames])
    return [np.clip(f * 142 / mean, 0, 255).round().astype(np.uint8) for f in frames]


def _brightness(frames: list[np.ndarray]) -> np.ndarray:
    return np.array([frame_quality(f)[0] for f in frames])


SHIFT = QualityShiftConfig()


def _compare(ref: np.ndarray, cur: np.ndarray, prop: str = "video.brightness_mean"):
    return compare(ref, cur, bins=SHIFT.bins, psi_threshold=SHIFT.psi_threshold, shift_sigmas=SHIFT.shift_sigmas,
                   min_events=SHIFT.min_events, min_sigma=SHIFT.min_sigma[prop],
                   min_sigma_fraction=SHIFT.min_sigma_fraction)


def test_a_darkened_copy_of_a_frame_stream_alarms_and_an_unchanged_copy_does_not():
    frames = _scene()
    bright = _brightness(frames)
    assert bright.mean() == pytest.approx(142, abs=0.5)
    dark = _brightness([np.round(f.astype(np.float64) * 89 / 142).astype(np.uint8) for f in frames])
    assert dark.mean() == pytest.approx(89, abs=0.5)
    shifted = _compare(bright, dark)
    assert shifted.alarm and shifted.psi > 2 and shifted.shift_sigmas == pytest.approx((89 - 142) / 8, abs=0.2)
    same = _compare(bright, _brightness([f.copy() for f in frames]))
    assert (same.psi, same.shift_sigmas, same.alarm) == (pytest.approx(0.0, abs=1e-12), 0.0, False)
    # another take of the same room (other noise): distributions this narrow differ in shape (PSI), but
    # the mean moved by far less than the sigma floor: no alarm
    other = _compare(bright, _brightness(_scene(seed=1)))
    assert not other.alarm and abs(other.shift_sigmas) < 0.5


def test_psi_over_reference_quantile_bins_by_hand():
    ref = np.arange(1000, dtype=float)  # interior deciles (values of it): 99, 199, ..., 899
    cur = np.r_[np.full(500, 50.0), np.full(500, 950.0)]  # half below the first edge, half above the last
    # bins: below 99, at 99, between 99 and 199, at 199, ..., above 899
    r = (np.array([99, 1] * 9 + [100]) + 0.5) / 1009.5
    c = (np.array([500] + [0] * 17 + [500]) + 0.5) / 1009.5
    assert psi(ref, cur) == pytest.approx(float(np.sum((c - r) * np.log(c / r))), rel=1e-12)
    assert psi(ref, ref) == 0.0
    # a reference of one value (no clipping at all) still tells "more" and "less" apart
    zeros, some = np.zeros(1000), np.r_[np.zeros(500), np.full(500, 0.2)]
    r, c = np.array([0.5, 1000.5, 0.5]) / 1001.5, np.array([0.5, 500.5, 500.5]) / 1001.5
    assert psi(zeros, some) == pytest.approx(float(np.sum((c - r) * np.log(c / r))), rel=1e-12)
    assert psi(zeros, -np.abs(some)) == pytest.approx(psi(zeros, some), rel=1e-12)


def test_an_alarm_needs_enough_values_on_both_sides():
    ref, cur = np.full(60, 142.0), np.full(49, 89.0)
    assert not _compare(ref, cur).alarm and _compare(ref, np.full(50, 89.0)).alarm
    assert summarize(np.zeros(0)).n == 0 and not compare(np.zeros(0), cur).alarm


# -- the expectations ------------------------------------------------------------------------

def _frames_table(values: list[float], t0: int = 0) -> pa.Table:
    n = len(values)
    q = [{"brightness_mean": v, "contrast": 1.0, "sharpness": 1.0, "channels": 3, "pixel_format": "yuv420p"}
         for v in values]
    return pa.table({"event_id": [f"e{t0 + i}" for i in range(n)],
                     "t_ns": pa.array([(t0 + i) * 40 * MS for i in range(n)], pa.int64()),
                     "width": pa.array([160] * n, pa.int32()), "height": pa.array([90] * n, pa.int32()),
                     "quality": q})


def _stream(values: list[float], sizes: list[int], expectations: list[QualityExpectation]):
    gate, runs, kept, k = QualityGate(expectations, "video"), [], [], 0
    for size in sizes:
        table = _frames_table(values[k:k + size], t0=k)
        v = gate.check(table)
        assert v.failure is None
        runs += v.closed
        kept += (table if v.keep is None else table.filter(pa.array(v.keep))).column("event_id").to_pylist()
        k += size
    assert k == len(values)
    runs += gate.finish()
    return gate, [(r.index, r.start_t_ns, r.end_t_ns, r.records, r.low, r.high) for r in runs], kept


DROP_DARK = QualityExpectation(modality="video", property="brightness_mean", min=16, action="drop")
WARN_BRIGHT = QualityExpectation(modality="video", property="brightness_mean", max=240, action="warn")


@pytest.mark.parametrize("sizes", [[20], [5, 15], [1] * 20, [8, 4, 8], [3, 17]])
def test_a_dropped_run_is_one_row_however_the_stream_is_batched(sizes):
    values = [100.0] * 3 + [5.0, 6.0, 4.0, 9.0, 7.0] + [100.0, 250.0, 100.0, 100.0] + [3.0] * 8
    gate, runs, kept = _stream(values, sizes, [WARN_BRIGHT, DROP_DARK])
    assert runs == [(1, 3 * 40 * MS, 7 * 40 * MS, 5, 4.0, 9.0), (1, 12 * 40 * MS, 19 * 40 * MS, 8, 3.0, 3.0)]
    assert kept == [f"e{i}" for i in (0, 1, 2, 8, 9, 10, 11)]
    assert gate.counts == {"quality:warn:video:0": 1, "quality:drop:video:1": 13}


def test_a_record_without_a_value_never_breaks_an_expectation_and_a_fail_names_the_first_that_does():
    low_conf = QualityExpectation(modality="pdf", property="ocr_confidence", min=40, action="fail")
    table = pa.table({"t_ns": pa.array([0, 0, 5000], pa.int64()), "end_t_ns": pa.array([5000, 5000, None], pa.int64()),
                      "quality": [{"ocr_confidence": None}, {"ocr_confidence": 80.0}, {"ocr_confidence": 12.5}]})
    v = QualityGate([low_conf], "pdf").check(table)
    assert v.failure is not None and (v.failure.value, v.failure.t_ns, v.failure.index) == (12.5, 5000, 0)
    assert "ocr_confidence = 12.5" in v.failure.message() and "[40, inf]" in v.failure.message()
    drop = low_conf.model_copy(update={"action": "drop"})
    gate = QualityGate([drop], "pdf")
    assert gate.check(table).keep.tolist() == [True, True, False]
    (run,) = gate.finish()
    assert (run.start_t_ns, run.end_t_ns, run.records) == (5000, None, 1)  # the last page: open to the end


def test_check_failures_raises_naming_source_property_value_and_expectation():
    from modalign.pipeline.quality import check_failures

    ok = QuarantineRow(session_id="s", source_id="cam", source_uri="file:///cam.mp4", source_version="v",
                       stage="quality", reason_code=QuarantineReason.QUALITY_EXPECTATION, message="dropped")
    check_failures([ok])
    bad = ok.model_copy(update={"reason_code": QuarantineReason.QUALITY_FAILED,
                                "message": "channels = 1 at session time 0.000 s is outside video channels in [3, 3] "
                                           "(quality.expectations[3], action fail); the source was stopped there"})
    with pytest.raises(QualityGateError) as err:
        check_failures([ok, bad])
    text = str(err.value)
    assert err.value.code == "quality_failed" and "file:///cam.mp4" in text and "cam" in text
    assert "channels = 1" in text and "quality.expectations[3]" in text and "nothing of it was committed" in text


# -- the worker applies them before events are written ----------------------------------------

DARK = range(20, 60)  # frames 0.8 s .. 2.36 s are dark


@pytest.fixture(scope="module")
def dark_clip(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gates") / "cam.mp4"
    _write_video(path, [grey(8 if i in DARK else 120) for i in range(100)], gop=25)  # keyframes every second
    return path


def _job(path: Path):
    from modalign.pipeline.items import SourceJob
    from modalign.schemas.files import stat_version
    from modalign.schemas.manifest import ClockMapping, SourceSpec

    spec = SourceSpec(id="cam", uri=path.name, modality="video", clock=ClockMapping(offset_ns=0))
    return SourceJob(run_id="q" * 32, session_id="s", spec=spec, path=path, uri=path.as_uri(),
                     version=stat_version(path))


def _worker_run(tmp_path: Path, job, *, batch_frames: int, expectations: list, range_s: float | None = None):
    from modalign.pipeline.items import DoneItem, MetaItem, QuarantineItem
    from modalign.pipeline.worker import IngestWorker

    cfg = RunConfig(key_store=tmp_path / "keys", policy={"face": {"action": "keep"}, "frame_text": {"action": "keep"}},
                    ingest={"video": {"batch_frames": batch_frames, "range_s": range_s, "range_overlap_s": 0.2}},
                    quality={"expectations": expectations})
    out = tmp_path / f"out-{batch_frames}-{range_s}"
    worker = IngestWorker(cfg, out, tmp_path / "keys")
    jobs = [replace(job, range=r) for r in worker.video_ranges(job)] or [job]
    items = [i for j in jobs for i in worker.ingest(j)]
    rows = [i.row for i in items if isinstance(i, QuarantineItem)]
    files = [i.path for i in items if isinstance(i, MetaItem)]
    dones = [i for i in items if isinstance(i, DoneItem)]
    stored = (ds.dataset([str(out / f) for f in files], format="parquet").to_table(columns=["frame_index", "quality"])
              if files else pa.table({"frame_index": pa.array([], pa.int32())}))
    return rows, stored, dones, (out, files), len(jobs)


@pytest.mark.parametrize("batch_frames", [4, 32])
def test_the_worker_drops_a_dark_run_as_one_quarantine_row_for_any_batching(tmp_path, dark_clip, batch_frames):
    drop = {"modality": "video", "property": "brightness_mean", "min": 16, "action": "drop"}
    rows, stored, dones, _, _ = _worker_run(tmp_path, _job(dark_clip), batch_frames=batch_frames, expectations=[drop])
    (row,) = rows
    assert (row.reason_code, row.stage, row.start_t_ns, row.end_t_ns) == \
        (QuarantineReason.QUALITY_EXPECTATION, "quality", DARK.start * 40 * MS, (DARK.stop - 1) * 40 * MS)
    assert "40 record(s) dropped" in row.message and "quality.expectations[0]" in row.message
    assert sorted(stored.column("frame_index").to_pylist()) == [i for i in range(100) if i not in DARK]
    assert min(q["brightness_mean"] for q in stored.column("quality").to_pylist()) > 100
    (done,) = dones
    assert done.row.status == "partial" and done.row.events == 60
    assert done.counts["quality:drop:video:0"] == 40


def test_video_ranges_cut_a_dropped_run_at_their_borders_only(tmp_path, dark_clip):
    """Ranges of 1 s (keyframes every 25 frames): the dark frames 20-59 are in three ranges, so three
    rows, split where the cuts are, the same for any batching."""
    drop = {"modality": "video", "property": "brightness_mean", "min": 16, "action": "drop"}
    got = []
    for batch_frames in (4, 32):
        rows, stored, _, _, n_jobs = _worker_run(tmp_path, _job(dark_clip), batch_frames=batch_frames,
                                                 expectations=[drop], range_s=1.0)
        assert n_jobs == 4
        got.append([(r.start_t_ns // (40 * MS), r.end_t_ns // (40 * MS)) for r in rows])
        assert sorted(stored.column("frame_index").to_pylist()) == [i for i in range(100) if i not in DARK]
    assert got[0] == got[1] == [(20, 24), (25, 49), (50, 59)]


def test_the_worker_warns_and_fails(tmp_path, dark_clip):
    warn = {"modality": "video", "property": "brightness_mean", "min": 16, "action": "warn"}
    rows, stored, dones, _, _ = _worker_run(tmp_path, _job(dark_clip), batch_frames=32, expectations=[warn])
    assert rows == [] and stored.num_rows == 100 and dones[0].counts["quality:warn:video:0"] == 40
    assert dones[0].row.status == "ingested"
    fail = {"modality": "video", "property": "brightness_mean", "min": 16, "action": "fail"}
    rows, stored, dones, _, _ = _worker_run(tmp_path, _job(dark_clip), batch_frames=32, expectations=[warn, fail])
    (row,) = rows
    assert row.reason_code == QuarantineReason.QUALITY_FAILED and row.start_t_ns == DARK.start * 40 * MS
    assert "brightness_mean = 8" in row.message and "quality.expectations[1], action fail" in row.message
    assert stored.num_rows == 0  # the failing batch is not written (the run will not commit anyway)
    assert dones[0].row.status == "quarantined"


def test_monitor_quality_summarises_without_a_reference_and_alarms_against_a_bright_one(tmp_path, dark_clip):
    """The commit's shift check over events the worker wrote: the dark clip (brightness 8 for 40 of
    100 frames) against a reference of all-bright frames alarms on brightness, not on width."""
    from modalign.pipeline.layout import OutputLayout
    from modalign.pipeline.quality import monitor_quality

    _, _, _, (out, files), _ = _worker_run(tmp_path, _job(dark_clip), batch_frames=32, expectations=[])
    bright = tmp_path / "bright.mp4"
    _write_video(bright, [grey(120)] * 100)
    _, _, _, (ref, ref_files), _ = _worker_run(tmp_path / "ref", _job(bright), batch_frames=32, expectations=[])
    layout = OutputLayout(out)
    alone = monitor_quality(layout, files, "a" * 12, QualityShiftConfig())
    assert alone["alarms"] == 0 and alone["reference"] is None
    rows = {r["property"]: r for r in ds.dataset(out / "monitor" / "quality", format="parquet").to_table().to_pylist()}
    assert set(rows) == {"brightness_mean", "contrast", "sharpness", "channels", "width", "height"}
    b = rows["brightness_mean"]
    assert b["session_id"] == "s" and b["current_n"] == 100 and b["psi"] is None and not b["alarm"]
    assert b["current_mean"] == pytest.approx(0.6 * 120 + 0.4 * 8, abs=1.0)
    checked = monitor_quality(layout, files, "b" * 12, QualityShiftConfig(), OutputLayout(ref), ref_files, str(ref))
    assert checked["alarms"] == 1 and checked["by_modality"]["video"] == 1
    (alarm,) = ds.dataset(out / "monitor" / "alarms" / ("b" * 12 + "-quality.parquet")).to_table().to_pylist()
    assert (alarm["kind"], alarm["modality"], alarm["property"], alarm["session_id"]) == \
        ("quality_shift", "video", "brightness_mean", "s")
    assert alarm["value"] > 1 and alarm["threshold"] == 0.25 and alarm["model_id"] is None


def test_default_expectations_and_their_bounds():
    defaults = {(e.modality, e.property, e.min, e.max, e.action) for e in QualityConfig().expectations}
    assert defaults == {("video", "brightness_mean", 16, 240, "warn"), ("audio", "clipping_ratio", None, 0.01, "warn"),
                        ("pdf", "ocr_confidence", 40, None, "warn")}
    with pytest.raises(ValueError, match="physical range"):
        QualityExpectation(modality="audio", property="clipping_ratio", max=2)
    with pytest.raises(ValueError, match="no quality property"):
        QualityExpectation(modality="pdf", property="brightness_mean", min=1)
