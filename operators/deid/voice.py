"""Voice de-identification: the keyed per-utterance anonymiser and the voice policy of MFCC tables.

Data flow: ``modalign.operators.ingest`` audio decode -> 16 kHz mono chunks -> [**VoiceAnonymiser**,
policy ``anonymise``] -> MFCC (100 frames/s) -> **VoicePolicyOperator** -> the aligner.
The raw waveform is never stored: the audio ingest keeps only MFCCs, and the policy operator
removes any waveform column that would still be present.

Policy actions (``modalign.schemas.policy.VoicePolicy``):

- ``anonymise`` (default): the waveform is re-synthesised by ``VoiceAnonymiser`` *before* the
  MFCCs are computed (a hook in the audio ingest, inside the worker process). The speaker's
  average spectral envelope (over ``envelope_norm_s``) is removed, and every utterance
  (``segment_s`` of the stream's sample clock) gets its own McAdams coefficient, VTLN warp,
  envelope shape and monotone pitch on a synthetic source (pulses + noise), drawn from
  HMAC-SHA256 of the tenant's voice sub-key, the
  source (``session/source``) and the utterance index: so the pseudo-voice differs between
  utterances of one speaker (an attacker who anonymises enrolment speech with the same
  method gets other draws) and between tenants, and the same input and config give
  byte-identical MFCCs, whatever the chunking. Timing and energy per frame are kept. The
  transformed tables must say so in their schema metadata (``VOICE_TRANSFORM_META`` = the
  transform's ``name``); the operator refuses (``ComplianceError``) tables without the
  matching marker: a missing hook never produces "anonymised" features of the original voice.
- ``keep_mfcc``: MFCC frames of the original voice pass with a ``deid`` header (method
  ``waveform_dropped``). MFCCs still carry the speaker's timbre: biometric data (GDPR Art. 9).
- ``drop``: all voice features are withheld (zero rows, same schema).

Measured by ``modalign.pipeline.deid_eval.voice`` (``benchmarks/voice_linkability.py``):
resemblyzer EER of the ignorant and lazy-informed attackers, pocketsphinx WER before/after.
voiceanon@3 on 15 voices (6 sentences each synthetic voice): EER 41.9 % / 45.6 % (50 % is
chance; 7.8 % before), WER 44.6 % -> 78.9 %: the keyed envelope shapes and warps that defeat the
speaker encoder also cost recognition accuracy (see the report). With the McAdams range 1..1
(VTLN only) WER was 71.3 % and the EERs 41.7 % / 44.7 %, but the ignorant EER fell to 37.5-38.1 %
on either 3-sentence half of the corpus (41.7 % and 42.3 % with 0.8..1). Without the envelope
normalisation and envelope shape (``envelope_norm_s=0``, ``timbre_db=0``), measured on 8 of the
voices, WER was 54 % but the EERs 26 % / 30 %.

``McAdamsTransform`` (Patino et al., Interspeech 2021; VoicePrivacy baseline B2) is the fixed-
alpha building block, kept for comparison: per 20 ms frame (10 ms hop, periodic Hann) an
order-20 LPC model, pole angles ``phi -> phi ** alpha`` (radii kept, so the filter stays
stable), re-synthesis from the residual, overlap-add, each frame scaled to its input energy.
A fixed alpha gives one consistent pseudo-voice per speaker, which the lazy-informed attacker
links (EER ~12 %). numpy/scipy only.
"""

from __future__ import annotations

import hashlib
import hmac
import math

import numpy as np
import pyarrow as pa
from pydantic import Field

from modalign.operators.base import OperatorConfig, TableOperator
from modalign.schemas.errors import ComplianceError, InputError
from modalign.schemas.arrow import arrow_type
from modalign.schemas.policy import DEFAULT_POLICY_TAG, VoicePolicy
from modalign.schemas.tables import DeidHeader

DEID = "deid"
DEID_TYPE = arrow_type(DeidHeader)
VOICE_TRANSFORM_META = b"modalign.voice_transform"
MCADAMS_VERSION = "1"


