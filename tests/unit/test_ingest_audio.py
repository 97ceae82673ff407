"""AudioMfccOperator: 100 frames/s on PTS time (AAC priming, gaps), chunking, errors."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from media_faults import fail_after
from signals import encode_audio, mux_black_video
from modalign.operators.ingest.audio import AudioMfccConfig, AudioMfccOperator, PcmStream, audio_mfcc_schema, decode_audio
from modalign.operators.ingest.base import SourceContext
from modalign.schemas.errors import InputError, LimitExceededError, UnreadableInputError, UnsupportedInputError
from modalign.schemas.manifest import ClockMapping, SourceSpec

pytestmark = pytest.mark.unit

SR = 44100
OFFSET_NS = 2_500_000_000
BURST_S = 1.0  # a broadband (noise) burst from 1.000 s to 1.300 s over a -60 dB noise floor


def signal(duration_s: float = 2.0) -> np.ndarray:
    rng = np.random.default_rng(0)
    t = np.arange(int(SR * duration_s)) / SR
    x = 1e-3 * rng.standard_normal(t.size)
    on = (t >= BURST_S) & (t < BURST_S + 0.3)
    x[on] += 0.2 * rng.standard_normal(on.sum())
    return x.astype(np.float32)


def encode(path: Path, codec: str, fmt: str, x: np.ndarray, video: bool = False) -> Path:
    return encode_audio(path, x, SR, codec=codec, fmt=fmt, video=video)


@pytest.fixture(scope="session")
def media(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("audio")
    x = signal()
    return {
        "wav": encode(d / "burst.wav", "pcm_s16le", "s16", x),
        "m4a": encode(d / "burst.m4a", "aac", "fltp", x),
        "mp4": encode(d / "burst.mp4", "aac", "fltp", x, video=True),
    }


def ctx_for(path: Path, offset_ns: int = OFFSET_NS) -> SourceContext:
    spec = SourceSpec(id="mic", uri=path.name, modality="audio", clock=ClockMapping(offset_ns=offset_ns))
    return SourceContext(session_id="s1", spec=spec, path=path, uri=f"file://{path}", version="v1")


def read(path: Path, offset_ns: int = OFFSET_NS, **cfg) -> pa.Table:
    return pa.concat_tables(AudioMfccOperator(AudioMfccConfig(**cfg)).read(ctx_for(path, offset_ns)))


def onset_ns(table: pa.Table) -> int:
    """t_ns of the first frame within 6 dB (per mel band) of the burst's steady level."""
    mfcc = table.column("mfcc").combine_chunks().flatten().to_numpy().reshape(table.num_rows, -1)
    log_energy = mfcc[:, 0] / np.sqrt(64)  # c0 of an orthonormal DCT = mean log-mel * sqrt(n_mels)
    t = table.column("t_ns").to_numpy()
    steady = np.median(log_energy[(t >= OFFSET_NS + 1.05e9) & (t < OFFSET_NS + 1.25e9)])
    return int(t[np.argmax(log_energy >= steady - np.log(4))])


@pytest.mark.parametrize("kind", ["wav", "m4a", "mp4"])
def test_frames_are_10ms_apart_and_the_burst_is_at_1s(media, kind):
    table = read(media[kind])
    assert table.schema == audio_mfcc_schema(40)
    assert 195 <= table.num_rows <= 205  # 2 s at 100 frames/s (AAC pads the tail)
    t = table.column("t_ns").to_numpy()
    assert t[0] == OFFSET_NS and set(np.diff(t)) == {10_000_000}
    assert table.column("frame_index").to_pylist() == list(range(table.num_rows))
    assert table.column("event_id")[7].as_py() == "s1/mic/mfcc/7"
    assert abs(onset_ns(table) - (OFFSET_NS + 1_000_000_000)) <= 15_000_000


def test_wav_frame_count_is_exact(media):
    n = 2 * 16000
    assert read(media["wav"]).num_rows == (n - 400) // 160 + 1


