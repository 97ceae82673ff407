"""VoicePolicyOperator (anonymise / keep_mfcc / drop), the keyed per-utterance VoiceAnonymiser and
the McAdams building block.

Linkability figures (EER of both attackers, WER) of a larger set are in test_deid_eval.py."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from modalign.operators.deid.voice import (McAdamsTransform, VoiceAnonymiser, VoicePolicyConfig, VoicePolicyOperator,
                                           mark_transformed, voice_transform)
from modalign.schemas.errors import ComplianceError
from modalign.schemas.policy import DEFAULT_POLICY_TAG, VoicePolicy

pytestmark = pytest.mark.unit

N_MFCC = 40


def mfcc_table(n: int = 5, with_waveform: bool = False) -> pa.Table:
    rng = np.random.default_rng(1)
    mfcc = rng.standard_normal((n, N_MFCC)).astype(np.float32)
    cols = {
        "event_id": [f"s1/lapel/audio/{i}" for i in range(n)],
        "t_ns": pa.array([i * 10_000_000 for i in range(n)], pa.int64()),
        "frame_index": pa.array(range(n), pa.int64()),
        "mfcc": pa.FixedSizeListArray.from_arrays(pa.array(mfcc.reshape(-1)), N_MFCC),
    }
    if with_waveform:
        cols["samples"] = pa.array([rng.standard_normal(160).astype(np.float32).tolist() for _ in range(n)])
    return pa.table(cols)


KEEP = VoicePolicyConfig(voice=VoicePolicy(action="keep_mfcc"))


def test_default_policy_anonymises_voices():
    """MFCCs of an un-anonymised voice are biometric data: the default never stores them."""
    assert VoicePolicy().action == "anonymise"
    tf = voice_transform(VoicePolicy(), secret=b"k" * 32)
    assert isinstance(tf, VoiceAnonymiser) and tf.name.startswith("voiceanon@3/")
    with pytest.raises(ComplianceError):
        VoicePolicyOperator().process(mfcc_table())  # untransformed MFCCs under the default policy


def test_keep_mfcc_passes_frames_and_adds_header():
    table = mfcc_table()
    out = VoicePolicyOperator(KEEP).process(table)
    assert out.num_rows == 5
    assert out.drop_columns(["deid"]).equals(table)
    assert out.column("deid").to_pylist() == [
        {"policy": DEFAULT_POLICY_TAG, "method": "waveform_dropped", "detector": "none", "count": 0, "threshold": 0.0}
    ] * 5
    # the MFCC values are the input's buffer, not a copy
    a = table.column("mfcc").chunk(0).values.to_numpy()
    b = out.column("mfcc").chunk(0).values.to_numpy()
    assert np.shares_memory(a, b)


def test_drop_gives_zero_rows_with_schema_kept():
    table = mfcc_table()
    op = VoicePolicyOperator(VoicePolicyConfig(voice=VoicePolicy(action="drop"), policy_tag="strict@2"))
    out = op.process(table)
    assert out.num_rows == 0
    assert out.schema == op.output_schema(table.schema)
    assert out.schema.names == ["event_id", "t_ns", "frame_index", "mfcc", "deid"]
    assert out.schema.field("mfcc").type == table.schema.field("mfcc").type
    assert table.num_rows == 5  # input untouched


def test_raw_waveform_column_never_passes():
    out = VoicePolicyOperator(KEEP).process(mfcc_table(3, with_waveform=True))
    assert "samples" not in out.column_names
    assert out.num_rows == 3 and out.column("mfcc").type.list_size == N_MFCC


# -- McAdams anonymisation ---------------------------------------------------------------------
RATE = 16000


def vowel_like(seconds: float = 1.0, f0: float = 120.0, formants=(700.0, 1200.0, 2600.0)) -> np.ndarray:
    """A glottal pulse train through three resonators: speech-like, with known formants."""
    from scipy.signal import lfilter

    n = int(seconds * RATE)
    x = np.zeros(n)
    x[:: int(RATE / f0)] = 1.0
    for f in formants:
        r, theta = 0.97, 2 * np.pi * f / RATE
        x = lfilter([1.0], [1.0, -2 * r * np.cos(theta), r * r], x)
    return (0.3 * x / np.abs(x).max()).astype(np.float32)


def lpc_peak_hz(x: np.ndarray) -> float:
    """Frequency of the strongest spectral peak below 1.5 kHz (first formant region)."""
    spec = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    freqs = np.fft.rfftfreq(len(x), 1 / RATE)
    band = (freqs > 300) & (freqs < 1500)
    smooth = np.convolve(spec, np.ones(60) / 60, mode="same")
    return float(freqs[band][np.argmax(smooth[band])])


def test_mcadams_alpha_one_reconstructs_input_and_keeps_length():
    x = vowel_like(0.73)
    y = McAdamsTransform(alpha=1.0)(x)
    assert y.dtype == np.float32 and y.shape == x.shape
    assert np.abs(y - x).max() < 1e-3 * np.abs(x).max()
    assert McAdamsTransform(0.8)(np.zeros(0, np.float32)).shape == (0,)
    assert np.array_equal(McAdamsTransform(0.8)(np.zeros(800, np.float32)), np.zeros(800, np.float32))


def test_mcadams_moves_formants_and_keeps_energy_contour():
    x = vowel_like(1.0)
    y = McAdamsTransform(alpha=0.8)(x)
    assert np.isfinite(y).all()
    # F1 at 700 Hz (0.27 rad) moves up: 0.27 ** 0.8 rad = 1.1 kHz
    assert lpc_peak_hz(x) == pytest.approx(700, abs=60)
    assert lpc_peak_hz(y) > 900
    # 20 ms frame energies are kept (so an energy VAD gives the same decisions)
    fx, fy = (np.sqrt((s[: len(s) // 320 * 320].reshape(-1, 320) ** 2).mean(axis=1)) for s in (x, y))
    assert np.allclose(fx, fy, rtol=0.25, atol=1e-4)
    assert not np.allclose(x, y, atol=0.02)


def test_mcadams_is_deterministic_and_chunk_seams_are_local():
    x = np.concatenate([vowel_like(0.5, f0=110), vowel_like(0.5, f0=140, formants=(500, 1500, 2500))])
    tf = McAdamsTransform(alpha=0.8)
    whole = tf(x)
    assert np.array_equal(whole, tf(x))
    cut = 8000
    chunked = np.concatenate([tf(x[:cut]), tf(x[cut:])])
    far = np.ones(len(x), bool)
    far[cut - 320: cut + 320] = False  # one 20 ms frame either side of the seam
    assert np.allclose(whole[far], chunked[far], atol=1e-5)


def test_voice_transform_hook_only_for_anonymise():
    assert voice_transform(VoicePolicy(action="keep_mfcc")) is None
    assert voice_transform(VoicePolicy(action="drop")) is None
    pol = VoicePolicy(action="anonymise", mcadams_alpha_range=(0.7, 0.8), segment_s=2.0)
    tf = voice_transform(pol, secret=b"k" * 32)
    assert isinstance(tf, VoiceAnonymiser) and tf.alpha_range == (0.7, 0.8) and tf.segment == 32000
    assert tf.name.startswith("voiceanon@3/seg=2s/alpha=0.70..0.80/") and "k" * 8 not in tf.name
    assert "/timbre=10dB/norm=3s/" in tf.name and tf.timbre_db == 10.0
    import pickle

    back = pickle.loads(pickle.dumps(tf))  # travels to Ray workers, key included
    assert back.name == tf.name and np.array_equal(back.params("s/a", 3), tf.params("s/a", 3))


def test_anonymise_policy_requires_the_transform_marker():
    pol = VoicePolicy(action="anonymise")
    op = VoicePolicyOperator(VoicePolicyConfig(voice=pol))
    table = mfcc_table()
    with pytest.raises(ComplianceError) as exc:
        op.process(table)  # MFCCs of the original voice must never be labelled anonymised
    assert "s1/lapel/audio/0" in str(exc.value)
    wrong = mark_transformed(table, McAdamsTransform(alpha=0.9))
    with pytest.raises(ComplianceError):
        op.process(wrong)
    out = op.process(mark_transformed(table, voice_transform(pol)))
    assert out.num_rows == 5
    h = out.column("deid")[0].as_py()
    assert h["method"] == voice_transform(pol).name and h["policy"] == DEFAULT_POLICY_TAG
    assert out.schema == op.output_schema(table.schema)


def test_mfcc_of_anonymised_speech_keeps_timing_and_energy():
    """What the pipeline stores under ``anonymise``: MFCCs of the transformed waveform."""
    from modalign.operators.ingest.audio import AudioMfccOperator
    from modalign.pipeline.deid_eval import espeak_16k

    x = espeak_16k("Storage and network upgrades start next month.", "en-us+m3")
    y = McAdamsTransform(0.8)(x)
    op = AudioMfccOperator()
    op.setup()
    mx, my = op.mfcc(x), op.mfcc(y)
    assert mx.shape == my.shape  # same frames, same times
    # energy per MFCC frame (25 ms window, 10 ms hop): what an energy VAD decides on
    idx = np.arange(400)[None, :] + 160 * np.arange(mx.shape[0])[:, None]
    ex, ey = (10 * np.log10((s[idx] ** 2).mean(axis=1) + 1e-10) for s in (x, y))
    speech = ex > ex.max() - 35
    assert np.abs(ex - ey)[speech].mean() < 1.5  # dB
    assert (speech == (ey > ex.max() - 35)).mean() > 0.95
    timbre = np.abs(mx[speech, 1:13] - my[speech, 1:13]).mean()
    assert timbre > 1.0  # the spectral envelope (the voice) changed


# -- keyed per-utterance anonymiser ----------------------------------------------------------
def speech(voice: str = "en-us+m3") -> np.ndarray:
    from modalign.pipeline.deid_eval import espeak_16k

    return espeak_16k("Storage and network upgrades start next month. Please send the quarterly report "
                      "to the finance team before Friday.", voice)


def test_parameters_differ_between_utterances_and_tenant_keys():
    a, b = VoiceAnonymiser(b"tenant-a" * 4), VoiceAnonymiser(b"tenant-b" * 4)
    pa_ = np.stack([a.params("s1/mic", k) for k in range(8)])
    assert len({tuple(r) for r in pa_.round(6)}) == 8  # every utterance its own draw
    assert pa_.shape == (8, 9)  # alpha, warp, f0 (Hz), six envelope-shape terms (dB)
    assert np.ptp(pa_[:, 0]) > 0.1 and np.ptp(pa_[:, 1]) > 0.1 and np.ptp(pa_[:, 2]) > 30
    assert (pa_[:, 0] >= 0.8).all() and (pa_[:, 0] <= 1.0).all() and (np.abs(pa_[:, 1]) <= 0.2).all()
    assert (np.abs(pa_[:, 3:]) <= 10.0).all() and np.ptp(pa_[:, 3:], axis=0).min() > 5.0
    pb = np.stack([b.params("s1/mic", k) for k in range(8)])
    assert not np.isclose(pa_, pb).all(axis=1).any()  # another tenant: other draws
    assert not np.allclose(a.params("s1/mic", 0), a.params("s1/room", 0))  # another source: other draws
    assert np.array_equal(pa_, np.stack([VoiceAnonymiser(b"tenant-a" * 4).params("s1/mic", k) for k in range(8)]))
    # frame parameters: constant inside an utterance, cross-faded over 100 ms into the next
    fp = a.frame_params("s1/mic", np.array([1, 200, 399, 400, 405, 409, 410, 600]))
    assert np.allclose(fp[:3], pa_[0]) and np.allclose(fp[5:], pa_[1])
    assert np.all(np.diff(fp[2:6, 2]) * np.sign(pa_[1, 2] - pa_[0, 2]) > 0)  # f0 moves monotonically


def test_anonymiser_output_does_not_depend_on_chunking():
    x = speech()
    tf = VoiceAnonymiser(b"k" * 32, segment_s=1.0)
    whole = tf(x, 0, "s1/mic")
    assert whole.dtype == np.float32 and whole.shape == x.shape and np.isfinite(whole).all()
    assert np.array_equal(whole, tf(x, 0, "s1/mic"))
    c, parts = tf.context_samples, []
    for lo, hi in ((0, 7013), (7013, 16000), (16000, 41111), (41111, x.size)):
        a = max(0, lo - c)
        parts.append(tf(x[a:hi + c], a, "s1/mic")[lo - a:hi - a])
    assert np.array_equal(np.concatenate(parts), whole)  # byte-identical, seams included
    assert not np.array_equal(tf(x, 0, "s1/other"), whole)  # the source is part of the key
    assert not np.array_equal(VoiceAnonymiser(b"j" * 32, segment_s=1.0)(x, 0, "s1/mic"), whole)
    assert np.array_equal(tf(np.zeros(800, np.float32), 0, "s"), np.zeros(800, np.float32))


def ltas_db(x: np.ndarray) -> np.ndarray:
    """Long-term average spectrum (dB) of 20 ms frames, in 16 bands of 500 Hz."""
    n = len(x) // 320 * 320
    spec = (np.abs(np.fft.rfft(x[:n].reshape(-1, 320) * np.hanning(320), axis=1)) ** 2).mean(axis=0)
    return 10 * np.log10(np.add.reduceat(spec[:160], np.arange(0, 160, 10)) + 1e-12)


def test_speaker_average_timbre_is_removed():
    """A fixed colouring of the input (a channel, or a speaker's average timbre) does not reach the output."""
    from scipy.signal import lfilter

    x = speech()
    coloured = lfilter([1.0, -0.9], [1.0], x).astype(np.float32)  # +17 dB at 7 kHz relative to 250 Hz
    coloured *= np.abs(x).max() / np.abs(coloured).max()
    tilt = lambda s: ltas_db(s)[12:].mean() - ltas_db(s)[:2].mean()  # noqa: E731  6-8 kHz vs 0-1 kHz
    given = tilt(coloured) - tilt(x)
    assert given > 15.0
    tf = VoiceAnonymiser(b"k" * 32)
    ya, yb = tf(x, 0, "s1/mic"), tf(coloured, 0, "s1/mic")
    assert abs(tilt(yb) - tilt(ya)) < 0.25 * given  # nearly the same pseudo-voice from both
    assert np.abs(ltas_db(ya) - ltas_db(yb)).mean() < 2.5
    plain = VoiceAnonymiser(b"k" * 32, norm_s=0.0)  # without the normalisation the colouring passes
    assert tilt(plain(coloured, 0, "s1/mic")) - tilt(plain(x, 0, "s1/mic")) > 10.0


def test_source_is_replaced_by_the_keyed_monotone_pitch():
    tf = VoiceAnonymiser(b"k" * 32)
    f0 = tf.params("s1/mic", 0)[2]
    speaker_f0 = 220.0 if f0 < 150.0 else 90.0
    x = vowel_like(1.0, f0=speaker_f0)
    y = tf(x, 0, "s1/mic")[2000:14000].astype(np.float64)
    r = np.fft.irfft(np.abs(np.fft.rfft(y, 2 * y.size)) ** 2)[: RATE // 60]
    lag = np.argmax(r[RATE // 400:]) + RATE // 400
    assert RATE / lag == pytest.approx(f0, rel=0.03) and abs(RATE / lag - speaker_f0) > 50.0
    assert (np.abs(y) > 0).mean() > 0.99  # keyed noise and pulses through the envelope: no gaps


def write_wav(path, x: np.ndarray) -> None:
    import wave

    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(np.clip(np.round(x * 32767), -32768, 32767).astype("<i2").tobytes())


def test_ingest_mfcc_of_anonymised_speech_is_byte_identical_across_chunk_sizes(tmp_path):
    from modalign.operators.ingest.audio import AudioMfccConfig, AudioMfccOperator
    from modalign.operators.ingest.base import SourceContext
    from modalign.schemas.manifest import SourceSpec

    x = np.concatenate([speech(), speech("en+f2")])  # ~8 s: two utterances at segment_s=4
    path = tmp_path / "mic.wav"
    write_wav(path, x)
    ctx = SourceContext(session_id="s1", spec=SourceSpec(id="mic", uri="mic.wav", modality="audio"), path=path,
                        uri=f"file://{path}", version="v1")
    pol = VoicePolicy()

    def run(chunk_s: float, secret: bytes = b"k" * 32) -> pa.Table:
        op = AudioMfccOperator(AudioMfccConfig(chunk_s=chunk_s), waveform_transform=voice_transform(pol, secret=secret))
        return pa.concat_tables(op.read(ctx))

    one = run(100.0)
    for chunk_s in (0.37, 1.0, 2.5):
        t = run(chunk_s)
        assert t.column("mfcc").equals(one.column("mfcc")) and t.column("voiced").equals(one.column("voiced"))
        assert t.column("t_ns").equals(one.column("t_ns"))
    plain = pa.concat_tables(AudioMfccOperator(AudioMfccConfig(chunk_s=100.0)).read(ctx))
    assert plain.num_rows == one.num_rows  # same frames, same times
    m_one, m_plain = (np.asarray(t.column("mfcc").to_pylist()) for t in (one, plain))
    assert np.abs(m_one[:, 1:13] - m_plain[:, 1:13]).mean() > 1.0  # the spectral envelope changed
    m_other = np.asarray(run(100.0, b"j" * 32).column("mfcc").to_pylist())
    assert np.abs(m_one[:, 1:13] - m_other[:, 1:13]).mean() > 0.5  # another tenant key, another pseudo-voice


def test_anonymised_voice_is_below_the_same_speaker_threshold_for_both_attackers():
    """Small set: 4 voices x 2 sentences; the full figures (EER) are in test_deid_eval.py."""
    pytest.importorskip("resemblyzer", reason="evaluation extra: resemblyzer")
    from modalign.pipeline.deid_eval import voice as ev

    corpus = ev.voice_corpus(("en-us+m3", "en+f2"), ("slt", "awb"), ev.SENTENCES[:2], natural=False)
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    import resemblyzer as rz

    enc = rz.VoiceEncoder("cpu", verbose=False)
    emb = lambda x: enc.embed_utterance(rz.preprocess_wav(x, RATE))  # noqa: E731
    tenant, attacker = (voice_transform(VoicePolicy(), secret=key) for key in (ev.TENANT_KEY, ev.ATTACKER_KEY))
    orig = {(s, i): emb(u.samples) for s, us in corpus.items() for i, u in enumerate(us)}
    anon = {(s, i): emb(tenant(u.samples, 0, f"t/{s}/{i}")) for s, us in corpus.items() for i, u in enumerate(us)}
    att = {(s, i): emb(attacker(u.samples, 0, f"a/{s}/{i}")) for s, us in corpus.items() for i, u in enumerate(us)}
    same = np.array([orig[(s, 0)] @ orig[(s, 1)] for s in corpus])
    diff = np.array([orig[(s, i)] @ orig[(t, j)] for s in corpus for t in corpus if s < t for i in (0, 1)
                     for j in (0, 1)])
    thr, eer = ev.eer_threshold(same, diff)
    assert eer <= 0.25 and same.mean() > thr  # the encoder links the originals
    own = np.array([anon[k] @ orig[k] for k in orig])  # the recording itself vs its original
    ignorant = np.array([anon[(s, i)] @ orig[(s, 1 - i)] for s in corpus for i in (0, 1)])
    lazy = np.array([anon[(s, i)] @ att[(s, 1 - i)] for s in corpus for i in (0, 1)])
    for scores in (own, ignorant, lazy):
        assert scores.mean() < thr and (scores >= thr).mean() <= 0.25
    # the old fixed-alpha McAdams: the lazy-informed attacker links it (one consistent pseudo-voice)
    mc = {(s, i): emb(McAdamsTransform(0.8)(u.samples)) for s, us in corpus.items() for i, u in enumerate(us)}
    assert np.mean([mc[(s, 0)] @ mc[(s, 1)] for s in corpus]) > lazy.mean() + 0.1


def test_inverse_filter_equals_scipy_lfilter_per_row():
    """The anonymiser's residual (LPC inverse filter, full-history samples) is scipy's FIR filter,
    computed for every frame at once without importing scipy.signal."""
    from scipy.signal import lfilter

    from modalign.operators.deid.voice import _inverse_filtered

    rng = np.random.default_rng(7)
    x = rng.standard_normal((9, 640))
    a = rng.standard_normal((9, 17))
    a[:, 0] = 1.0
    want = np.stack([lfilter(a[i], [1.0], x[i])[16:] for i in range(9)])
    got = _inverse_filtered(x, a)
    assert got.shape == (9, 624)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