class McAdamsTransform:
    """Callable ``samples -> samples`` (mono float32, same length) warping LPC pole angles.

    Picklable and stateless between calls (safe to share across chunks and sources).
    ``name`` (``mcadams@1/alpha=0.800/order=20/win=20ms``) goes into the MFCC tables'
    schema metadata and the ``deid`` header.
    """

    def __init__(self, alpha: float = 0.8, sample_rate_hz: int = 16000, win_ms: float = 20.0,
                 lpc_order: int = 20) -> None:
        if not 0.5 < alpha < 1.5:
            raise ValueError("McAdams alpha must be in (0.5, 1.5)")
        self.alpha = float(alpha)
        self.sample_rate_hz = int(sample_rate_hz)
        self.win = int(round(win_ms * sample_rate_hz / 1000)) // 2 * 2
        self.hop = self.win // 2
        self.order = int(lpc_order)
        if self.win <= 2 * self.order:
            raise ValueError("McAdams window too short for the LPC order")
        self.name = f"mcadams@{MCADAMS_VERSION}/alpha={self.alpha:.3f}/order={self.order}/win={win_ms:g}ms"

    def __repr__(self) -> str:
        return f"McAdamsTransform({self.name})"

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        from scipy.signal import lfilter

        x = np.asarray(samples, dtype=np.float64).reshape(-1)
        n = x.size
        if n == 0:
            return np.zeros(0, np.float32)
        win, hop, p = self.win, self.hop, self.order
        window = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(win) / win)  # periodic Hann: sums to 1 at hop win/2
        n_frames = int(np.ceil((n + hop) / hop))
        padded = np.zeros((n_frames + 1) * hop)
        padded[hop:hop + n] = x
        idx = np.arange(win)[None, :] + hop * np.arange(n_frames)[:, None]
        frames = padded[idx] * window  # (F, win)
        energy = np.einsum("ij,ij->i", frames, frames)
        active = energy > 1e-10 * win
        out = np.zeros_like(padded)
        if active.any():
            fa = frames[active]
            a = _lpc(fa, p)  # (Fa, p + 1), a[:, 0] == 1
            a_new = _warp_poles(a, self.alpha)
            synth = np.empty_like(fa)
            for k in range(fa.shape[0]):
                residual = lfilter(a[k], [1.0], fa[k])
                synth[k] = lfilter([1.0], a_new[k], residual)
            e_out = np.einsum("ij,ij->i", synth, synth)
            gain = np.sqrt(energy[active] / np.maximum(e_out, 1e-20))
            synth *= gain[:, None]
            full = np.zeros_like(frames)
            full[active] = synth
        else:
            full = frames
        _overlap_add(out, full, hop)
        return out[hop:hop + n].astype(np.float32)


def _overlap_add(out: np.ndarray, frames: np.ndarray, hop: int) -> None:
    """out[k*hop : k*hop + win] += frames[k], as two strided adds (win == 2 * hop)."""
    n_frames = frames.shape[0]
    first, second = frames[:, :hop], frames[:, hop:]
    out[: n_frames * hop] += first.reshape(-1)
    out[hop: hop + n_frames * hop] += second.reshape(-1)


def _lpc(frames: np.ndarray, order: int) -> np.ndarray:
    """LPC polynomials (autocorrelation method, Levinson-Durbin), vectorised over frames."""
    n = frames.shape[1]
    nfft = 1 << int(np.ceil(np.log2(2 * n)))
    spec = np.fft.rfft(frames, nfft, axis=1)
    r = np.fft.irfft(spec.real ** 2 + spec.imag ** 2, nfft, axis=1)[:, : order + 1]
    r[:, 0] *= 1.0 + 1e-9  # white-noise correction: keeps the recursion well conditioned
    f = frames.shape[0]
    a = np.zeros((f, order + 1))
    a[:, 0] = 1.0
    err = r[:, 0].copy()
    for i in range(1, order + 1):
        acc = r[:, i] + np.einsum("ij,ij->i", a[:, 1:i], r[:, i - 1:0:-1]) if i > 1 else r[:, 1].copy()
        k = -acc / np.maximum(err, 1e-30)
        prev = a[:, 1:i].copy()
        a[:, 1:i] = prev + k[:, None] * prev[:, ::-1]
        a[:, i] = k
        err = err * (1.0 - k * k)
    return a