def test_chunked_equals_one_shot(media):
    one = read(media["m4a"], chunk_s=100.0)
    chunked_tables = list(AudioMfccOperator(AudioMfccConfig(chunk_s=0.37)).read(ctx_for(media["m4a"])))
    assert len(chunked_tables) > 4
    chunked = pa.concat_tables(chunked_tables)
    assert chunked.column("t_ns").to_pylist() == one.column("t_ns").to_pylist()
    assert chunked.column("voiced").to_pylist() == one.column("voiced").to_pylist()  # VAD state carries over
    a = one.column("mfcc").combine_chunks().flatten().to_numpy()
    b = chunked.column("mfcc").combine_chunks().flatten().to_numpy()
    np.testing.assert_allclose(b, a, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["wav", "m4a"])
def test_decode_audio_is_16k_mono_on_pts_time(media, kind):
    x, start_ns = decode_audio(media[kind])
    assert x.dtype == np.float32 and x.ndim == 1 and start_ns == 0
    first_loud = int(np.argmax(np.abs(x) > 0.1))
    assert abs(start_ns + first_loud * 1e9 / 16000 - 1e9) <= 2e6


def test_pts_gap_is_filled_with_silence(tmp_path):
    import av

    path = tmp_path / "gap.mkv"
    rng = np.random.default_rng(2)
    with av.open(str(path), "w") as c:  # 1 s of noise, nothing for 0.5 s, then 1 s of noise from 1.5 s
        s = c.add_stream("pcm_s16le", rate=16000, layout="mono")
        for base in (0, 24000):
            for i in range(0, 16000, 800):
                noise = rng.integers(-8000, 8000, (1, 800), dtype=np.int16)
                f = av.AudioFrame.from_ndarray(noise, format="s16", layout="mono")
                f.sample_rate, f.pts, f.time_base = 16000, base + i, Fraction(1, 16000)
                for pk in s.encode(f):
                    c.mux(pk)
        for pk in s.encode(None):
            c.mux(pk)
    table = read(path, offset_ns=0)
    t = table.column("t_ns").to_numpy()
    c0 = table.column("mfcc").combine_chunks().flatten().to_numpy().reshape(len(t), -1)[:, 0]
    silent = t[c0 < c0.max() - 20]  # at the log(1e-6) floor: frames within the gap
    assert silent.min() >= 0.98e9 and silent.max() <= 1.5e9 and len(silent) >= 48
    assert set(np.diff(t)) == {10_000_000} and t[-1] == 2_470_000_000  # (40000 - 400) // 160 + 1 = 248 frames


@pytest.mark.parametrize("content", ["garbage", "truncated", "empty", "missing"])
def test_unreadable_files_name_the_uri(media, tmp_path, content):
    path = tmp_path / "bad.m4a"
    if content == "garbage":
        path.write_bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes())
    elif content == "truncated":
        data = media["m4a"].read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif content == "empty":
        path.write_bytes(b"")
    ctx = ctx_for(path)
    with pytest.raises(UnreadableInputError) as e:
        list(AudioMfccOperator().read(ctx))
    assert ctx.uri in str(e.value)


def test_video_without_audio_is_unsupported(tmp_path):
    import av

    path = tmp_path / "silent.mp4"
    with av.open(str(path), "w") as c:
        mux_black_video(c, 5)
    with pytest.raises(UnsupportedInputError) as e:
        list(AudioMfccOperator().read(ctx_for(path)))
    assert e.value.code == "no_audio_stream"


def test_decode_failure_midway_yields_then_reports_range(media, monkeypatch):
    fail_after(monkeypatch, "decode", 65)  # the decoder raises after 65 AAC frames of 1024 samples (1.51 s)
    got = []
    with pytest.raises(InputError) as e:
        for t in AudioMfccOperator(AudioMfccConfig(chunk_s=0.5)).read(ctx_for(media["m4a"])):
            got.append(t)
    t = pa.concat_tables(got).column("t_ns").to_numpy()
    assert e.value.code == "decode_failed"
    assert OFFSET_NS + 1.4e9 < t[-1] < e.value.start_t_ns <= OFFSET_NS + 1.55e9
    assert e.value.end_t_ns is not None and e.value.end_t_ns >= OFFSET_NS + 1.99e9


