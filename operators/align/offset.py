"""Clock offset and skew of one audio source against another, from the sound itself.

Sits inside ingest, before alignment: where a manifest says ``clock.estimate_from: <ref>``,
the ingest worker decodes both sources' audio (``modalign.operators.ingest.audio.decode_audio``),
calls ``estimate_offset`` on the decoded arrays and hands the aligner only numbers (a ``ClockMapping``
and the per-window observations for ``TickAligner.observe_offsets``). The waveforms
never leave that call.

Sign convention (the one of ``modalign.schemas.manifest.ClockMapping``): a sound that the *other*
source records at its local time ``t`` happened at session time
``T = offset_ns + t * (1 + skew_ppm / 1e6)``, the reference being on the session clock
(or mapped by ``ref_clock``). A recorder that started 730 ms after the reference has
``offset_ns = +730_000_000``; one whose clock runs slow (fewer local ns per real second)
has a positive skew. The *observed offset* of a window is ``T - t`` at its centre, so for
a linear clock ``observed(t) = offset_ns + skew * t``: the fit is a line through the
windows' observations.

Method, coarse to fine (each stage re-times the other signal onto the reference's sample
grid with the previous stage's mapping, so skew does not smear a window's correlation):

1. log-energy envelopes (5 ms frames), 4 s windows searched over +-``max_offset_s``,
   normalised cross-correlation: robust to skews of a few percent and to channel
   differences; a Theil-Sen line through the windows (outliers dropped);
2. the same envelopes searched +-0.3 s around that line;
3. GCC-PHAT (phase transform, 100-7000 Hz) on 1 s windows, +-0.3 s;
4. GCC-PHAT on ``window_s`` windows every ``hop_s`` (default 4 s / 2 s), searched
   +-``final_search_s`` (2 s by default: a drift of the clock away from the line stays
   visible window by window). Peaks are refined to a fraction of a sample by a parabola.

A GCC-PHAT window's confidence is its peak's prominence above the other lags,
``(peak - median) / (1.4826 * MAD)`` (peak-to-sidelobe ratio, PSR), mapped linearly from
PSR 6 (what noise alone reaches over ~1e5 lags) to 1.0 at PSR 20; 0 means unusable. An
envelope window's is the margin of its correlation peak (>= 0.3) over the best lag more
than 250 ms away, mapped from 0.05 to 0.25. Each stage keeps the windows within its
tolerance (50, 20, 3, 1 ms) of a Theil-Sen line; the final offset and skew are a
confidence-weighted least-squares line through the last stage's (``inliers``). Skews up
to about 3 % are found (the envelope stage tolerates a 4 s window stretched by 120 ms).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from modalign.schemas.errors import InputError
from modalign.schemas.manifest import ClockMapping
from modalign.schemas.units import NS_PER_S

ENV_HOP = 80  # envelope frame length in samples at 16 kHz (5 ms); scaled with the sample rate
PSR_NOISE, PSR_CLEAR = 6.0, 20.0
ENV_EXCLUDE_S = 0.25
ENV_MARGIN = (0.05, 0.25)  # envelope peak margin mapped to confidence 0 .. 1
PHAT_BAND_HZ = (100.0, 7000.0)


@dataclass(frozen=True)
class OffsetEstimate:
    """Offset and skew of a source relative to the session clock, and the evidence.

    ``windows``: one ``(t_ns, observed_offset_ns, confidence)`` per analysed window, where
    ``t_ns`` is the session time of the window's centre, ``observed_offset_ns`` the
    measured ``T - t_local`` there and ``confidence`` in [0, 1] (0: no usable peak).
    ``inliers`` flags the windows the final line was fitted to. ``confidence`` overall is
    the fraction of windows that are inliers times their median confidence (0 when the last
    stage failed: the offset is then the previous stage's, its windows are not usable).
    """

    offset_ns: int
    skew_ppm: float
    confidence: float
    windows: list[tuple[int, int, float]] = field(default_factory=list)
    inliers: list[bool] = field(default_factory=list)

    def clock_mapping(self, estimate_from: str | None = None) -> ClockMapping:
        """The ``ClockMapping`` to ingest the source with (``estimated=True``)."""
        if not -10_000 <= self.skew_ppm <= 10_000:
            raise InputError(f"estimated clock skew {self.skew_ppm:.0f} ppm is outside +-10000 ppm",
                             stage="offset_estimation", code="skew_out_of_range")
        return ClockMapping(offset_ns=self.offset_ns, skew_ppm=self.skew_ppm, estimated=True,
                            estimate_from=estimate_from, confidence=min(1.0, max(0.0, float(self.confidence))))

    def observations(self, min_confidence: float = 0.0) -> list[tuple[int, int, float]]:
        """Windows with confidence above ``min_confidence``: the input of ``TickAligner.observe_offsets``."""
        return [w for w in self.windows if w[2] > min_confidence]

    def offset_at(self, t_local_ns: int) -> float:
        """Fitted ``T - t_local`` at local time ``t_local_ns`` (ns)."""
        return self.offset_ns + self.skew_ppm * 1e-6 * t_local_ns


@dataclass(frozen=True)
class _Stage:
    method: str  # "env" | "phat"
    win_s: float
    hop_s: float
    search_s: float
    fit_tol_ns: float
    warp: bool = True
    max_windows: int | None = 300


@dataclass
class _Signal:
    x: np.ndarray  # float32 mono
    start_ns: int  # local ns of sample 0
    rate: int

    @property
    def end_ns(self) -> float:
        return self.start_ns + len(self.x) * NS_PER_S / self.rate


def estimate_offset(
    ref: np.ndarray,
    other: np.ndarray,
    sample_rate_hz: int,
    *,
    ref_start_ns: int = 0,
    other_start_ns: int = 0,
    ref_clock: ClockMapping | None = None,
    window_s: float = 4.0,
    hop_s: float = 2.0,
    max_offset_s: float = 10.0,
    final_search_s: float = 2.0,
    max_skew_ppm: float = 50_000.0,
    source_uri: str | None = None,
) -> OffsetEstimate:
    """Clock mapping of ``other`` given ``ref`` on the session clock, from decoded mono signals.

    ``ref_start_ns``/``other_start_ns``: local ns of each first sample. ``ref_clock``: the
    reference's own mapping (default: the session clock itself, offset 0); the result is
    composed with it. ``max_offset_s`` bounds the offsets searched and ``max_skew_ppm`` the
    skews believed. Raises ``InputError`` (code ``offset_not_found``) when a stage before
    the last finds fewer than two windows on one line (one suffices for a clip shorter than
    three windows); when the last stage finds too little, the previous line (good to ~1 ms)
    is kept and no window is flagged as inlier. The caller decodes (the ingest worker, with
    ``operators.ingest.audio.decode_audio``): this module never opens a file.
    """
    r = _Signal(np.ascontiguousarray(ref, np.float32), int(ref_start_ns), int(sample_rate_hz))
    o = _Signal(np.ascontiguousarray(other, np.float32), int(other_start_ns), int(sample_rate_hz))
    stages = (
        _Stage("env", 4.0, 1.0, max_offset_s, 50e6, warp=False),
        _Stage("env", 4.0, 1.0, 0.3, 20e6),
        _Stage("phat", 1.0, 0.5, 0.3, 3e6),
        _Stage("phat", window_s, hop_s, final_search_s, 1e6, max_windows=None),
    )
    off, skew = 0.0, 0.0  # observed(t) = off + skew * t, t local ns
    for i, st in enumerate(stages):
        t_loc, obs, conf, pred = _windows(r, o, off, skew, st)
        fit = _robust_line(t_loc, obs, conf, st.fit_tol_ns)
        if fit is not None and abs(fit[1]) > max_skew_ppm * 1e-6:
            fit = None  # a line through chance peaks, not a clock
        if fit is None and i < len(stages) - 1:
            raise InputError(
                f"no consistent audio offset found ({int((conf > 0).sum())} usable windows of {len(conf)}): "
                "do the recordings share sound? set clock.offset_ns in the manifest instead",
                source_uri=source_uri, stage="offset_estimation", code="offset_not_found")
        if fit is None:  # the last stage found too little: keep the previous line, flag no window
            inl = np.zeros(len(conf), bool)
            continue
        off, skew, inl = fit
    # Compose with the reference's own mapping: T = o_r + T_ref * (1 + s_r).
    o_r = float(ref_clock.offset_ns) if ref_clock else 0.0
    s_r = float(ref_clock.skew_ppm) * 1e-6 if ref_clock else 0.0
    # Reference-clock time of each window centre: where its sound was found, or (no usable
    # peak) where the mapping the window was cut with put it.
    t_ref = t_loc + np.where(conf > 0, obs, pred)
    t_ses = o_r + t_ref * (1.0 + s_r)
    off_ses = o_r + off * (1.0 + s_r)
    skew_ses = (1.0 + skew) * (1.0 + s_r) - 1.0
    windows = [(int(round(a)), int(round(a - t)), float(c)) for a, t, c in zip(t_ses, t_loc, conf)]
    n_in = int(inl.sum())
    overall = n_in / len(conf) * float(np.median(conf[inl])) if n_in else 0.0
    return OffsetEstimate(offset_ns=int(round(off_ses)), skew_ppm=skew_ses * 1e6, confidence=overall,
                          windows=windows, inliers=inl.tolist())


# --- windows -----------------------------------------------------------------------------------


def _windows(r: _Signal, o: _Signal, off: float, skew: float, st: _Stage):
    """Per window: local ns of its centre, observed offset ns, confidence, and the offset the
    current mapping predicts there, as arrays.

    Windows are laid on the reference's sample grid where the current mapping puts the
    other signal (plus the search margin when nothing is known yet)."""
    rate = r.rate
    n_win = int(round(st.win_s * rate))
    hop = max(1, int(round(st.hop_s * rate)))
    if st.max_windows:  # coarse stages only need enough windows for a robust line
        span = (o.end_ns - o.start_ns) * rate / NS_PER_S
        hop = max(hop, int(span / st.max_windows))
    env_hop = max(1, int(round(ENV_HOP * rate / 16000)))
    margin = int(round(st.search_s * rate))
    if st.method == "env":
        margin = -(-margin // env_hop) * env_hop
        n_win = max(env_hop * 8, n_win // env_hop * env_hop)
    # Session span of the other signal under the current mapping, on reference samples.
    a = (off + o.start_ns * (1 + skew) - r.start_ns) * rate / NS_PER_S
    b = (off + o.end_ns * (1 + skew) - r.start_ns) * rate / NS_PER_S
    lo = max(a, -margin if not st.warp else 0.0)
    hi = min(b, len(r.x) + (margin if not st.warp else 0.0))
    starts = np.arange(int(np.ceil(lo)), int(np.floor(hi)) - n_win + 1, hop, dtype=np.int64)
    if len(starts) == 0 and hi - lo >= n_win * 0.5:  # shorter than one window: one window over all
        n_win = int(hi - lo) // env_hop * env_hop if st.method == "env" else int(hi - lo)
        starts = np.array([int(np.ceil(lo))], dtype=np.int64)
    t_loc, obs, conf, pred = [], [], [], []
    nfft = _next_fast(n_win + 2 * margin)
    for i0 in starts.tolist():
        # Template: the other signal re-timed onto reference samples i0 .. i0+n_win.
        t0 = r.start_ns + i0 * NS_PER_S / rate  # session ns of reference sample i0
        p0 = ((t0 - off) / (1 + skew) - o.start_ns) * rate / NS_PER_S
        dp = 1.0 / (1 + skew)
        if abs(p0 - round(p0)) < 1e-9 and dp == 1.0:
            tmpl = _slice(o.x, int(round(p0)), n_win)
        else:
            tmpl = _resample_linear(o.x, p0, dp, n_win)
        seg = _slice(r.x, i0 - margin, n_win + 2 * margin)
        if not np.any(tmpl) or not np.any(seg):
            continue
        if st.method == "env":
            lag, c = _env_lag(seg, tmpl, env_hop)
        else:
            lag, c = _phat_lag(seg, tmpl, rate, nfft)
        lag -= margin  # samples: template content sits at reference sample i0 + j + lag
        mid = t0 + (n_win / 2) * NS_PER_S / rate
        t_mid_local = (mid - off) / (1 + skew)
        t_loc.append(t_mid_local)
        obs.append(mid + lag * NS_PER_S / rate - t_mid_local)
        pred.append(mid - t_mid_local)
        conf.append(c)
    return (np.array(t_loc, np.float64), np.array(obs, np.float64), np.array(conf, np.float64),
            np.array(pred, np.float64))


def _slice(x: np.ndarray, start: int, n: int) -> np.ndarray:
    """x[start:start+n] with zeros outside x."""
    out = np.zeros(n, np.float32)
    a, b = max(start, 0), min(start + n, len(x))
    if b > a:
        out[a - start:b - start] = x[a:b]
    return out


def _resample_linear(x: np.ndarray, p0: float, dp: float, n: int) -> np.ndarray:
    """x read at fractional positions p0 + i * dp (i < n), linearly interpolated, 0 outside."""
    pos = p0 + dp * np.arange(n, dtype=np.float64)
    i = np.floor(pos).astype(np.int64)
    frac = (pos - i).astype(np.float32)
    a = _slice(x, int(i[0]), int(i[-1]) - int(i[0]) + 2)  # x[i[0] .. i[-1] + 1], zero-padded
    j = i - i[0]
    return a[j] * (1.0 - frac) + a[j + 1] * frac


def _next_fast(n: int) -> int:
    from scipy.fft import next_fast_len

    return int(next_fast_len(int(n), real=True))


def _psr_conf(cc: np.ndarray, k: int, exclude: int) -> float:
    side = np.concatenate([cc[:max(k - exclude, 0)], cc[k + exclude + 1:]])
    if len(side) < 16:
        return 0.0
    if len(side) > 8192:  # median and MAD of a regular subsample: same statistic, far cheaper
        side = side[:: len(side) // 4096]
    med = float(np.median(side))
    mad = float(np.median(np.abs(side - med))) * 1.4826
    if mad <= 0:
        return 0.0
    psr = (float(cc[k]) - med) / mad
    return float(np.clip((psr - PSR_NOISE) / (PSR_CLEAR - PSR_NOISE), 0.0, 1.0))


def _parabolic(cc: np.ndarray, k: int) -> float:
    if 0 < k < len(cc) - 1:
        y0, y1, y2 = float(cc[k - 1]), float(cc[k]), float(cc[k + 1])
        den = y0 - 2 * y1 + y2
        if den < 0:
            return k + float(np.clip(0.5 * (y0 - y2) / den, -0.5, 0.5))
    return float(k)


@lru_cache(maxsize=16)
def _band(nfft: int, rate: int) -> np.ndarray:
    f = np.arange(nfft // 2 + 1) * rate / nfft
    return ((f >= PHAT_BAND_HZ[0]) & (f <= min(PHAT_BAND_HZ[1], 0.45 * rate))).astype(np.float64)


def _phat_lag(seg: np.ndarray, tmpl: np.ndarray, rate: int, nfft: int) -> tuple[float, float]:
    """GCC-PHAT of a template inside a longer segment: (lag in samples, confidence)."""
    from scipy.fft import irfft, rfft

    n_lags = len(seg) - len(tmpl) + 1
    S = rfft(seg.astype(np.float64), nfft)
    T = rfft(tmpl.astype(np.float64), nfft)
    X = S * np.conj(T)
    mag = np.abs(X)
    X /= mag + 1e-12 * (mag.max() + 1e-30)
    X *= _band(nfft, rate)
    cc = irfft(X, nfft)[:n_lags]
    k = int(np.argmax(cc))
    return _parabolic(cc, k), _psr_conf(cc, k, max(2, rate // 1000))


def _envelope(x: np.ndarray, hop: int) -> np.ndarray:
    n = len(x) // hop
    e = np.square(x[: n * hop].astype(np.float64)).reshape(n, hop).mean(axis=1)
    return np.log(e + 1e-9)


def _env_lag(seg: np.ndarray, tmpl: np.ndarray, hop: int) -> tuple[float, float]:
    """Normalised cross-correlation of log-energy envelopes: (lag in samples, confidence)."""
    from scipy.fft import irfft, rfft

    es, et = _envelope(seg, hop), _envelope(tmpl, hop)
    m = len(et)
    et = et - et.mean()
    nt = float(np.sqrt(np.dot(et, et)))
    n_lags = len(es) - m + 1
    if nt <= 0 or n_lags < 1:
        return 0.0, 0.0
    nfft = _next_fast(len(es) + m)
    num = irfft(rfft(es, nfft) * np.conj(rfft(et, nfft)), nfft)[:n_lags]
    c1 = np.concatenate([[0.0], np.cumsum(es)])
    c2 = np.concatenate([[0.0], np.cumsum(es * es)])
    s1 = c1[m:m + n_lags] - c1[:n_lags]
    s2 = c2[m:m + n_lags] - c2[:n_lags]
    var = np.maximum(s2 - s1 * s1 / m, 1e-12 * m)
    cc = num / (nt * np.sqrt(var))
    k = int(np.argmax(cc))
    # Envelope correlations are smooth, so a PSR over all lags understates clear peaks:
    # the confidence is the margin of the peak over the best lag outside its +-250 ms.
    ex = max(1, int(round(ENV_EXCLUDE_S * 16000 / ENV_HOP)))
    side = np.concatenate([cc[:max(k - ex, 0)], cc[k + ex + 1:]])
    margin = float(cc[k] - side.max()) if len(side) else float(cc[k])
    c = float(np.clip((margin - ENV_MARGIN[0]) / (ENV_MARGIN[1] - ENV_MARGIN[0]), 0.0, 1.0)) if cc[k] >= 0.3 else 0.0
    return _parabolic(cc, k) * hop, c


# --- fit ---------------------------------------------------------------------------------------


def _robust_line(t: np.ndarray, y: np.ndarray, conf: np.ndarray, tol_ns: float):
    """(offset, skew, inlier mask) of ``y = offset + skew * t`` or None when < 2 windows agree.

    Theil-Sen on the usable windows, then confidence-weighted least squares on those
    within ``tol_ns`` of it; a lone window (a clip shorter than two windows) gives skew 0."""
    ok = conf > 0
    idx = np.flatnonzero(ok)
    if len(idx) == 0:
        return None
    if len(idx) == 1:
        if len(t) > 2:  # one window among several is no agreement
            return None
        return float(y[idx[0]]), 0.0, ok.copy()
    tt, yy = t[idx] / NS_PER_S, y[idx]
    if len(idx) > 600:  # Theil-Sen is O(n^2): a deterministic subsample bounds it
        sub = np.linspace(0, len(idx) - 1, 600).round().astype(int)
        ts_t, ts_y = tt[sub], yy[sub]
    else:
        ts_t, ts_y = tt, yy
    i, j = np.triu_indices(len(ts_t), 1)
    dt = ts_t[j] - ts_t[i]
    good = np.abs(dt) > 1e-9
    slope = float(np.median((ts_y[j] - ts_y[i])[good] / dt[good])) / NS_PER_S if good.any() else 0.0
    icpt = float(np.median(yy - slope * NS_PER_S * tt))
    res = yy - (icpt + slope * NS_PER_S * tt)
    inl = np.abs(res) <= tol_ns
    if inl.sum() < 2:
        return None
    w = conf[idx][inl]
    x1, y1 = tt[inl], yy[inl]
    if np.ptp(x1) > 0:
        xm = np.average(x1, weights=w)
        ym = np.average(y1, weights=w)
        slope_s = float(np.sum(w * (x1 - xm) * (y1 - ym)) / np.sum(w * (x1 - xm) ** 2))
        skew = slope_s / NS_PER_S
        icpt = ym - slope_s * xm
    else:
        skew, icpt = 0.0, float(np.average(y1, weights=w))
    mask = np.zeros(len(t), bool)
    mask[idx[inl]] = True
    return float(icpt), float(skew), mask