def _warp_poles(a: np.ndarray, alpha: float | np.ndarray, warp: float | np.ndarray = 0.0) -> np.ndarray:
    """Move the complex roots of ``a``: angle ``phi -> phi ** alpha``, then the all-pass (VTLN)
    map ``phi -> phi + 2 atan(warp sin phi / (1 - warp cos phi))``; radii kept. Per-frame
    ``alpha``/``warp`` arrays or scalars; real coefficients out."""
    f, p1 = a.shape
    p = p1 - 1
    alpha = np.broadcast_to(np.asarray(alpha, dtype=np.float64), (f,))[:, None]
    warp = np.broadcast_to(np.asarray(warp, dtype=np.float64), (f,))[:, None]
    comp = np.zeros((f, p, p))
    comp[:, 0, :] = -a[:, 1:]
    comp[:, np.arange(1, p), np.arange(p - 1)] = 1.0
    roots = np.linalg.eigvals(comp)  # (F, p) poles of 1/A(z)
    ang = np.angle(roots)
    complex_pole = np.abs(roots.imag) > 1e-9
    mag = np.abs(ang) ** alpha
    if np.any(warp != 0.0):
        mag = mag + 2.0 * np.arctan(warp * np.sin(mag) / (1.0 - warp * np.cos(mag)))
    new_ang = np.where(complex_pole, np.sign(ang) * mag, ang)
    new_roots = np.abs(roots) * np.exp(1j * new_ang)
    poly = np.zeros((f, p1), dtype=complex)
    poly[:, 0] = 1.0
    for k in range(p):  # multiply by (1 - r_k z^-1)
        poly[:, 1:k + 2] = poly[:, 1:k + 2] - new_roots[:, k:k + 1] * poly[:, 0:k + 1]
    return poly.real


ANON_VERSION = "3"
NFFT = 512  # synthesis FFT (32 ms at 16 kHz): a 20 ms frame plus the filter's tail
NORM_BLOCK = 10  # frames per block of the running envelope mean (100 ms at hop 10 ms)
TIMBRE_TERMS = 6  # cosine terms of the keyed per-utterance envelope shape