def test_aac_priming_does_not_shift_frames(media):
    """AAC adds 1024 priming samples (23 ms): timed from PTS, the burst lands on the same
    10 ms frame as in the uncompressed WAV."""
    assert onset_ns(read(media["m4a"])) == onset_ns(read(media["wav"])) == onset_ns(read(media["mp4"]))


def test_duration_limit_midway_keeps_the_frames_within_it(media, monkeypatch):
    """A header that declares no duration: the limit is enforced on decoded samples."""
    import modalign.operators.ingest.audio as audio

    monkeypatch.setattr(audio, "declared_span_ns", lambda *a: (0, None))
    got = []
    with pytest.raises(LimitExceededError) as e:
        for t in AudioMfccOperator(AudioMfccConfig(max_duration_s=1.5, chunk_s=0.5)).read(ctx_for(media["wav"])):
            got.append(t)
    t = pa.concat_tables(got).column("t_ns").to_numpy()
    assert t[-1] == OFFSET_NS + 1_470_000_000  # last frame whose 25 ms window ends by 1.5 s
    assert e.value.code == "duration_exceeded" and e.value.start_t_ns == OFFSET_NS + 1_500_000_000


# ---- voice activity ----------------------------------------------------------------------

def test_voiced_marks_the_burst_then_the_hangover(media):
    """Burst 1.000-1.300 s over a -60 dBFS floor: frame k (window [10k, 10k + 25) ms) is
    active iff its window overlaps the burst (k = 98..129), voiced 20 frames longer."""
    table = read(media["wav"], offset_ns=0)
    k = table.column("frame_index").to_numpy()
    voiced = table.column("voiced").to_numpy(zero_copy_only=False)
    expected = (k >= 98) & (k <= 129 + 20)
    np.testing.assert_array_equal(voiced, expected)


@pytest.mark.parametrize("kind", ["m4a", "mp4"])
def test_voiced_onset_survives_aac(media, kind):
    table = read(media[kind], offset_ns=0)
    t = table.column("t_ns").to_numpy()
    voiced = table.column("voiced").to_numpy(zero_copy_only=False)
    on = t[voiced]
    assert abs(on[0] - 975_000_000) <= 30_000_000 and abs(on[-1] - 1_490_000_000) <= 30_000_000
    assert voiced[(t >= 1_000_000_000) & (t < 1_480_000_000)].all()


def test_vad_off_leaves_voiced_null(media):
    table = read(media["wav"], vad=False)
    assert table.schema == audio_mfcc_schema(40) and table.column("voiced").null_count == table.num_rows


def test_energy_vad_adapts_to_a_steady_noise_floor():
    """A noise level step of +30 dB that stays: voiced at first, then the floor (min of the
    last 3 s) catches up and it counts as noise again."""
    from modalign.operators.ingest.vad import EnergyVad

    e = np.r_[np.full(500, -60.0), np.full(1000, -30.0)] + np.random.default_rng(0).normal(0, 0.5, 1500)
    v = EnergyVad(floor_frames=300, threshold_db=10, min_dbfs=-55, hangover_frames=20)
    voiced = np.concatenate([v(part) for part in np.array_split(e, 7)])  # chunked
    assert not voiced[:500].any()
    assert voiced[500:500 + 299].all()  # the quiet frames are still in the 300-frame window
    assert not voiced[500 + 299 + 21:].any()  # floor caught up, hangover over
    one = EnergyVad(floor_frames=300, threshold_db=10, min_dbfs=-55, hangover_frames=20)(e)
    np.testing.assert_array_equal(voiced, one)


def test_sound_from_the_first_frame_is_voiced():
    """No history yet: the floor starts at min_dbfs, so a loud start is not taken for noise."""
    from modalign.operators.ingest.vad import EnergyVad

    v = EnergyVad(floor_frames=300, threshold_db=10, min_dbfs=-55, hangover_frames=20)
    assert v(np.full(100, -20.0)).all()
    assert not EnergyVad(min_dbfs=-55)(np.full(100, -50.0)).any()  # quiet steady noise is not


