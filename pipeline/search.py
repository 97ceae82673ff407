"""``modalign search OUT``: nearest feature rows to an image, a text, or a stored record.

Reads the folder's latest commit (``modalign.open``): the run summary (the embed config,
so a query is encoded with the same weights and preprocessing as the index), the committed
FAISS index of the model and granularity (ids = ``feature_id``) and the committed feature
files (the rows the ids map back to). Nothing is written.

Queries and their default granularity:
- ``image``: the image encoder (``modalign.operators.embed.registry``, same config as the run) ->
  the image model's ``frame`` index; ``roi`` finds regions (a face crop finds face boxes),
  ``patch`` needs a run with patch features;
- ``text``: the text encoder -> the text model's ``roi`` index (text blocks of PDF pages);
- ``record``: an ``event_id`` or a ``feature_id`` -> that row's stored vector -> its own
  model's index at its granularity (a frame row's event prefers its ``frame`` row);
  nothing is excluded, so the record itself comes first (exact ties are broken in its
  favour).

Scores are inner products of L2-normalised vectors (cosine, 1.0 = identical). Results are
dicts (``render_results`` prints them): rank, score, feature_id, event_id, session_id,
source_id, source_uri, modality, granularity, model_id, t_ns, t_s, box, and for text
blocks their (de-identified) text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from modalign.pipeline.layout import safe_name
from modalign.pipeline.outputs import Output
from modalign.schemas.errors import ConfigError, UnreadableInputError

GRANULARITIES = ("frame", "roi", "patch")
ROW_COLUMNS = ["feature_id", "event_id", "session_id", "source_id", "source_uri", "modality", "granularity",
               "model_id", "t_ns", "box"]


def _embed_config(output: Output) -> Any:
    """The run's ``EmbedConfig`` (defaults when the summary has none)."""
    from modalign.schemas.config import EmbedConfig

    return EmbedConfig.model_validate(output.run.get("config", {}).get("embed", {}))


def _feature_files(output: Output) -> dict[tuple[str, str], list[Path]]:
    """(model dir name, granularity) -> its committed feature files."""
    groups = output.layout.feature_groups(output.layout.relative(p) for p in output.files("features"))
    return {key: [output.root / f for f in files] for key, files in groups.items()}


def _available(output: Output) -> str:
    pairs = [f"{m} {g}" for m, g in _feature_files(output)]
    return "; ".join(pairs) if pairs else "none (no feature files: run `modalign run` first)"


def _read_rows(output: Output, files: list[Path], columns: list[str], filter_expr: Any = None) -> Any:
    import pyarrow.dataset as ds

    return ds.dataset([str(f) for f in files], format="parquet", filesystem=output.filesystem).to_table(
        columns=columns, filter=filter_expr)


def _load_index(output: Output, model_id: str, granularity: str) -> Any:
    """The committed FAISS index of (model, granularity), or one built from its feature files."""
    from modalign.operators.cache.index import FeatureIndex

    path = output.index_file(model_id, granularity)
    if path is not None:  # a file, or an object of an s3:// OUT
        return FeatureIndex.load(path) if output.filesystem is None else \
            FeatureIndex.from_bytes(output.layout.read_bytes(path))
    files = _feature_files(output).get((safe_name(model_id), granularity))
    if not files:
        raise ConfigError(f"no {granularity} features of model {model_id} in {output.root}; "
                          f"available: {_available(output)}")
    t = _read_rows(output, files, ["feature_id", "vector", "dim"])
    dim = int(t.column("dim")[0].as_py())
    index = FeatureIndex(dim)
    index.add(t.column("feature_id").to_numpy(), _vectors(t, dim))
    return index


def _vectors(table: Any, dim: int) -> np.ndarray:
    flat = table.column("vector").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    return np.asarray(flat, dtype=np.float32).reshape(-1, dim)


def _read_image(path: Path) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    if not path.is_file():
        raise UnreadableInputError("query image does not exist", source_uri=str(path), stage="search")
    try:
        with Image.open(path) as im:
            return np.asarray(im.convert("RGB"), dtype=np.uint8).copy()
    except (UnidentifiedImageError, OSError) as e:
        raise UnreadableInputError(f"query image cannot be decoded ({type(e).__name__}); use a JPEG or PNG file",
                                   source_uri=str(path), stage="search") from e


def _image_query(output: Output, image: Path) -> tuple[np.ndarray, str]:
    from modalign.operators.embed.image import ImageEncoder
    from modalign.operators.embed.registry import image_embed_config

    pixels = _read_image(image)
    enc = ImageEncoder(image_embed_config(_embed_config(output)))
    vec = enc.embed_frames(pixels[None])["frame"][0]
    assert enc.model_id is not None
    return vec, enc.model_id


def _text_query(output: Output, text: str) -> tuple[np.ndarray, str]:
    from modalign.operators.embed.registry import text_embed_config
    from modalign.operators.embed.text import TextEncoder

    if not text.strip():
        raise ConfigError("the text query is empty")
    enc = TextEncoder(text_embed_config(_embed_config(output)))
    vec = enc.embed_texts([text])[0]
    assert enc.model_id is not None
    return vec, enc.model_id