class VoiceAnonymiser:
    """Callable ``(samples, start_sample, source_key) -> samples``: keyed per-utterance voice re-synthesis.

    Per 20 ms frame on the stream's sample clock (frame ``j`` covers stream samples
    ``[(j-1)*hop, (j+1)*hop)``, hop 10 ms, periodic Hann): an order-20 LPC envelope (log magnitude,
    512-point FFT). The speaker's long-term envelope (energy-weighted mean over ``norm_s`` around the
    frame, in 100 ms blocks on the stream clock) is subtracted, so every voice starts from the same
    flat timbre; the rest (the phones) is frequency-warped (McAdams ``pi (w/pi) ** alpha``, then the
    all-pass VTLN map ``w + 2 atan(warp sin w / (1 - warp cos w))``) and given a keyed envelope shape
    (``sum_m c_m cos(m w)``, ``|c_m| <= timbre_db``). The source is replaced entirely: a pulse train at
    a keyed monotone ``f0`` on a stream-global lattice where the frame is voiced (normalised
    autocorrelation of the LPC residual), keyed white noise where it is not, mixed by voicing; the
    new envelope is applied as a minimum-phase filter and each frame keeps its input energy. Neither
    the speaker's pitch, glottal source, average timbre nor formant positions survive as they were.

    ``(alpha, warp, f0, c_1..c_6)`` are drawn per utterance = ``segment_s`` of the stream's sample
    clock (``k = sample // segment``) from HMAC-SHA256(secret, name, source_key, k), the noise of
    utterance ``k`` from a generator seeded the same way: reproducible with the tenant key,
    unpredictable without it, never from time or process state. The first ``crossfade_ms`` of a
    segment blend the previous segment's parameters into the new ones.

    Output sample ``s`` depends only on input samples within ``context_samples`` of it (the envelope
    mean's reach): a caller that passes that much untransformed input on each side of what it keeps
    gets byte-identical output for any chunking (the audio ingest does). Picklable, stateless.
    """

    def __init__(self, secret: bytes, sample_rate_hz: int = 16000, segment_s: float = 4.0,
                 alpha_range: tuple[float, float] = (0.8, 1.0), warp_range: tuple[float, float] = (-0.2, 0.2),
                 f0_range_hz: tuple[float, float] = (80.0, 250.0), timbre_db: float = 10.0, norm_s: float = 3.0,
                 lpc_order: int = 20, win_ms: float = 20.0, crossfade_ms: float = 100.0) -> None:
        self._secret = bytes(secret)
        self.sample_rate_hz = int(sample_rate_hz)
        self.win = int(round(win_ms * sample_rate_hz / 1000)) // 2 * 2
        self.hop = self.win // 2
        self.order = int(lpc_order)
        if self.win <= 2 * self.order or self.win > NFFT:
            raise ValueError("anonymiser window too short for the LPC order, or longer than the synthesis FFT")
        self.segment = max(1, int(round(segment_s * sample_rate_hz / self.hop))) * self.hop
        self.crossfade = max(1, int(round(crossfade_ms * sample_rate_hz / 1000 / self.hop)))  # frames
        self.alpha_range, self.warp_range, self.f0_range_hz = tuple(alpha_range), tuple(warp_range), tuple(f0_range_hz)
        self.timbre_db = float(timbre_db)
        self.norm_blocks = int(round(norm_s * sample_rate_hz / self.hop / NORM_BLOCK / 2))  # blocks either side
        self.context_samples = ((self.norm_blocks + 2) * NORM_BLOCK + 4) * self.hop + NFFT
        self.name = (f"voiceanon@{ANON_VERSION}/seg={segment_s:g}s/alpha={alpha_range[0]:.2f}..{alpha_range[1]:.2f}"
                     f"/warp={warp_range[0]:+.2f}..{warp_range[1]:+.2f}/f0={f0_range_hz[0]:g}..{f0_range_hz[1]:g}Hz"
                     f"/timbre={self.timbre_db:g}dB/norm={norm_s:g}s/order={self.order}/win={win_ms:g}ms")
        nb = NFFT // 2 + 1
        self._omega = np.pi * np.arange(nb) / (nb - 1)
        self._cos = np.cos(np.arange(1, TIMBRE_TERMS + 1)[:, None] * self._omega[None, :])  # (terms, bins)

    def __repr__(self) -> str:
        return f"VoiceAnonymiser({self.name})"

    def _digest(self, *parts: object) -> bytes:
        msg = "\x00".join([self.name, *map(str, parts)]).encode()
        return hmac.new(self._secret, msg, hashlib.sha256).digest()

    def params(self, source_key: str, segment_index: int) -> np.ndarray:
        """``(alpha, warp, f0_hz, c_1..c_6 dB)`` of utterance (segment) ``segment_index`` of ``source_key``."""
        d = self._digest(source_key, int(segment_index)) + self._digest(source_key, int(segment_index), "timbre")
        u = [int.from_bytes(d[i:i + 7], "big") / float(2 ** 56) for i in range(0, 7 * (3 + TIMBRE_TERMS), 7)]
        lerp = lambda r, t: r[0] + (r[1] - r[0]) * t  # noqa: E731
        f0 = math.exp(lerp((math.log(self.f0_range_hz[0]), math.log(self.f0_range_hz[1])), u[2]))
        timbre = [self.timbre_db * (2.0 * t - 1.0) for t in u[3:]]
        return np.array([lerp(self.alpha_range, u[0]), lerp(self.warp_range, u[1]), f0, *timbre])

    def frame_params(self, source_key: str, frames: np.ndarray) -> np.ndarray:
        """``(F, 9)`` parameters of stream frames ``frames`` (centre ``j * hop``), cross-faded at segment starts."""
        centre = np.asarray(frames, dtype=np.int64) * self.hop
        seg = centre // self.segment
        cache = {int(k): self.params(source_key, int(k)) for k in np.unique(np.concatenate([seg, seg - 1])) if k >= 0}
        cur = np.stack([cache[int(k)] for k in seg])
        prev = np.stack([cache[int(k) - 1] if k > 0 else cache[int(k)] for k in seg])
        into = (centre - seg * self.segment) // self.hop  # frames since the segment started
        w = np.minimum(1.0, (into + 1) / self.crossfade)
        return prev + (cur - prev) * w[:, None]

    def _noise(self, source_key: str, lo: int, hi: int) -> np.ndarray:
        """Keyed white noise of stream samples ``[lo, hi)`` (zeros before the stream starts)."""
        out = np.zeros(hi - lo)
        for k in range(max(lo, 0) // self.segment, (hi - 1) // self.segment + 1):
            seed = int.from_bytes(self._digest(source_key, k, "noise")[:16], "big")
            z = np.random.default_rng(seed).standard_normal(self.segment)
            a, b = max(lo, 0, k * self.segment), min(hi, (k + 1) * self.segment)
            out[a - lo:b - lo] = z[a - k * self.segment:b - k * self.segment]
        return out

    def _normalised(self, log_env: np.ndarray, weight: np.ndarray, j0: int) -> np.ndarray:
        """``log_env`` minus its weighted running mean over ``norm_blocks`` blocks either side.

        Block ``b`` holds frames ``[b*B, (b+1)*B)`` of the stream; block means are interpolated
        linearly between block centres. Sums run in a fixed order, so a frame's value never depends
        on where the chunk started."""
        if self.norm_blocks <= 0:
            return log_env
        f, nb = log_env.shape
        blk, k = NORM_BLOCK, self.norm_blocks
        b0 = j0 // blk
        n_blocks = (j0 + f - 1) // blk + 1 - b0
        off = j0 - b0 * blk
        wl = np.zeros((n_blocks * blk, nb))
        wl[off:off + f] = log_env * weight[:, None]
        ww = np.zeros(n_blocks * blk)
        ww[off:off + f] = weight
        padded = np.zeros((n_blocks + 2 * k, nb))
        padded[k:k + n_blocks] = wl.reshape(n_blocks, blk, nb).sum(axis=1)
        padded_w = np.zeros(n_blocks + 2 * k)
        padded_w[k:k + n_blocks] = ww.reshape(n_blocks, blk).sum(axis=1)
        acc, acc_w = np.zeros((n_blocks, nb)), np.zeros(n_blocks)
        for d in range(2 * k + 1):
            acc += padded[d:d + n_blocks]
            acc_w += padded_w[d:d + n_blocks]
        mean = acc / np.maximum(acc_w, 1e-12)[:, None]
        c = (np.arange(j0, j0 + f) + 0.5) / blk - 0.5 - b0  # fractional block index of each frame
        i0 = np.clip(np.floor(c).astype(np.int64), 0, n_blocks - 1)
        i1 = np.minimum(i0 + 1, n_blocks - 1)
        t = np.clip(c - np.floor(c), 0.0, 1.0)[:, None]
        return log_env - (mean[i0] * (1.0 - t) + mean[i1] * t)

    def _envelope(self, log_env: np.ndarray, prm: np.ndarray) -> np.ndarray:
        """Warped, keyed log envelope (natural log) per frame."""
        om = self._omega
        mc = np.pi * (om[None, :] / np.pi) ** prm[:, 0:1]
        g = mc + 2.0 * np.arctan(prm[:, 1:2] * np.sin(mc) / (1.0 - prm[:, 1:2] * np.cos(mc)))
        out = np.empty_like(log_env)
        for k in range(log_env.shape[0]):  # output bin w takes the envelope at g^-1(w); g is increasing
            out[k] = np.interp(om, g[k], log_env[k])
        db = math.log(10.0) / 20.0
        for m in range(TIMBRE_TERMS):
            out += (prm[:, 3 + m] * db)[:, None] * self._cos[m][None, :]
        return out

    def __call__(self, samples: np.ndarray, start_sample: int = 0, source_key: str = "") -> np.ndarray:
        x = np.asarray(samples, dtype=np.float64).reshape(-1)
        n, hop, win, p = x.size, self.hop, self.win, self.order
        if n == 0:
            return np.zeros(0, np.float32)
        start = int(start_sample)
        j0, j1 = start // hop, -(-(start + n) // hop) + 1  # frames j in [j0, j1) overlap the input
        base = (j0 - 3) * hop  # stream sample of buf[0]: frame j0 starts at buf[2*hop]
        buf = np.zeros((j1 - j0 + 6) * hop)
        buf[start - base:start - base + n] = x
        window = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(win) / win)
        n_frames = j1 - j0
        pos = hop * np.arange(n_frames)[:, None]
        frames = buf[2 * hop + np.arange(win)[None, :] + pos] * window
        energy = np.einsum("ij,ij->i", frames, frames)
        active = energy > 1e-10 * win
        out = np.zeros((n_frames + 1) * hop + NFFT)
        if active.any():
            idx = np.flatnonzero(active)
            ja = np.arange(j0, j1)
            a = np.zeros((n_frames, p + 1))
            a[:, 0] = 1.0
            a[idx] = _lpc(frames[idx], p)
            log_env = -np.log(np.maximum(np.abs(np.fft.rfft(a, NFFT, axis=1)), 1e-8))  # log |1 / A|
            log_env -= log_env.mean(axis=1, keepdims=True)  # shape only: each frame keeps its energy
            log_env = self._normalised(log_env, np.sqrt(energy) * active, j0)
            prm = self.frame_params(source_key, ja)
            env = self._envelope(log_env, prm)
            cep = np.fft.irfft(env, NFFT, axis=1)  # minimum-phase filter of that magnitude
            cep[:, 1:NFFT // 2] *= 2.0
            cep[:, NFFT // 2 + 1:] = 0.0
            filt = np.exp(np.fft.rfft(cep, NFFT, axis=1))
            # voicing: normalised autocorrelation of the LPC residual over 40 ms around the frame's centre
            rate = self.sample_rate_hz
            long = buf[hop + np.arange(4 * hop)[None, :] + pos[idx]]
            long_res = _inverse_filtered(long, a[idx])
            voicing = np.zeros(n_frames)
            voicing[idx] = np.clip((_periodicity(long_res, np.arange(rate // 400, rate // 70 + 1)) - 0.35) / 0.3,
                                   0.0, 1.0)
            first = (ja - 1) * hop  # stream sample of each frame's first sample
            noise = self._noise(source_key, int(first[0]), int(first[-1]) + win)
            noise = noise[np.arange(win)[None, :] + (first - first[0])[:, None]] * window
            pulses = np.zeros((n_frames, win))
            for k in idx[voicing[idx] > 0.0]:  # a pulse train at the keyed f0 on a stream-global lattice
                period = rate / prm[k, 2]
                m = np.arange(math.ceil(first[k] / period), math.floor((first[k] + win - 1) / period) + 1)
                at = np.round(m * period).astype(np.int64) - first[k]
                pulses[k, at[(at >= 0) & (at < win)]] = 1.0
            pulses *= window
            pe, ne = (np.einsum("ij,ij->i", e, e) for e in (pulses, noise))
            v = voicing[:, None]
            source = (np.sqrt(1.0 - v * v) * noise / np.sqrt(np.maximum(ne, 1e-20))[:, None]
                      + v * pulses / np.sqrt(np.maximum(pe, 1e-20))[:, None])
            synth = np.fft.irfft(np.fft.rfft(source, NFFT, axis=1) * filt, NFFT, axis=1)
            e_out = np.einsum("ij,ij->i", synth, synth)
            synth *= (np.sqrt(energy / np.maximum(e_out, 1e-20)) * active)[:, None]
            for k in idx:
                out[k * hop:k * hop + NFFT] += synth[k]
        lo = start - (j0 - 1) * hop
        return out[lo:lo + n].astype(np.float32)


def _inverse_filtered(x: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Each row of ``x`` through the FIR filter of the same row of ``a`` (an LPC inverse filter), only
    the samples with a full history: ``lfilter(a[i], [1], x[i])[p:]`` for every row at once (without
    scipy.signal, whose import alone costs an actor about 1.7 CPU s)."""
    p = a.shape[1] - 1
    windows = np.lib.stride_tricks.sliding_window_view(x, p + 1, axis=1)  # (rows, n - p, p + 1): x[j .. j + p]
    return np.einsum("rjk,rk->rj", windows, a[:, ::-1])


def _periodicity(e: np.ndarray, lags: np.ndarray) -> np.ndarray:
    """Per row of ``e``: the largest normalised autocorrelation over ``lags`` (0: noise, 1: periodic)."""
    n = e.shape[1]
    nfft = 1 << int(np.ceil(np.log2(2 * n)))
    spec = np.fft.rfft(e, nfft, axis=1)
    r = np.fft.irfft(spec.real ** 2 + spec.imag ** 2, nfft, axis=1)[:, lags]
    cs = np.concatenate([np.zeros((e.shape[0], 1)), np.cumsum(e * e, axis=1)], axis=1)
    head, tail = cs[:, n - lags], cs[:, -1:] - cs[:, lags]  # energy of e[:-lag] and of e[lag:]
    return np.max(r / np.sqrt(np.maximum(head * tail, 1e-30)), axis=1)


def anonymiser(policy: VoicePolicy, secret: bytes | None, sample_rate_hz: int = 16000) -> VoiceAnonymiser:
    """The policy's keyed per-utterance anonymiser. ``secret``: the tenant's voice sub-key
    (``DeidContext.subkey``); None: a random key per call (nothing reproducible, only the name is)."""
    import os

    return VoiceAnonymiser(secret if secret is not None else os.urandom(32), sample_rate_hz=sample_rate_hz,
                           segment_s=policy.segment_s, alpha_range=policy.mcadams_alpha_range,
                           warp_range=policy.vtln_warp_range, f0_range_hz=policy.f0_range_hz,
                           timbre_db=policy.timbre_db, norm_s=policy.envelope_norm_s)


def voice_transform(policy: VoicePolicy, sample_rate_hz: int = 16000,
                    secret: bytes | None = None) -> VoiceAnonymiser | None:
    """The waveform hook the audio ingest applies before MFCC; None unless ``anonymise``."""
    if policy.action != "anonymise":
        return None
    return anonymiser(policy, secret, sample_rate_hz)


def mark_transformed(table: pa.Table, transform: VoiceAnonymiser | McAdamsTransform) -> pa.Table:
    """``table`` with schema metadata saying its MFCCs come from ``transform``'s output."""
    meta = dict(table.schema.metadata or {})
    meta[VOICE_TRANSFORM_META] = transform.name.encode()
    return table.replace_schema_metadata(meta)


class VoicePolicyConfig(OperatorConfig):
    voice: VoicePolicy = VoicePolicy()
    policy_tag: str = DEFAULT_POLICY_TAG
    sample_rate_hz: int = 16000
    waveform_columns: tuple[str, ...] = Field(
        ("samples", "waveform", "pcm", "audio"),
        description="raw-audio columns removed if an upstream table still carries them",
    )


class VoicePolicyOperator(TableOperator[VoicePolicyConfig]):
    """Apply the voice policy to MFCC tables (``event_id, t_ns, frame_index, mfcc``).

    Output: the input columns minus any raw-waveform column, plus ``deid`` (method
    ``waveform_dropped``, the anonymiser's ``voiceanon@3/...`` name or ``dropped``; detector ``none``;
    count 0). ``drop``: zero rows, same schema. ``anonymise``: the input must carry the
    ``VOICE_TRANSFORM_META`` marker of the policy's transform, else ComplianceError.
    """

    kind = "voice_policy"
    version = "0.3.0"
    config_model = VoicePolicyConfig

    @property
    def transform(self) -> VoiceAnonymiser | None:
        return voice_transform(self.config.voice, self.config.sample_rate_hz)

    def output_schema(self, input_schema: pa.Schema) -> pa.Schema:
        schema = input_schema
        for name in (*self.config.waveform_columns, DEID):
            i = schema.get_field_index(name)
            if i >= 0:
                schema = schema.remove(i)
        return schema.append(pa.field(DEID, DEID_TYPE))

    def process(self, table: pa.Table) -> pa.Table:
        self.ensure_setup()
        missing = [c for c in ("event_id", "t_ns", "mfcc") if c not in table.column_names]
        if missing:
            raise InputError(f"MFCC table lacks column(s) {', '.join(missing)}", stage=self.kind,
                             code="schema_mismatch")
        action = self.config.voice.action
        method = {"keep_mfcc": "waveform_dropped", "drop": "dropped"}.get(action)
        if action == "anonymise":
            expected = self.transform.name  # type: ignore[union-attr]
            got = (table.schema.metadata or {}).get(VOICE_TRANSFORM_META, b"").decode(errors="replace")
            if got != expected and table.num_rows:
                first = table.column("event_id")[0].as_py()
                raise ComplianceError(
                    f"voice policy 'anonymise' needs MFCCs computed from the {expected} transform, but the batch "
                    f"starting at event {first} is marked {got or 'untransformed'}; the batch is withheld. Install "
                    "modalign.operators.deid.voice.voice_transform(policy) as the audio ingest's waveform hook",
                    stage=self.kind,
                )
            method = expected
        out = table
        for name in (*self.config.waveform_columns, DEID):
            i = out.schema.get_field_index(name)
            if i >= 0:
                out = out.remove_column(i)
        if action == "drop":
            out = out.slice(0, 0)
        header = {"policy": self.config.policy_tag, "method": method, "detector": "none", "count": 0,
                  "threshold": 0.0}
        return out.append_column(pa.field(DEID, DEID_TYPE), pa.array([header] * out.num_rows, type=DEID_TYPE))
