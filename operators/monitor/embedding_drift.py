"""Embedding drift: windows of feature vectors against a reference, with a dynamic threshold.

Called by ``modalign.pipeline.monitors`` once per (embedding model, granularity) over the
committed features in order; Ray-free and I/O-free (arrays in, ``WindowResult`` out).

Per window of vectors the monitor keeps 2 + P statistics per vector: the logarithm of its
L2 norm (rounded to 1e-4, so that an L2-normalised model's float noise is one value), and, of
the vector normalised, its cosine to the reference's mean direction and its projections on P
fixed random unit directions (seeded: the same directions in every run). Random projections
of unit vectors change little when the directions change (their marginals stay close to
N(0, 1/dim)); the cosine to the reference's centroid is what sees noise frames or a swapped
encoder at once.

- **Reference.** The first ``reference_windows`` windows (or windows given by the caller, from
  another output: ``--reference OUT0``). Each statistic gets ``bins`` equal-mass bins from the
  pooled reference values (open at both ends) and the reference's bin probabilities.
- **Divergence.** A window's divergence is the mean over the statistics of KL(window ||
  reference) of their binned distributions, both smoothed with half a count per bin (the
  largest instead of the mean doubled the false alarms on stationary input in testing).
- **Threshold.** ``mu + alpha * sigma`` over the last ``history`` divergences of windows that
  raised no alarm, recomputed every ``update_every`` windows; sigma is at least a tenth of mu.
  The history starts from the reference's own windows, each scored leave-one-out against
  the other reference windows, so the first window after the reference already has a threshold.
- **Adaptation of alpha.** After ``adapt_after`` consecutive alarms, alpha rises by
  ``alpha_step`` (at most ``alpha_max``) and the threshold is recomputed, so that a lasting
  shift stops alarming every window once it has been reported; the first window without an
  alarm resets alpha. ``alpha_step: 0`` keeps alpha fixed (every shifted window alarms).
- **Norm jump.** A separate alarm when a window's mean L2 norm differs from the reference's by
  more than ``norm_jump`` (relative) and by more than ``norm_sigmas`` standard deviations of the
  reference windows' mean norms: a model that stops normalising, or a broken input scale.

Alarmed windows stay out of the history, so a shift does not raise its own threshold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from modalign.schemas.config import EmbeddingMonitorConfig

SMOOTHING = 0.5  # counts added to every bin of both distributions before KL
NORM_DECIMALS = 4  # log-norm rounding: 1e-4 relative, below any real change, above float noise
MIN_SIGMA = 0.1  # sigma's floor, as a fraction of mu


def directions(dim: int, count: int, seed: int) -> np.ndarray:
    """(count, dim) float64 random unit vectors, the same for the same (dim, count, seed)."""
    d = np.random.default_rng([seed, dim]).standard_normal((count, dim))
    return d / np.linalg.norm(d, axis=1, keepdims=True)


def statistics(vectors: np.ndarray, dirs: np.ndarray, centroid: np.ndarray) -> np.ndarray:
    """(n, 2 + P): log L2 norm (rounded), cosine to ``centroid`` and the projections on ``dirs``
    (the last two of the L2-normalised vector: the norm has its own column)."""
    v = np.asarray(vectors, dtype=np.float64)
    norms = np.linalg.norm(v, axis=1)
    unit = v / np.maximum(norms, 1e-30)[:, None]
    log_norm = np.round(np.log(np.maximum(norms, 1e-30)), NORM_DECIMALS)
    return np.column_stack([log_norm, unit @ centroid, unit @ dirs.T])


def centroid_of(vectors: np.ndarray) -> np.ndarray:
    """The unit mean direction of ``vectors`` (each normalised first)."""
    v = np.asarray(vectors, dtype=np.float64)
    m = (v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-30)).mean(axis=0)
    n = np.linalg.norm(m)
    return m / n if n > 0 else m


def _binned(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    return np.bincount(np.searchsorted(edges, values, side="right"), minlength=len(edges) + 1)


def _kl(counts: np.ndarray, ref_counts: np.ndarray) -> float:
    p = (counts + SMOOTHING) / (counts.sum() + SMOOTHING * len(counts))
    q = (ref_counts + SMOOTHING) / (ref_counts.sum() + SMOOTHING * len(ref_counts))
    return float(np.sum(p * np.log(p / q)))


@dataclass(frozen=True)
class Reference:
    """What windows are scored against: the centroid, and per statistic its interior bin edges
    and the reference's counts per bin."""

    centroid: np.ndarray
    edges: tuple[np.ndarray, ...]
    counts: tuple[np.ndarray, ...]
    mean_norm: float
    norm_sd: float  # of the reference windows' mean norms

    @classmethod
    def of(cls, windows: list[np.ndarray], dirs: np.ndarray, bins: int) -> "Reference":
        pooled = np.concatenate(windows)
        centroid = centroid_of(pooled)
        stats = statistics(pooled, dirs, centroid)
        qs = np.linspace(0, 1, bins + 1)[1:-1]
        edges = tuple(np.unique(np.quantile(stats[:, j], qs)) for j in range(stats.shape[1]))
        norms = [float(np.linalg.norm(w.astype(np.float64), axis=1).mean()) for w in windows]
        return cls(centroid, edges, tuple(_binned(stats[:, j], e) for j, e in enumerate(edges)),
                   float(np.linalg.norm(pooled.astype(np.float64), axis=1).mean()), float(np.std(norms)))

    def divergence(self, vectors: np.ndarray, dirs: np.ndarray) -> float:
        """The mean KL(window || reference) over the statistics."""
        stats = statistics(vectors, dirs, self.centroid)
        return float(np.mean([_kl(_binned(stats[:, j], e), c)
                              for j, (e, c) in enumerate(zip(self.edges, self.counts))]))