def find_record(out: Path | Output, record: str, granularity: str | None = None) -> dict:
    """The feature row (with its vector) of a ``feature_id`` or an ``event_id``.

    An event with several rows gives the one at ``granularity`` if set, else its frame
    row, else its first roi row, else its first patch row (in file order).
    """
    import pyarrow.compute as pc

    output = out if isinstance(out, Output) else Output(out)
    files = output.files("features")
    if not files:
        raise ConfigError(f"no feature files in {output.root}; run `modalign run` first")
    rec = str(record).strip()
    expr = pc.field("event_id") == rec
    if rec.isdigit():
        expr = expr | (pc.field("feature_id") == int(rec))
    rows = _read_rows(output, files, ROW_COLUMNS + ["vector"], expr).to_pylist()
    if not rows:
        raise ConfigError(f"no feature row has feature_id or event_id {rec!r} in {out}")
    exact = [r for r in rows if str(r["feature_id"]) == rec]
    if exact:
        return exact[0]
    order = [granularity] if granularity else list(GRANULARITIES)
    for g in order:
        for r in rows:
            if r["granularity"] == g:
                return r
    raise ConfigError(f"event {rec!r} has no {granularity} feature row; it has "
                      f"{sorted({r['granularity'] for r in rows})}")


def search(out: Path, *, image: Path | None = None, text: str | None = None, record: str | None = None,
           granularity: str | None = None, k: int = 5) -> list[dict]:
    """The ``k`` nearest feature rows to one query (exactly one of ``image``, ``text``, ``record``).

    ``granularity`` None picks the query's natural one: frame for an image, roi for a text,
    the record's own for a record.
    """
    if sum(q is not None for q in (image, text, record)) != 1:
        raise ConfigError("give exactly one query: --image FILE, --text QUERY or --record ID")
    if granularity is not None and granularity not in GRANULARITIES:
        raise ConfigError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    if k < 1:
        raise ConfigError("k must be at least 1")
    output = Output(out)  # ConfigError: no such folder, or nothing committed in it
    self_id = None
    if image is not None:
        vec, model_id = _image_query(output, Path(image))
        gran = granularity or "frame"
    elif text is not None:
        vec, model_id = _text_query(output, text)
        gran = granularity or "roi"
    else:
        row = find_record(output, str(record), granularity)
        dim = len(row["vector"])
        vec, model_id, self_id = np.asarray(row["vector"], np.float32).reshape(dim), row["model_id"], row["feature_id"]
        gran = granularity or row["granularity"]

    index = _load_index(output, model_id, gran)
    if index.dim != len(vec):
        raise ConfigError(f"the {model_id} {gran} index holds {index.dim}-d vectors, the query is {len(vec)}-d; "
                          "the run used another encoder config")
    files = _feature_files(output).get((safe_name(model_id), gran))
    if not files:
        raise ConfigError(f"no {gran} features of model {model_id} in {out}; available: {_available(output)}")
    rows = {r["feature_id"]: r for r in _read_rows(output, files, ROW_COLUMNS).to_pylist()}
    # ask for a few more than k: ids removed from the feature files (erasure) may linger in an old index
    want = min(index.ntotal, k + 8)
    if want == 0:
        return []
    scores, ids = index.search(vec, want)
    hits = [(float(s), int(i)) for s, i in zip(scores[0], ids[0]) if i != -1 and int(i) in rows]
    if self_id is not None:
        top = hits[0][0] if hits else None
        tied = [h for h in hits if h[1] == self_id and top is not None and np.isclose(h[0], top, atol=1e-6)]
        if tied:
            hits = tied + [h for h in hits if h[1] != self_id]
    results = []
    for rank, (score, fid) in enumerate(hits[:k], start=1):
        r = rows[fid]
        results.append({
            "rank": rank, "score": round(score, 6), "feature_id": fid, "event_id": r["event_id"],
            "session_id": r["session_id"], "source_id": r["source_id"], "source_uri": r["source_uri"],
            "modality": r["modality"], "granularity": r["granularity"], "model_id": r["model_id"],
            "t_ns": int(r["t_ns"]), "t_s": round(int(r["t_ns"]) / 1e9, 3), "box": _box(r["box"]),
        })
    _attach_text(output, results)
    return results


def _box(box: dict | None) -> dict | None:
    if box is None:
        return None
    return {"x0": int(box["x0"]), "y0": int(box["y0"]), "x1": int(box["x1"]), "y1": int(box["y1"]),
            "score": round(float(box["score"]), 4)}


def _attach_text(output: Output, results: list[dict]) -> None:
    """Add the (already de-identified) text of PDF text-block results from the PDF events."""
    import pyarrow.compute as pc

    ids = sorted({r["event_id"] for r in results if r["modality"] == "pdf"})
    files = output.files("events_pdf")
    if not ids or not files:
        return
    t = _read_rows(output, files, ["event_id", "text"], pc.field("event_id").isin(ids))
    text = dict(zip(t.column("event_id").to_pylist(), t.column("text").to_pylist()))
    for r in results:
        if r["event_id"] in text:
            r["text"] = text[r["event_id"]]


def render_results(results: list[dict]) -> str:
    """A plain table of search results, best first (text blocks show their text below)."""
    if not results:
        return "no results"
    head = f"{'#':>2}  {'score':>6}  {'session':<16} {'source':<12} {'t (s)':>9}  {'t_ns':>14}  {'gran':<5}  " \
           f"{'box':<19}  event_id"
    lines = [head, "-" * len(head)]
    for r in results:
        b = r["box"]
        box = f"{b['x0']},{b['y0']},{b['x1']},{b['y1']}" if b else "-"
        lines.append(f"{r['rank']:>2}  {r['score']:>6.3f}  {r['session_id'][:16]:<16} {r['source_id'][:12]:<12} "
                     f"{r['t_s']:>9.3f}  {r['t_ns']:>14}  {r['granularity']:<5}  {box:<19}  {r['event_id']}")
        if r.get("text"):
            snippet = " ".join(r["text"].split())
            lines.append(f"{'':>10}{snippet[:100]}{'...' if len(snippet) > 100 else ''}")
    return "\n".join(lines)
