"""Audio embeddings: statistical pooling of MFCC frames, one vector per second.

Sits after audio ingest (``operators/ingest``: PyAV decode -> 16 kHz mono -> MFCC at 100
frames/s, waveform dropped) and the voice policy. No neural model: the raw waveform is
never kept, so the embedding is built from the MFCCs alone.

Pooling ("mfcc-stats@1"): consecutive windows of ``window_frames`` MFCC frames (100 = 1 s
at the 10 ms hop), in input order; per window the mean and the population standard
deviation of every coefficient, concatenated ``[mean_0..mean_{n-1}, std_0..std_{n-1}]``
(``2 * n_mfcc`` dims), then L2-normalised. Coefficient 0 (log energy) has the largest
magnitude and dominates the mean half; consumers that want loudness-invariant vectors
drop or standardise it upstream. A window's row takes ``event_id`` and ``t_ns`` of its
first frame; granularity is ``frame``. The operator is stateless: windows start at the
first row of each table, so the pipeline hands it a source's frames in whole seconds (a
trailing window shorter than ``min_frames`` is dropped, a longer one is pooled as it is).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pyarrow as pa
from pydantic import Field

from modalign.operators.base import OperatorConfig, TableOperator
from modalign.operators.cache.keys import FeatureRowsBuilder, cache_key, feature_schema
from modalign.operators.cache.store import FeatureCache
from modalign.operators.embed.image import l2_normalise
from modalign.schemas.errors import InputError

MODEL_ID = "mfcc-stats@1"
NORMALISATION = "l2"


class AudioEmbedConfig(OperatorConfig):
    window_frames: int = Field(100, ge=2, description="MFCC frames per vector (100 = 1 s at a 10 ms hop)")
    min_frames: int = Field(25, ge=1, description="a trailing window with fewer frames is dropped")
    modality: str = Field("audio", description="modality written on the rows")


def mfcc_stats(window: np.ndarray) -> np.ndarray:
    """L2-normalised [mean, std] per coefficient of a (frames, n_mfcc) window."""
    w = np.asarray(window, dtype=np.float64)
    return l2_normalise(np.concatenate([w.mean(axis=0), w.std(axis=0)]))


class AudioEmbedOperator(TableOperator[AudioEmbedConfig]):
    """MFCC frames -> one ``frame`` feature row per window of ``window_frames``.

    Input columns: ``event_id`` string, ``t_ns`` int64, ``mfcc`` fixed_size_list<float32>
    (or list<float32> of constant length). Output: ``feature_schema()``, model_id
    ``mfcc-stats@1``, ``dim = 2 * n_mfcc``, ``box`` null.
    """

    kind: ClassVar[str] = "audio_embed"
    version: ClassVar[str] = "0.1.0"
    config_model: ClassVar[type[OperatorConfig]] = AudioEmbedConfig
    model_id: ClassVar[str] = MODEL_ID

    def __init__(self, config: AudioEmbedConfig | None = None, *, cache: FeatureCache | None = None) -> None:
        super().__init__(config)
        self.cache = cache

    def output_schema(self, input_schema: pa.Schema) -> pa.Schema:
        return feature_schema()

    def process(self, table: pa.Table) -> pa.Table:
        self.ensure_setup()
        mfcc = _mfcc_matrix(table, self.kind)
        event_ids = table.column("event_id").to_pylist()
        t_ns = table.column("t_ns").to_pylist()
        cfg, cache = self.config, self.cache
        out = FeatureRowsBuilder()
        for start in range(0, len(mfcc), cfg.window_frames):
            window = mfcc[start : start + cfg.window_frames]
            if len(window) < min(cfg.min_frames, cfg.window_frames):
                break
            key = cache_key(window, model_id=MODEL_ID, granularity="frame", resolution=cfg.window_frames,
                            crop_box=None, normalisation=NORMALISATION)
            vec = cache.get(key, "frame") if cache is not None else None
            if vec is None:
                vec = mfcc_stats(window)
                if cache is not None:
                    cache.put(key, "frame", vec, model_id=MODEL_ID)
            out.add(cache_key=key, granularity="frame", modality=cfg.modality, event_id=event_ids[start],
                    t_ns=t_ns[start], box=None, vector=vec, model_id=MODEL_ID)
        return out.to_table()


def _mfcc_matrix(table: pa.Table, stage: str) -> np.ndarray:
    """(frames, n_mfcc) float32 view of the ``mfcc`` column."""
    missing = [c for c in ("event_id", "t_ns", "mfcc") if c not in table.column_names]
    if missing:
        raise InputError(f"MFCC table lacks column(s) {missing}", stage=stage, code="schema_mismatch")
    col = table.column("mfcc")
    if len(table) == 0:
        n = col.type.list_size if pa.types.is_fixed_size_list(col.type) else 0
        return np.zeros((0, n), np.float32)
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if arr.null_count:
        raise InputError("MFCC column has null frames", stage=stage, code="schema_mismatch")
    if pa.types.is_fixed_size_list(arr.type):
        n = arr.type.list_size
        flat = arr.flatten()
    elif pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        lengths = np.unique(arr.value_lengths().to_numpy(zero_copy_only=False))
        if len(lengths) != 1:
            raise InputError("MFCC frames have different lengths", stage=stage, code="schema_mismatch")
        n = int(lengths[0])
        flat = arr.flatten()
    else:
        raise InputError(f"column 'mfcc' must be a list of float32, got {arr.type}", stage=stage,
                         code="schema_mismatch")
    return flat.to_numpy(zero_copy_only=False).astype(np.float32, copy=False).reshape(len(arr), n)
