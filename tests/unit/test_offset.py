"""Clock offset/skew estimation from audio (GCC-PHAT over windows) and drift alarms from it."""

from __future__ import annotations

import io
import shutil
import subprocess
import wave

import numpy as np
import pyarrow as pa
import pytest

from modalign.operators.align.aligner import TickAligner
from modalign.operators.align.clock import SessionClock
from modalign.operators.align.offset import estimate_offset
from modalign.schemas.errors import InputError
from modalign.schemas.manifest import ClockMapping
from signals import HI, SR, noise_bursts, record

pytestmark = pytest.mark.unit

MS = 1_000_000
SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Alignment needs one shared clock for every source.",
    "Please send the report before Friday afternoon.",
    "Seven silver boats sailed across the quiet harbour.",
    "Numbers like forty two and nineteen are easy to hear.",
    "The meeting ends when the last slide has been shown.",
)


def _espeak(text: str) -> tuple[np.ndarray, int]:
    out = subprocess.run(["espeak-ng", "--stdout", "-s", "165", text], capture_output=True, check=True, timeout=60)
    with wave.open(io.BytesIO(out.stdout)) as w:  # size fields are placeholders: read what is there
        rate, raw = w.getframerate(), w.readframes(w.getnframes())
    return np.frombuffer(raw[: len(raw) // 2 * 2], "<i2").astype(np.float64) / 32768.0, rate


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    """About 20 s of espeak-ng speech with pauses, at HI Hz, starting at session time 0."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed")
    from scipy.signal import resample_poly

    parts = []
    for text in SENTENCES:
        x, rate = _espeak(text)
        g = np.gcd(rate, HI)
        parts += [resample_poly(x, HI // g, rate // g), np.zeros(int(0.35 * HI))]
    return np.concatenate(parts)


@pytest.mark.parametrize("offset_ns", [-4_876_543_210, 731_250_000, 4_987_654_321])
@pytest.mark.parametrize("skew_ppm", [-100.0, 100.0])
def test_offset_and_skew_of_generated_pairs(speech, offset_ns, skew_ppm):
    seconds = len(speech) / HI
    ref = record(speech, seconds, 0, 0.0, 0.01, seed=1)
    other = 0.6 * record(speech, seconds, offset_ns, skew_ppm, 0.02, seed=2)
    est = estimate_offset(ref, other, SR)
    assert abs(est.offset_ns - offset_ns) <= 10 * MS
    assert abs(est.offset_ns - offset_ns) <= 1 * MS  # what it reaches in practice (~us)
    assert est.skew_ppm == pytest.approx(skew_ppm, abs=10.0)
    assert est.confidence > 0.5 and sum(est.inliers) >= 3
    # Sign convention: the mapping puts what the other recorder heard at local t where the
    # reference heard it, i.e. session = offset + t * (1 + skew).
    clock = SessionClock.from_mapping(est.clock_mapping(estimate_from="ref"))
    t_local = 10 * 10**9
    truth = offset_ns + t_local * (1 + skew_ppm * 1e-6)
    assert abs(clock.to_session(t_local) - truth) <= 1 * MS
    for t_ns, observed, conf in est.observations():
        assert conf > 0
        t_loc = (t_ns - offset_ns) / (1 + skew_ppm * 1e-6)
        assert abs(observed - (offset_ns + skew_ppm * 1e-6 * t_loc)) <= 1 * MS


def estimate_files(ref_path, other_path, sample_rate_hz=16000, **kw):
    """Decode both recordings as the ingest worker does, then estimate."""
    from modalign.operators.ingest.audio import decode_audio

    ref, ref_start = decode_audio(ref_path, sample_rate_hz)
    other, other_start = decode_audio(other_path, sample_rate_hz)
    return estimate_offset(ref, other, sample_rate_hz, ref_start_ns=ref_start, other_start_ns=other_start, **kw)


def test_sample_session_lapel_offset_from_the_video_audio(tmp_path):
    from modalign.pipeline.sample import generate_sample
    from modalign.schemas.load import load_model
    from modalign.schemas.manifest import Manifest

    manifest = load_model(Manifest, generate_sample(tmp_path, duration_s=12))
    est = estimate_files(tmp_path / "room.mp4", tmp_path / "lapel.wav", sample_rate_hz=16000)
    truth = manifest.ground_truth.audio_offsets_ns["lapel"]
    assert truth == 730 * MS
    assert abs(est.offset_ns - truth) <= 10 * MS
    assert abs(est.skew_ppm) < 200  # same clock; 12 s is too short to pin skew much tighter
    mapping = est.clock_mapping(estimate_from="room_video")
    assert mapping.estimated and mapping.estimate_from == "room_video"
    # Composed with a reference that is itself 1 s late on the session clock.
    shifted = estimate_files(tmp_path / "room.mp4", tmp_path / "lapel.wav",
                             ref_clock=ClockMapping(offset_ns=10**9))
    assert abs(shifted.offset_ns - (truth + 10**9)) <= 10 * MS
    assert all(abs(w[0] - v[0] - 10**9) <= MS for w, v in zip(shifted.windows, est.windows))


def test_unrelated_recordings_raise_offset_not_found():
    rng = np.random.default_rng(0)
    a = (noise_bursts(12, seed=1)[:: HI // SR] + rng.normal(0, 0.01, 12 * SR)).astype(np.float32)
    b = (noise_bursts(12, seed=2)[:: HI // SR] + rng.normal(0, 0.01, 12 * SR)).astype(np.float32)
    with pytest.raises(InputError) as err:
        estimate_offset(a, b, SR, source_uri="file:///b.wav")
    assert err.value.code == "offset_not_found" and "file:///b.wav" in str(err.value)


def _lineage(source_id: str) -> dict:
    return dict(session_id="s", source_id=source_id, source_uri=f"file:///{source_id}", source_version="sha256:x",
                operators="test@0", policy="p@1", model_id=None)


def test_skewed_recorder_raises_one_drift_alarm_where_the_drift_crosses_800_ms():
    # The lapel recorder's clock runs 2 % slow (offset 250 ms); the manifest knows the offset
    # but says skew 0. The windowed estimate sees the drift and the aligner turns it into an alarm.
    offset, skew, seconds = 250 * MS, 20_000.0, 48.0
    sound = noise_bursts(52, seed=3)
    ref = record(sound, 50.0, 0, 0.0, 0.005, seed=4)
    lapel = record(sound, seconds, offset, skew, 0.01, seed=5)
    est = estimate_offset(ref, lapel, SR)
    assert est.skew_ppm == pytest.approx(skew, abs=20) and abs(est.offset_ns - offset) <= 2 * MS

    al = TickAligner("s")
    al.register("room", "video", _lineage("room"), ClockMapping())
    manifest_clock = ClockMapping(offset_ns=offset, skew_ppm=0.0)
    al.register("lapel", "audio", _lineage("lapel"), manifest_clock)
    assert al.observe_offsets("lapel", est.windows) == len(est.observations())
    frames = np.arange(int(49 * 25)) * 40 * MS
    al.add("room", pa.table({"event_id": [f"v/{k}" for k in range(len(frames))], "t_ns": frames}))
    mfcc = SessionClock.from_mapping(manifest_clock).to_session_array(np.arange(int(seconds * 100)) * 10 * MS)
    al.add("lapel", pa.table({"event_id": [f"a/{k}" for k in range(len(mfcc))], "t_ns": mfcc}))
    res = al.finish()

    # Residual offset at session T: (T - offset) * s / (1 + s); first tick above 800 ms:
    s = skew * 1e-6
    t_cross = offset + 800 * MS * (1 + s) / s
    expected = int(t_cross // (40 * MS)) + 1
    alarms = res.alarms.to_pylist()
    assert len(alarms) == 1
    assert abs(alarms[0]["start_tick"] - expected) <= 1, (alarms[0]["start_tick"], expected)
    assert alarms[0]["end_tick"] == res.ticks - 1 and alarms[0]["sources"] == ["lapel", "room"]
    assert alarms[0]["max_residual_ms"] > 850
    # Every tick of the alarm is logged as out of tolerance; matching itself stayed clean.
    oot = [c["tick_index"] for c in res.ctal.to_pylist() if c["decision"] == "out_of_tolerance"]
    assert oot == list(range(alarms[0]["start_tick"], res.ticks))
    summary = {r["source_id"]: r for r in res.summary.to_pylist()}
    assert summary["lapel"]["offset_method"] == "manifest" and summary["lapel"]["residual_max_ms"] <= 10