def test_frame_energy_matches_the_definition():
    from modalign.operators.ingest.vad import frame_energy_db

    x = np.random.default_rng(1).standard_normal(16000).astype(np.float32) * 0.1
    n = (x.size - 400) // 160 + 1
    ref = [10 * np.log10(np.mean(x[k * 160:k * 160 + 400].astype(np.float64) ** 2) + 1e-12) for k in range(n)]
    np.testing.assert_allclose(frame_energy_db(x, n, 400, 160), ref, atol=1e-9)
    assert frame_energy_db(np.zeros(800, np.float32), 3, 400, 160).tolist() == [-120.0] * 3


def test_mono_at_the_target_rate_skips_swresample_with_identical_samples(tmp_path):
    import av

    path = tmp_path / "m16.wav"
    x = (np.random.default_rng(3).standard_normal(16000) * 8000).astype(np.int16)
    with av.open(str(path), "w") as c:
        s = c.add_stream("pcm_s16le", rate=16000, layout="mono")
        f = av.AudioFrame.from_ndarray(x[None], format="s16", layout="mono")
        f.sample_rate, f.pts = 16000, 0
        for pk in list(s.encode(f)) + list(s.encode(None)):
            c.mux(pk)
    with av.open(str(path)) as c:
        direct = np.concatenate(list(PcmStream(c, c.streams.audio[0], 16000)))
    np.testing.assert_array_equal(direct, x.astype(np.float32) / 32768)


# ---- long files ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def long_wav(tmp_path_factory) -> tuple[Path, float]:
    """30 minutes of 8 kHz PCM (29 MB, written in ~1 s): -50 dBFS noise, a burst at 1799.0 s."""
    import wave

    rate, seconds, burst = 8000, 1800, 1799.0
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(seconds * rate) * 100).astype("<i2")
    b = int(burst * rate)
    x[b:b + int(0.3 * rate)] = (rng.standard_normal(int(0.3 * rate)) * 6000).astype("<i2")
    path = tmp_path_factory.mktemp("long") / "long.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(x.tobytes())
    return path, burst


def test_a_30_minute_file_stays_sample_accurate(long_wav):
    """Frame times come from integer sample arithmetic on the PTS: after 30 minutes (8 kHz
    resampled to 16 kHz) the last frames sit exactly where the samples are."""
    path, burst = long_wav
    n_frames, last, onset = 0, None, None
    for table in AudioMfccOperator(AudioMfccConfig(chunk_s=60)).read(ctx_for(path, offset_ns=0)):
        n_frames += table.num_rows
        last = table
        voiced = table.column("voiced").to_numpy(zero_copy_only=False)
        if onset is None and voiced.any():
            onset = int(table.column("t_ns").to_numpy()[np.argmax(voiced)])
    assert n_frames == (1800 * 16000 - 400) // 160 + 1
    t = last.column("t_ns").to_numpy()
    truth = (np.arange(n_frames - t.size, n_frames) * 10_000_000)
    assert np.abs(t - truth).max() <= 1_000_000 and t[-1] == 1_799_970_000_000
    # the first voiced frame is the first whose 25 ms window reaches the burst
    first = int(np.ceil((burst - 0.025) * 100 + 1e-9))
    assert onset == first * 10_000_000


def test_a_30_minute_resampled_stream_loses_no_sample(long_wav):
    """The PCM path under the MFCCs: exactly 16 kHz x 1800 s samples, and the burst's first
    sample within 1 ms of where it was written."""
    import av

    path, burst = long_wav
    onset = None
    with av.open(str(path)) as c:
        pcm = PcmStream(c, c.streams.audio[0], 16000)
        for x in pcm:
            if onset is None and pcm.produced > (burst - 1) * 16000:
                loud = np.flatnonzero(np.abs(x) > 0.05)
                if loud.size:
                    onset = pcm.produced - x.size + int(loud[0])
    assert pcm.start_ns == 0 and pcm.produced == 1800 * 16000
    assert abs(onset / 16000 - burst) <= 0.001
