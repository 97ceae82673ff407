"""Distribution shift of one modality property against a reference (``schemas.config.QualityShiftConfig``).

Called by ``pipeline.quality`` at every commit with the committed values of a session (or of all
sessions) and the reference output's; Ray-free and I/O-free (arrays in, numbers out).

- **PSI** (population stability index) over the reference's quantile bins: the ``bins - 1`` interior
  quantiles of the reference (values of it, ``inverted_cdf``), repeated ones merged, cut the line
  into the stretches between them and the edges themselves (a bin of values equal to each edge), so
  a reference that is one value (a fixed resolution, no clipping at all) still tells values below,
  at and above it apart. ``PSI = sum((c - r) * ln(c / r))`` over the bins' proportions, both smoothed
  with half a count per bin (an empty bin is not infinitely surprising). Rules of thumb: under 0.1
  stable, 0.1-0.25 moderate, above 0.25 a significant shift.
- **Mean shift** in reference standard deviations: ``(current mean - reference mean) / sigma`` with
  ``sigma = max(reference std, min_sigma, min_sigma_fraction * |reference mean|)``. The floor matters:
  a fixed camera's brightness varies by a level or two, and against so narrow a reference any
  other session of the same room would look shifted.
- **Alarm** when both sides have ``min_events`` values, the PSI is at least ``psi_threshold`` and the
  mean moved at least ``shift_sigmas`` sigmas: a different shape alone (PSI) or a small move of a
  narrow distribution (sigmas) is not a shift worth waking someone for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SMOOTHING = 0.5  # counts added to every bin of both distributions


@dataclass(frozen=True)
class Summary:
    """Count, mean, standard deviation and percentiles of a property's values (None when empty)."""

    n: int
    mean: float | None = None
    std: float | None = None
    p05: float | None = None
    p50: float | None = None
    p95: float | None = None


def summarize(values: np.ndarray) -> Summary:
    v = np.asarray(values, np.float64)
    if v.size == 0:
        return Summary(0)
    p05, p50, p95 = (float(x) for x in np.percentile(v, [5, 50, 95]))
    return Summary(int(v.size), float(v.mean()), float(v.std()), p05, p50, p95)


def bin_edges(reference: np.ndarray, bins: int) -> np.ndarray:
    """The reference's interior quantiles (values of it), repeated ones merged."""
    q = np.arange(1, bins) / bins
    return np.unique(np.quantile(np.asarray(reference, np.float64), q, method="inverted_cdf"))


def bin_of(edges: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Bin index of each value: ``2 * (edges below it) + (1 if it equals an edge)``, 0 .. 2 * len(edges)."""
    below = np.searchsorted(edges, values, side="left")
    at = below < len(edges)
    at[at] = edges[below[at]] == values[at]
    return 2 * below + at


def psi(reference: np.ndarray, current: np.ndarray, bins: int = 10) -> float:
    """Population stability index of ``current`` against ``reference`` over the reference's quantile bins."""
    ref, cur = np.asarray(reference, np.float64), np.asarray(current, np.float64)
    edges = bin_edges(ref, bins)
    k = 2 * len(edges) + 1
    r = np.bincount(bin_of(edges, ref), minlength=k) + SMOOTHING
    c = np.bincount(bin_of(edges, cur), minlength=k) + SMOOTHING
    r, c = r / r.sum(), c / c.sum()
    return float(np.sum((c - r) * np.log(c / r)))


def sigma_of(ref: Summary, min_sigma: float = 0.0, min_sigma_fraction: float = 0.0) -> float:
    """The reference's floored standard deviation (the unit of the mean shift)."""
    return max(ref.std or 0.0, min_sigma, min_sigma_fraction * abs(ref.mean or 0.0))


@dataclass(frozen=True)
class Shift:
    psi: float | None
    shift_sigmas: float | None
    alarm: bool


def compare(reference: np.ndarray, current: np.ndarray, *, bins: int = 10, psi_threshold: float = 0.25,
            shift_sigmas: float = 3.0, min_events: int = 50, min_sigma: float = 0.0,
            min_sigma_fraction: float = 0.0) -> Shift:
    """PSI, mean shift and alarm of ``current`` against ``reference`` (see the module docstring)."""
    ref, cur = np.asarray(reference, np.float64), np.asarray(current, np.float64)
    if ref.size == 0 or cur.size == 0:
        return Shift(None, None, False)
    p = psi(ref, cur, bins)
    rs = summarize(ref)
    sigma = sigma_of(rs, min_sigma, min_sigma_fraction)
    delta = float(cur.mean()) - float(rs.mean)
    z = delta / sigma if sigma > 0 else (0.0 if delta == 0 else float(np.sign(delta)) * float("inf"))
    alarm = (ref.size >= min_events and cur.size >= min_events and p >= psi_threshold
             and abs(z) >= shift_sigmas)
    return Shift(p, z if np.isfinite(z) else None, bool(alarm))
