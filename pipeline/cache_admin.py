"""``modalign cache stats|gc OUT``: what the feature cache of an output folder holds, and pruning it.

Works on ``OUT/cache`` (``modalign.operators.cache.store.FeatureCache`` segments) and the
committed feature files that reference it (column ``cache_key``; ``modalign.open``).
``gc`` rewrites segments, so it takes the output folder's lease like a run does: it fails
with ``OutputLockedError`` while a run writes the folder (whose embed actors flush new
segments at its end).

What "referenced" means (what ``gc`` keeps):
- every ``cache_key`` of a feature row: frame and roi rows name their own entry, patch
  rows (``patch_features``) the grid's entry, text and audio rows theirs;
- plus the patch grid each referenced frame/roi entry was pooled from (the segment's
  ``parent_key``): keeping it lets a later run pool a new roi on the same frame (another
  face box, a slide area) without a forward pass. Entries written before ``parent_key``
  existed have none, and their grids go.
Everything else (entries of deleted outputs, of an old model, of erased subjects whose
rows are gone) is dropped.

Hit and miss counts are per run, not stored in the cache: ``stats`` reports the last
run's from the committed run summary (``counts.cache``).
"""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from modalign.pipeline.layout import OutputLayout
from modalign.pipeline.outputs import Output, refuse_s3
from modalign.schemas.errors import ConfigError

GRANULARITIES = ("frame", "roi", "patch")


def _committed(out: Path) -> Output | None:
    """The folder's committed state (None: nothing committed yet)."""
    try:
        return Output(out)
    except ConfigError:
        return None


def referenced_keys(out: Path) -> set[str]:
    """Every ``cache_key`` of the committed feature rows."""
    output = _committed(out)
    if output is None:
        return set()
    return set(output.table("features").to_table(columns=["cache_key"]).column("cache_key").to_pylist())


def _cache(out: Path) -> Any:
    from modalign.operators.cache.store import FeatureCache

    layout = OutputLayout(Path(out))
    if not Path(out).is_dir():
        raise ConfigError(f"output folder {out} does not exist")
    return FeatureCache(layout.cache_dir) if layout.cache_dir.is_dir() else None


def _disk(cache_dir: Path) -> tuple[int, int]:
    from modalign.operators.cache.store import SEGMENT_GLOB

    segs = list(cache_dir.glob(SEGMENT_GLOB)) if cache_dir.is_dir() else []
    return len(segs), sum(p.stat().st_size for p in segs)


def _kept(catalog: Any, referenced: set[str]) -> set[str]:
    keys = catalog.column("cache_key").to_pylist()
    parents = catalog.column("parent_key").to_pylist()
    return (set(keys) & referenced) | {p for k, p in zip(keys, parents) if p and k in referenced}


def cache_stats(out: Path | str) -> dict:
    """Entries per granularity and model, bytes on disk, what ``gc`` would drop, last run's hit rate."""
    refuse_s3(out, "modalign cache stats", "a run into object storage keeps no feature cache (in memory for the run only)")
    out = Path(out)
    cache = _cache(out)
    layout = OutputLayout(out)
    segments, nbytes = _disk(layout.cache_dir)
    result: dict[str, Any] = {
        "cache_dir": str(layout.cache_dir),
        "segments": segments,
        "bytes": nbytes,
        "entries": 0,
        "by_granularity": {g: {"entries": 0, "floats": 0} for g in GRANULARITIES},
        "by_model": {},
        "referenced": 0,
        "unreferenced": 0,
        "unreferenced_by_granularity": {g: 0 for g in GRANULARITIES},
        "last_run": _last_run(out),
    }
    if cache is None:
        return result
    cat = cache.catalog()
    keys = cat.column("cache_key").to_pylist()
    grans = cat.column("granularity").to_pylist()
    models = cat.column("model_id").to_pylist()
    dims = cat.column("dim").to_pylist()
    kept = _kept(cat, referenced_keys(out))
    by_model: dict[str, Counter] = {}
    for k, g, m, d in zip(keys, grans, models, dims):
        slot = result["by_granularity"].setdefault(g, {"entries": 0, "floats": 0})
        slot["entries"] += 1
        slot["floats"] += int(d)
        by_model.setdefault(m, Counter())[g] += 1
        if k not in kept:
            result["unreferenced_by_granularity"][g] = result["unreferenced_by_granularity"].get(g, 0) + 1
    result["entries"] = len(keys)
    result["by_model"] = {m: dict(sorted(c.items())) for m, c in sorted(by_model.items())}
    result["referenced"] = len(kept & set(keys))
    result["unreferenced"] = len(keys) - result["referenced"]
    return result