@dataclass(frozen=True)
class WindowResult:
    """One window's verdict. ``divergence`` and ``threshold`` are None for a reference window."""

    index: int
    vectors: int
    mean_norm: float
    reference: bool
    divergence: float | None = None
    threshold: float | None = None
    alpha: float | None = None
    drift_alarm: bool = False
    norm_alarm: bool = False


@dataclass
class DriftMonitor:
    """One (model, granularity) stream of windows; ``observe`` each window in order."""

    config: EmbeddingMonitorConfig
    dim: int
    windows: int = 0  # observed so far
    _dirs: np.ndarray = field(init=False, repr=False)
    _pending: list[np.ndarray] = field(default_factory=list, repr=False)  # the reference's windows so far
    _ref: Reference | None = field(default=None, repr=False)
    _history: list[float] = field(default_factory=list, repr=False)
    _alpha: float = field(init=False)
    _threshold: float = field(default=0.0, repr=False)
    _since_update: int = 0
    _streak: int = 0  # consecutive drift alarms

    def __post_init__(self) -> None:
        self._dirs = directions(self.dim, self.config.projections, self.config.seed)
        self._alpha = self.config.alpha

    @property
    def ready(self) -> bool:
        """Whether the reference is complete (windows after it are scored)."""
        return self._ref is not None

    @property
    def reference_windows(self) -> int:
        return len(self._pending)

    @property
    def reference_norm(self) -> float | None:
        """The reference's mean L2 norm, once it is complete."""
        return self._ref.mean_norm if self._ref is not None else None

    def seed_reference(self, windows: list[np.ndarray]) -> None:
        """Use ``windows`` (vectors of another output, in order) as the whole reference, before any ``observe``."""
        if self.windows or self._pending:
            raise ValueError("seed_reference comes before the first window")
        self._pending = [self._checked(w) for w in windows]
        if len(self._pending) >= 2:
            self._complete_reference()

    def observe(self, vectors: np.ndarray) -> WindowResult:
        vectors = self._checked(vectors)
        mean_norm = float(np.linalg.norm(vectors.astype(np.float64), axis=1).mean())
        index, self.windows = self.windows, self.windows + 1
        if self._ref is None:
            self._pending.append(vectors)
            if len(self._pending) >= self.config.reference_windows:
                self._complete_reference()
            return WindowResult(index, len(vectors), mean_norm, reference=True)
        d = self._ref.divergence(vectors, self._dirs)
        if self._since_update >= self.config.update_every:
            self._update_threshold()
        alarm = d > self._threshold
        alpha, threshold = self._alpha, self._threshold
        if alarm:
            self._streak += 1
            if self._streak % self.config.adapt_after == 0 and self.config.alpha_step > 0:
                self._alpha = min(self.config.alpha_max, self._alpha + self.config.alpha_step)
                self._update_threshold()
        else:
            self._history = (self._history + [d])[-self.config.history:]
            if self._streak:
                self._streak, self._alpha = 0, self.config.alpha
                self._update_threshold()
        self._since_update += 1
        jump = abs(mean_norm - self._ref.mean_norm)
        norm_alarm = bool(jump > self.config.norm_jump * max(self._ref.mean_norm, 1e-12)
                          and jump > self.config.norm_sigmas * self._ref.norm_sd)
        return WindowResult(index, len(vectors), mean_norm, reference=False, divergence=d, threshold=threshold,
                            alpha=alpha, drift_alarm=bool(alarm), norm_alarm=norm_alarm)

    def _checked(self, vectors: np.ndarray) -> np.ndarray:
        v = np.asarray(vectors)
        if v.ndim != 2 or v.shape[1] != self.dim or not len(v):
            raise ValueError(f"a window is (n >= 1, {self.dim}) vectors, not {v.shape}")
        return v

    def _complete_reference(self) -> None:
        windows, bins = self._pending, self.config.bins
        self._ref = Reference.of(windows, self._dirs, bins)
        # leave-one-out: each reference window against the others, an honest start of the history
        self._history = [Reference.of(windows[:i] + windows[i + 1:], self._dirs, bins).divergence(w, self._dirs)
                         for i, w in enumerate(windows)][-self.config.history:]
        self._update_threshold()

    def _update_threshold(self) -> None:
        mu = float(np.mean(self._history))
        sigma = max(float(np.std(self._history)), MIN_SIGMA * mu)
        self._threshold = mu + self._alpha * sigma
        self._since_update = 0


def split_windows(n: int, size: int) -> list[slice]:
    """``n`` ordered vectors as windows of ``size`` to ``2 * size - 1`` (fewer than half a window: none;
    under a window: one short window)."""
    if n < max(1, size // 2):
        return []
    count = max(1, n // size)
    bounds = np.linspace(0, n, count + 1).round().astype(int)
    return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
