"""Matching rules of the tick aligner: which event (if any) each tick gets, per source.

Called by ``modalign.operators.align.aligner`` for every decided chunk of ticks, on one
source's sorted event times. Pure numpy over int64 ns arrays.

Rules (DESIGN.md "Alignment"): point events (video frames, MFCC frames) match the nearest
event within the modality's tolerance, each event at most once (the nearest tick wins,
ties to the earlier tick); outside tolerance is a gap, never a silent nearest match. PDF
pages are intervals held until the next page (residual 0 inside); a tick that no page
covers sees a page starting within the tolerance (residual = start - tick).
"""

from __future__ import annotations

import numpy as np


def match_points(ticks: np.ndarray, events: np.ndarray, tol_ns: int) -> np.ndarray:
    """Index of the event matched to each tick, or -1; each event matched at most once.

    ``events`` must be sorted. A tick takes its nearest event if within ``tol_ns``; if
    several ticks want one event, the nearest tick (earliest on a tie) keeps it.
    """
    out = np.full(len(ticks), -1, dtype=np.int64)
    if len(events) == 0 or len(ticks) == 0:
        return out
    pos = np.searchsorted(events, ticks)
    left = np.maximum(pos - 1, 0)
    right = np.minimum(pos, len(events) - 1)
    dl = np.abs(ticks - events[left])
    dr = np.abs(events[right] - ticks)
    nearest = np.where(dr < dl, right, left)
    dist = np.minimum(dl, dr)
    cand = np.flatnonzero(dist <= tol_ns)
    if len(cand) == 0:
        return out
    ev = nearest[cand]
    if len(ev) == 1 or not np.any(ev[1:] == ev[:-1]):  # sorted ticks: a shared event is adjacent
        out[cand] = ev
        return out
    # Uniqueness: sort candidates by (event, distance, tick) and keep the first per event.
    order = np.lexsort((cand, dist[cand], nearest[cand]))
    cand = cand[order]
    ev = nearest[cand]
    first = np.ones(len(cand), dtype=bool)
    first[1:] = ev[1:] != ev[:-1]
    out[cand[first]] = ev[first]
    return out


def match_intervals(ticks: np.ndarray, starts: np.ndarray, ends: np.ndarray, tol_ns: int) -> tuple[np.ndarray, np.ndarray]:
    """Sample-and-hold pages: (page index or -1, residual_ns) per tick.

    A tick inside [start, end) sees that page with residual 0. A tick shown no page (before
    the first page, or in a hole of the schedule) sees the next page if it starts within
    ``tol_ns``, with residual ``start - tick``; otherwise it is a gap.
    """
    idx = np.full(len(ticks), -1, dtype=np.int64)
    res = np.zeros(len(ticks), dtype=np.int64)
    if len(starts) == 0:
        return idx, res
    held = np.searchsorted(starts, ticks, side="right") - 1
    p = np.clip(held, 0, len(starts) - 1)
    inside = (held >= 0) & (ticks < ends[p])
    idx[inside] = p[inside]
    nxt = np.clip(held + 1, 0, len(starts) - 1)
    early = ~inside & (held + 1 < len(starts)) & (starts[nxt] - ticks <= tol_ns)
    idx[early] = nxt[early]
    res[early] = starts[nxt[early]] - ticks[early]
    return idx, res