def _last_run(out: Path) -> dict | None:
    output = _committed(out)
    if output is None:
        return None
    summary = output.run
    cache = summary.get("counts", {}).get("cache")
    if not cache:
        return None
    return {"run_id": summary.get("run_id"), "finished_at": summary.get("finished_at"), **cache}


def cache_gc(out: Path | str, *, dry_run: bool = False) -> dict:
    """Drop cache entries no feature row references (nor derives from); returns what was removed.

    Refuses (``ConfigError``) when ``OUT`` has no feature files but a non-empty cache: that
    is far more likely a wrong path or an interrupted run than a wish to empty the cache.
    """
    refuse_s3(out, "modalign cache gc", "a run into object storage keeps no feature cache (in memory for the run only)")
    from modalign.pipeline.lease import Lease
    from modalign.pipeline.store import LocalStore

    out = Path(out)
    cache = _cache(out)
    with Lease(LocalStore(out), uuid.uuid4().hex, writer="cache gc"):  # OutputLockedError while a run writes OUT
        return _gc(out, cache, dry_run)


def _gc(out: Path, cache: Any, dry_run: bool) -> dict:
    layout = OutputLayout(out)
    seg_before, bytes_before = _disk(layout.cache_dir)
    result: dict[str, Any] = {"dry_run": dry_run, "removed": 0, "kept": 0,
                              "removed_by_granularity": {g: 0 for g in GRANULARITIES},
                              "segments_before": seg_before, "segments_after": seg_before,
                              "bytes_before": bytes_before, "bytes_after": bytes_before}
    if cache is None:
        return result
    cat = cache.catalog()
    referenced = referenced_keys(out)
    if not referenced and cat.num_rows:
        raise ConfigError(f"no committed feature files in {out}: gc would empty the whole cache; "
                          "check the output folder (or delete OUT/cache by hand)")
    kept = _kept(cat, referenced)
    for k, g in zip(cat.column("cache_key").to_pylist(), cat.column("granularity").to_pylist()):
        if k not in kept:
            result["removed_by_granularity"][g] = result["removed_by_granularity"].get(g, 0) + 1
    result["removed"] = sum(result["removed_by_granularity"].values())
    result["kept"] = cat.num_rows - result["removed"]
    if not dry_run and result["removed"]:
        cache.gc(kept, keep_parents=False)
        result["segments_after"], result["bytes_after"] = _disk(layout.cache_dir)
    return result


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def render_stats(stats: dict) -> str:
    """Human summary of ``cache_stats`` (or of ``cache_gc``'s result)."""
    if "removed" in stats:  # a gc result
        verb = "would remove" if stats["dry_run"] else "removed"
        by = ", ".join(f"{g} {n}" for g, n in stats["removed_by_granularity"].items() if n) or "nothing"
        return (f"cache gc: {verb} {stats['removed']} entries ({by}), kept {stats['kept']}; "
                f"{stats['segments_before']} -> {stats['segments_after']} segments, "
                f"{_size(stats['bytes_before'])} -> {_size(stats['bytes_after'])}")
    lines = [f"feature cache {stats['cache_dir']}: {stats['entries']} entries in {stats['segments']} segment(s), "
             f"{_size(stats['bytes'])} on disk"]
    lines.append(f"  {'granularity':<12} {'entries':>8} {'MiB (float32)':>14} {'unreferenced':>13}")
    for g, slot in stats["by_granularity"].items():
        lines.append(f"  {g:<12} {slot['entries']:>8} {slot['floats'] * 4 / 2**20:>14.1f} "
                     f"{stats['unreferenced_by_granularity'].get(g, 0):>13}")
    for m, counts in stats["by_model"].items():
        lines.append(f"  model {m}: " + ", ".join(f"{g} {n}" for g, n in counts.items()))
    lines.append(f"  referenced by feature rows (or their patch grids): {stats['referenced']}; "
                 f"gc would remove {stats['unreferenced']}")
    run = stats.get("last_run")
    if run:
        rate = run.get("hit_rate")
        per = ", ".join(f"{g} {run['hits'].get(g, 0)}/{run['hits'].get(g, 0) + run['misses'].get(g, 0)}"
                        for g in GRANULARITIES if run["hits"].get(g, 0) + run["misses"].get(g, 0))
        lines.append(f"  last run {str(run.get('run_id') or '')[:8]}: hit rate "
                     f"{'n/a' if rate is None else f'{rate:.1%}'} (hits/lookups: {per or 'none'})")
    else:
        lines.append("  last run: none committed")
    return "\n".join(lines)
